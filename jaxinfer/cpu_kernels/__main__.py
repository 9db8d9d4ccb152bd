"""Builds the native CPU kernels now (they are otherwise built on first use) and says which this machine runs:
each kernel's variant is the fastest ISA this CPU supports ($JAXINFER_CPU_ISA=avx_vnni or avx2 caps it there).

.venv/bin/python -m jaxinfer.cpu_kernels
"""

import importlib
import os

from jaxinfer.cpu_kernels.native_build import cache_dir, cpu_description


def main() -> None:
    print(cpu_description())
    for title, module in [
        ("int8 matmul", "int8_matmul_vnni"),
        ("int4 matmul", "int4_matmul"),
        ("decode attention", "decode_attention"),
        ("grouped matmul", "grouped_matmul"),
    ]:
        kernel = importlib.import_module(f"jaxinfer.cpu_kernels.{module}").KERNEL
        isa = kernel.chosen_isa()
        if kernel.available():
            print(f"{title}: built, runs the {isa.name} variant")
        elif os.environ.get("JAXINFER_NATIVE_KERNELS", "1") == "0":
            print(f"{title}: off (JAXINFER_NATIVE_KERNELS=0; XLA serves instead)")
        elif isa is None:
            print(f"{title}: not available, this CPU has neither AVX2 nor AVX-512 (XLA serves instead)")
        else:
            print(f"{title}: the {isa.name} variant did not build (XLA serves instead; see the log)")
    print(f"libraries in {cache_dir()}")


if __name__ == "__main__":
    main()
