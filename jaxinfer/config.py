"""Frozen configuration dataclasses: the model, its RoPE variant and the KV cache.

Everything here is hashable so that a config can be a static argument of `jax.jit`.
Changing any field of a config passed statically triggers a recompile; nothing else does.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

import jax.numpy as jnp

from jaxinfer.cpu_kernels import decode_attention_available, vnni_available

LayerType = Literal["full_attention", "sliding_attention"]
Activation = Literal["silu", "gelu_tanh"]
# Where a layer's RMSNorms sit: "pre" (Llama: before attention and MLP), "sandwich" (Gemma 2/3: before
# and after each), "post" (OLMo 2: after each, on the branch output only).
NormPlacement = Literal["pre", "sandwich", "post"]
# RMSNorm on queries and keys before RoPE: "head" normalises each head's [head_dim] (Gemma 3, Qwen 3),
# "projection" the whole [heads * head_dim] projection (OLMo 2).
QKNorm = Literal["none", "head", "projection"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency-scaling variant, as Hugging Face configs spell it.

    kind:
      "default" - plain RoPE.
      "linear"  - positions divided by `factor` (all frequencies scaled).
      "llama3"  - Llama 3.1 smooth scaling between `low_freq_factor` and `high_freq_factor`
                  wavelengths relative to `original_max_position_embeddings`.
    """

    kind: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer; every family (jaxinfer/models/) is these fields.

    `arch` names the family (models.FAMILIES); the forward pass reads only the flags below, never the name.
    Norm weights in the params pytree are always the *effective* multiplier: loaders fold Gemma's
    `(1 + w)` convention in, so model code applies `x * w` for every family.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    # Sliding-window layers (Gemma 3 local layers) use their own RoPE base and no scaling.
    rope_local_theta: float = 10000.0
    sliding_window: int | None = None
    layer_types: tuple[LayerType, ...] = ()
    tie_word_embeddings: bool = False
    activation: Activation = "silu"
    # Gemma scales queries by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5.
    query_pre_attn_scalar: float | None = None
    qk_norm: QKNorm = "none"
    norms: NormPlacement = "pre"
    qkv_bias: bool = False  # Qwen 2: biases on the q, k and v projections
    embed_scale: float = 1.0  # Gemma: sqrt(hidden)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): every layer's MLP is `num_experts` gated MLPs of
    # `expert_intermediate_size`, `experts_per_token` of them chosen per token by a softmax router whose
    # top-k weights are renormalised to sum to 1 when `normalize_expert_weights`. 0 experts: a dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = True
    name: str = ""

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)=} must equal {self.num_layers=}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")
        for name, kind in (("norms", NormPlacement), ("qk_norm", QKNorm), ("activation", Activation)):
            if getattr(self, name) not in typing.get_args(kind):
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {typing.get_args(kind)}")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"{self.experts_per_token=} must be in [1, {self.num_experts=}]")
        if self.num_experts and self.expert_intermediate_size < 1:
            raise ValueError(f"{self.expert_intermediate_size=} must be positive in an MoE model")

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which implementation runs attention and quantised matmuls (static: a change recompiles).

    attention: "xla" (plain JAX over pages gathered through the page table, the reference path),
        "pallas" (pallas_kernels.paged_attention: prefill and decode attention reading the pages in
        the kernel) or "native" (jaxinfer.cpu_kernels' C++ paged attention, AVX-512 or AVX2, over float32,
        bfloat16 or int8 pages: decode, verification and prefill, each query up to its own position).
    matmul: "xla", "pallas" (the int8 and int4 weight kernels) or "native" (jaxinfer.cpu_kernels' C++
        kernels, AVX-512 VNNI or AVX2: int8 weights at two or more rows and int4 weights at every row
        count; the weights need their packed forms, runtime.add_kernel_forms). Float weights always
        use XLA.
    int8_activations: for int8 weights at more than one row, quantise activations per row to int8 and
        run an int8 x int8 -> int32 dot (XLA:CPU runs the dequantise-then-dot form ~10x slower there;
        without this flag, the native VNNI kernel or a bf16 weight copy serves several rows there).
    interpret: run Pallas kernels in interpret mode (CPU).
    native_attention_min_rows: fewest decode rows that attend through the native kernel (runtime sets 1
        where every output projection is a native int4 call: kernel_dispatch.native_attention_min_rows).
    """

    attention: Literal["xla", "pallas", "native"] = "xla"
    matmul: Literal["xla", "pallas", "native"] = "xla"
    int8_activations: bool = False
    interpret: bool = False
    native_attention_min_rows: int = 2

    @classmethod
    def for_backend(
        cls, backend: str, attention: str = "auto", *, single_device: bool = True
    ) -> KernelConfig:
        """`auto` picks the fastest correct path: Pallas kernels on TPU/GPU; on CPU, the native kernels
        where this CPU and a C++ compiler allow them, else XLA. Native kernels need one device (their
        custom calls have no sharding rule); `attention` other than auto is kept as given."""
        if attention not in ("auto", "xla", "pallas", "native"):
            raise ValueError(
                f"attention implementation must be auto, xla, pallas or native, got {attention!r}"
            )
        accelerated = backend in ("tpu", "gpu", "cuda", "rocm")
        native_cpu = single_device and backend == "cpu"
        if attention == "native" and not (native_cpu and decode_attention_available()):
            raise ValueError(
                "attention 'native' needs one CPU device with AVX2 or AVX-512 and a C++ compiler "
                "(python -m jaxinfer.cpu_kernels says what this machine runs)"
            )
        if attention == "auto":
            if accelerated:
                attention = "pallas"
            else:
                attention = "native" if native_cpu and decode_attention_available() else "xla"
        if accelerated:
            matmul = "pallas"
        else:
            matmul = "native" if native_cpu and vnni_available() else "xla"
        return cls(attention=attention, matmul=matmul, interpret=not accelerated)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache (kv_cache.py): a pool of fixed-size pages shared by every request.

    num_pages: pages in the pool, including the reserved null page 0 (see kv_cache.py).
    page_size: positions per page.
    max_len: most positions one request may hold (prompt plus output), a cap, not a reservation.
    num_slots: decode rows: most requests running at once, each with its own sampling state.
    dtype "int8" stores K/V as int8 with one float32 scale per (token, head).
    """

    num_pages: int
    page_size: int
    max_len: int
    num_slots: int
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("num_pages", "page_size", "max_len", "num_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_pages < 2:
            raise ValueError(f"{self.num_pages=} must be at least 2 (page 0 is the null page)")
        jnp.dtype(self.dtype)  # raises on an unknown dtype name

    @property
    def pages_per_seq(self) -> int:
        """Width of a request's page table: enough pages for max_len positions."""
        return -(-self.max_len // self.page_size)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1
