"""Pallas kernels for jaxinfer, each beside a plain-JAX reference with the same signature.

Kernels lower natively on TPU (Mosaic) and GPU (Triton) and run on CPU with `interpret=True`
(`default_interpret()` says which applies to the current backend).
"""

from pallas_kernels._common import default_interpret
from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_kernels.int4_matmul import int4_matmul, int4_matmul_reference
from pallas_kernels.int8_matmul import (
    dequantize_int8,
    dequantize_kv_int8,
    int8_matmul,
    int8_matmul_reference,
    quantize_int8,
    quantize_kv_int8,
)
from pallas_kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

__all__ = [
    "decode_attention",
    "decode_attention_reference",
    "default_interpret",
    "dequantize_int8",
    "dequantize_kv_int8",
    "flash_attention",
    "flash_attention_reference",
    "int4_matmul",
    "int4_matmul_reference",
    "int8_matmul",
    "int8_matmul_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "quantize_int8",
    "quantize_kv_int8",
]
