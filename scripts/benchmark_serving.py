r"""Load-test a running jaxinfer server: the same code as `jaxinfer bench-serving` (bench_serving.py).

    python scripts/benchmark_serving.py --target 127.0.0.1:50051 --result-file R.json \
        --sweep-rates 0.5,1,2 --plot
"""

import sys

from jaxinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench-serving", *sys.argv[1:]]))
