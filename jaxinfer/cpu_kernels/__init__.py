"""Native CPU kernels (C++ through XLA's FFI), built on first use; see int8_matmul_vnni.py."""

from jaxinfer.cpu_kernels.int8_matmul_vnni import (
    int8_matmul_vnni,
    int8_matmul_vnni_reference,
    pack_weight,
    quantize_activations,
    supports,
    vnni_available,
)

__all__ = [
    "int8_matmul_vnni",
    "int8_matmul_vnni_reference",
    "pack_weight",
    "quantize_activations",
    "supports",
    "vnni_available",
]
