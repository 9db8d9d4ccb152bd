"""Offline batch generation from JSONL: the same code as `jaxinfer batch` (see jaxinfer/batch.py).

python scripts/batch_generate.py INPUT.jsonl OUTPUT.jsonl [--model ...] [--strict] [sampling flags]
"""

import sys

from jaxinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["batch", *sys.argv[1:]]))
