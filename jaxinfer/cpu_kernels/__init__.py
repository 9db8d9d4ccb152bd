"""Native CPU kernels (C++ through XLA's FFI, built on first use): int8_matmul_vnni, int4_matmul,
decode_attention."""

from jaxinfer.cpu_kernels.decode_attention import (
    decode_attention_available,
    decode_attention_cpu,
    decode_attention_cpu_reference,
)
from jaxinfer.cpu_kernels.decode_attention import supports as decode_attention_supports
from jaxinfer.cpu_kernels.grouped_matmul import grouped_matmul_available as grouped_matmul_available
from jaxinfer.cpu_kernels.int4_matmul import (
    exact_in_float16,
    int4_matmul_available,
    int4_matmul_cpu,
    int4_matmul_cpu_reference,
    pack_int4,
    pack_int5,
    unpack_int4,
)
from jaxinfer.cpu_kernels.int4_matmul import supports as int4_matmul_supports
from jaxinfer.cpu_kernels.int8_matmul_vnni import (
    int8_matmul_vnni,
    int8_matmul_vnni_reference,
    pack_weight,
    supports,
    vnni_available,
)

__all__ = [
    "decode_attention_available",
    "decode_attention_cpu",
    "decode_attention_cpu_reference",
    "decode_attention_supports",
    "exact_in_float16",
    "int4_matmul_available",
    "int4_matmul_cpu",
    "int4_matmul_cpu_reference",
    "int4_matmul_supports",
    "int8_matmul_vnni",
    "int8_matmul_vnni_reference",
    "pack_int4",
    "pack_int5",
    "pack_weight",
    "supports",
    "unpack_int4",
    "vnni_available",
]
