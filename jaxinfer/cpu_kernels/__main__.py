"""Builds the native CPU kernels now (they are otherwise built on first use) and says which this machine runs.

.venv/bin/python -m jaxinfer.cpu_kernels
"""

from jaxinfer.cpu_kernels import decode_attention_available, vnni_available
from jaxinfer.cpu_kernels.native_build import cache_dir


def main() -> None:
    for name, available in [
        ("int8 matmul (AVX-512 VNNI)", vnni_available()),
        ("decode attention (AVX-512F)", decode_attention_available()),
    ]:
        print(f"{name}: {'built' if available else 'not available on this machine (XLA serves instead)'}")
    print(f"libraries in {cache_dir()}")


if __name__ == "__main__":
    main()
