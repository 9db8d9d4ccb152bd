"""The Engine on JAX: jitted prefill and decode over one donated device state (page pool + per-slot state).

Programs, all compiled ahead of time and kept in a table keyed by their static shape bucket:
  prefill(T, N): one chunk of T tokens (bucketed) of one request, written into its pages, attending
                 over the first N pages of its page table (N: the page bucket that holds the chunk's
                 end; a chunk after a cached prefix reads the prefix's pages too); its output is the
                 hidden state of the chunk's last token.
  prefill_sample: the token after a chunk, from that hidden state: one program for every (T, N), as
                 the sampler costs about as much to compile as a small model's forward pass.
  decode(N, R):  one token for each of the first R slots (the smallest power of two holding every
                 listed slot), attending over N pages per row, the smallest page bucket that holds the
                 longest row, sampled in the same program. Kernels that read each row to its own
                 length (native, Pallas) need one page bucket: the whole page table.
  verify(N, R, W): speculative decoding (num_draft_tokens = k > 0): each of the first R slots runs its
                 last token and up to W drafts as W + 1 positions, keeps the drafts the model agrees
                 with and adds one token of its own (1 to W + 1 tokens per slot); W is the narrowest
                 width bucket (1, 2, 4, ..., k) holding the step's longest row of drafts. A decode
                 step is the same function with no drafts.
With draft heads, prefill samplers and verify programs also propose each slot's next drafts (W = 0: a
decode step that proposes, after a step whose heads were unsure of every draft).
Nothing else is traced while serving: `warmup()` compiles every bucket, and `compile_count` tells a test
whether anything compiled later. A second start reuses them: `serve` and `batch` load them without
tracing (program_cache), elsewhere JAX's persistent compilation cache skips their XLA compilation.

The engine keeps no host-side record of requests: every call carries the positions and page tables it
needs (the scheduler owns them), so the programs and their buckets follow from the arguments alone.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer import engine as api
from jaxinfer.config import CacheConfig, KernelConfig, ModelConfig
from jaxinfer.cpu_kernels.native_build import register_chosen_kernels
from jaxinfer.jit_mappings import MappingBudget
from jaxinfer.kernel_dispatch import MAX_QUERIES_AS_ROWS, ROWS_AS_VECTORS, native_attention
from jaxinfer.kv_cache import KVCache, init_cache
from jaxinfer.layer_stack import stack_layers
from jaxinfer.models.params import Params
from jaxinfer.models.transformer import forward_hidden, output_logits
from jaxinfer.program_cache import ProgramCache, serves
from jaxinfer.request import MAX_TOP_LOGPROBS, SamplingParams
from jaxinfer.sampling import SlotSampling, sample, split_seed, token_logprobs, verify_drafts
from jaxinfer.sharding import DATA, make_mesh, shard_params, slot_spec
from jaxinfer.speculation.config import DEFAULT_DRAFT_MIN_PROBABILITY, depth_threshold, min_probabilities
from jaxinfer.speculation.draft_heads import DraftHeads, ServedHeads, for_serving, propose
from jaxinfer.speculation.step_costs import StepCosts
from jaxinfer.speculation.thresholds import HeldOutDrafts, best_thresholds
from jaxinfer.structured_output import ALLOW_ALL, allow_all, mask_words

log = logging.getLogger(__name__)

MAX_STOP_IDS = 16  # stop token ids per request checked on device (eos ids included)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything on the device that lives across steps. Arrays other than the cache are [slots, ...]."""

    cache: KVCache
    tokens: jax.Array  # int32: the last sampled token, input of the next decode step
    active: jax.Array  # bool: the slot's request has not ended on the device
    generated: jax.Array  # int32: output tokens so far
    max_tokens: jax.Array  # int32
    stop_ids: jax.Array  # int32 [slots, MAX_STOP_IDS], -1 padded
    sampling: SlotSampling
    counts: jax.Array  # int32 [slots, vocab]: occurrences in the prompt and output, for penalties


def _first_end(
    stop_ids: jax.Array,  # [n, MAX_STOP_IDS]
    max_tokens: jax.Array,  # [n]
    tokens: jax.Array,  # [n, T]: each row's new tokens, in order
    count: jax.Array,  # [n]: how many of them are real
    generated: jax.Array,  # [n]: output tokens before them
    length: jax.Array,  # [n]: tokens in the cache once the first of them is written
    max_len: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each row's request ends among its new tokens: at a stop id, at max_tokens or at the
    context's end. Returns (done [n], the index of the ending token [n], its FINISH_* reason [n])."""
    index = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    hit_stop = jnp.any(stop_ids[:, None, :] == tokens[:, :, None], axis=-1)
    too_long = (generated[:, None] + index + 1 >= max_tokens[:, None]) | (length[:, None] + index >= max_len)
    ends = (hit_stop | too_long) & (index < count[:, None])
    first = jnp.argmax(ends, axis=1)
    done = jnp.any(ends, axis=1)
    stop = jnp.take_along_axis(hit_stop, first[:, None], axis=1)[:, 0]
    reason = jnp.where(done, jnp.where(stop, api.FINISH_STOP, api.FINISH_LENGTH), api.FINISH_NONE)
    return done, first, reason.astype(jnp.int32)


def _pack(tokens, num_tokens, done, reason, logprobs, drafts) -> jax.Array:
    """One [n, width] int32 array per step (copying one array to the host beats several):
    num_tokens, done, reason, the tokens [T], their log-probabilities [T], the top ids [T, K] and their
    log-probabilities [T, K] (floats as their int32 bits), the head drafts [depth].

    tokens: [n, T]; num_tokens, done, reason: [n]; logprobs: ([n, T], [n, T, k], [n, T, k]) with
    k <= MAX_TOP_LOGPROBS; drafts: [n, depth] or None."""
    chosen, top_vals, top_ids = logprobs
    n, t = tokens.shape

    def bits(x):
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)

    pad = ((0, 0), (0, 0), (0, MAX_TOP_LOGPROBS - top_ids.shape[-1]))  # a vocabulary below MAX_TOP_LOGPROBS
    top_ids, top_vals = jnp.pad(top_ids, pad), jnp.pad(bits(top_vals), pad)
    flags = jnp.stack([num_tokens, done.astype(jnp.int32), reason], -1)
    parts = [flags, tokens, bits(chosen), top_ids.reshape(n, -1), top_vals.reshape(n, -1)]
    if drafts is not None:
        parts.append(drafts)
    return jnp.concatenate(parts, axis=-1)


def _step_logprobs(logits, tokens, settings, t: int):
    """token_logprobs over logits [n * t, vocab] for tokens [n, t], shaped [n, t, ...]."""
    n = tokens.shape[0]
    rows = jax.tree.map(lambda a: jnp.repeat(a, t, axis=0), settings) if t > 1 else settings
    chosen, vals, ids = token_logprobs(logits, tokens.reshape(-1), rows, MAX_TOP_LOGPROBS)
    return chosen.reshape(n, t), vals.reshape(n, t, -1), ids.reshape(n, t, -1)


def _propose(served, params, config, kernels, hidden, token, drafting=None):
    """The heads' drafts after `token` [n] from hidden [n, hidden_size] for the `drafting` rows [n]
    (default: all); None without heads."""
    if served is None:
        return None
    heads = served.heads
    return propose(
        heads, params, config, hidden, token, heads.depth, kernels, served.min_probability, drafting
    )


def _prefill_forward(
    params: Params,
    state: DecodeState,
    tokens: jax.Array,  # [1, T] int32, padded
    chunk: jax.Array,  # int32 [6]: slot, start, true_len, is_last, num_generated, drafting
    page_row: jax.Array,  # [1, N] int32: the request's first N pages
    *,
    config: ModelConfig,
    kernels: KernelConfig,
) -> tuple[DecodeState, jax.Array]:
    """Writes one chunk's K/V into its pages: (state, the hidden state of its last token [1, hidden])."""
    start, true_len = chunk[1], chunk[2]
    offsets = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    positions = jnp.where(offsets < true_len, start + offsets, -1)[None]  # padding writes nothing
    hidden, cache = forward_hidden(params, config, tokens, positions, state.cache, page_row, kernels=kernels)
    last = jax.lax.dynamic_index_in_dim(hidden[0], jnp.maximum(true_len - 1, 0), keepdims=True)
    return dataclasses.replace(state, cache=cache), last


def _prefill_sample(
    params: Params,
    state: DecodeState,
    heads: ServedHeads | None,
    hidden: jax.Array,  # [1, hidden]: the chunk's last token (_prefill_forward)
    chunk: jax.Array,  # int32 [6]: slot, start, true_len, is_last, num_generated, drafting
    counts_row: jax.Array,  # [1, vocab] int32: the tokens the request has seen (read when is_last)
    mask_row: jax.Array,  # [1, ceil(vocab / 32)] int32: tokens its first output may be (sampling.py)
    settings: SlotSampling,  # this request's settings, arrays of shape [1]
    max_tokens: jax.Array,  # [1] int32
    stop_ids: jax.Array,  # [1, MAX_STOP_IDS] int32
    *,
    config: ModelConfig,
    kernels: KernelConfig,
    max_len: int,
) -> tuple[DecodeState, jax.Array]:
    """Samples a chunk's next token and sets up its slot: the one prefill program of every bucket."""
    slot, start, true_len = chunk[0], chunk[1], chunk[2]
    is_last, num_generated, drafting = chunk[3].astype(bool), chunk[4], chunk[5].astype(bool)
    logits = output_logits(params, config, hidden, kernels)
    token = sample(logits, counts_row, settings, num_generated[None], mask_row)  # [1]
    logprobs = _step_logprobs(logits, token[:, None], settings, 1)
    length = start + true_len
    generated = num_generated + 1
    one = jnp.ones(1, jnp.int32)
    done, _, reason = _first_end(
        stop_ids, max_tokens, token[:, None], one, num_generated[None], length[None], max_len
    )

    def put(field, value):
        return field.at[slot].set(value)

    state = dataclasses.replace(
        state,
        tokens=put(state.tokens, token[0]),
        active=put(state.active, is_last & ~done[0]),
        generated=put(state.generated, generated),
        max_tokens=put(state.max_tokens, max_tokens[0]),
        stop_ids=put(state.stop_ids, stop_ids[0]),
        sampling=jax.tree.map(lambda f, v: f.at[slot].set(v[0]), state.sampling, settings),
        counts=put(state.counts, counts_row[0].at[token[0]].add(1)),
    )
    num_slots = state.tokens.shape[0]
    drafts = _propose(heads, params, config, kernels, hidden, token, drafting[None])
    row = _pack(token[:, None], is_last.astype(jnp.int32)[None], done, reason, logprobs, drafts)
    out = jnp.zeros((num_slots, row.shape[1]), jnp.int32).at[slot].set(row[0])
    return state, out


def _all_slots(packed: jax.Array, num_slots: int) -> jax.Array:
    """A step's packed rows [n, w] for the first n slots, padded to every slot."""
    n = packed.shape[0]
    return packed if n == num_slots else jnp.pad(packed, ((0, num_slots - n), (0, 0)))


def _fed(state: DecodeState, positions: jax.Array, drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Which rows step ([n]: listed and active) and which of their k + 1 inputs are real ([n, k + 1]:
    the last token and the drafts before the first -1)."""
    n, k = drafts.shape
    active = state.active[:n] & (positions >= 0)
    num_drafts = jnp.sum(jnp.cumprod(drafts >= 0, axis=1), axis=1)
    return active, active[:, None] & (jnp.arange(k + 1, dtype=jnp.int32)[None] <= num_drafts[:, None])


def _step_forward(
    params: Params,
    state: DecodeState,
    positions: jax.Array,  # [R] int32: each row's input position, -1 for rows left out
    drafts: jax.Array,  # [R, k] int32: drafts after each row's input token, -1 past its drafts
    page_table: jax.Array,  # [R, N] int32, covering every draft's position
    *,
    config: ModelConfig,
    kernels: KernelConfig,
) -> tuple[DecodeState, jax.Array]:
    """The model half of a decode step (k = 0) or a verification step: each of the first R slots runs
    its last token and its k drafts as k + 1 positions. Returns (state, hidden states [R, k + 1, hidden]).

    Every input's K/V entry is written; entries past a row's accepted tokens are left behind and
    overwritten by the next step, which writes from the row's new length on (attention never reads
    past a query's own position)."""
    n = drafts.shape[0]
    _, fed = _fed(state, positions, drafts)
    inputs = jnp.concatenate([state.tokens[:n, None], jnp.maximum(drafts, 0)], axis=1)  # [n, t]
    offsets = jnp.arange(fed.shape[1], dtype=jnp.int32)
    hidden, cache = forward_hidden(
        params, config, inputs, jnp.where(fed, positions[:, None] + offsets, -1), state.cache,
        page_table, kernels=kernels,
    )  # fmt: skip
    return dataclasses.replace(state, cache=cache), hidden


def _step(
    params: Params,
    state: DecodeState,
    heads: ServedHeads | None,
    positions: jax.Array,  # [R] int32: each row's input position, -1 for rows left out
    drafts: jax.Array,  # [R, k] int32: drafts after each row's input token, -1 past its drafts
    page_table: jax.Array,  # [R, N] int32, covering every draft's position
    mask: jax.Array,  # [R, ceil(vocab / 32)] int32: tokens each row's first output may be
    drafting: jax.Array | None = None,  # [R] bool: rows whose next drafts the heads propose
    *,
    config: ModelConfig,
    kernels: KernelConfig,
    max_len: int,
) -> tuple[DecodeState, jax.Array]:
    """A decode (k = 0) or verification step as one program: _step_forward, then _step_sample.

    Unlike prefill, the sampler is not a program of its own: a step runs every token, where handing
    its hidden states to a second program costs more than the compilation it saves (on XLA:CPU, 3-12%
    of a one-row SmolLM2 step; docs/benchmarks.md), and with the native or Pallas attention a row
    bucket has one page bucket anyway. Every listed slot lies below R (the scheduler fills the lowest
    free slot first): at low load a small row bucket is several times faster on CPU."""
    state, hidden = _step_forward(
        params, state, positions, drafts, page_table, config=config, kernels=kernels
    )
    return _step_sample(
        params, state, heads, hidden, positions, drafts, mask, drafting, config=config,
        kernels=kernels, max_len=max_len,
    )  # fmt: skip


def _step_sample(
    params: Params,
    state: DecodeState,
    heads: ServedHeads | None,
    hidden: jax.Array,  # [R, k + 1, hidden] (_step_forward)
    positions: jax.Array,  # [R] int32
    drafts: jax.Array,  # [R, k] int32
    mask: jax.Array,  # [R, ceil(vocab / 32)] int32: tokens each row's first output may be
    drafting: jax.Array | None = None,  # [R] bool: rows whose next drafts the heads propose
    *,
    config: ModelConfig,
    kernels: KernelConfig,
    max_len: int,
) -> tuple[DecodeState, jax.Array]:
    """The sampling half of a step: sampling.verify_drafts keeps the drafts the target agrees with,
    and each row outputs those plus the target's next token (1 to k + 1 tokens; one with no drafts).
    The host owns the lengths: it learns each row's advance from `num_tokens` in the result."""
    n, k = drafts.shape
    t, num_slots = k + 1, state.tokens.shape[0]
    rows = jnp.arange(n, dtype=jnp.int32)
    offsets = jnp.arange(t, dtype=jnp.int32)
    active, fed = _fed(state, positions, drafts)
    logits = output_logits(params, config, hidden, kernels)  # [n, t, vocab]
    sampling = jax.tree.map(lambda a: a[:n], state.sampling)
    generated = state.generated[:n]
    drafts = jnp.where(fed[:, 1:], drafts, -1)
    tokens, accepted = verify_drafts(logits, drafts, state.counts, sampling, generated, mask)

    # The request may end inside the accepted run.
    done, first_end, reason = _first_end(
        state.stop_ids[:n], state.max_tokens[:n], tokens, accepted + 1, generated, positions + 1, max_len
    )
    done &= active
    num_tokens = jnp.where(done, first_end + 1, accepted + 1) * active
    reason = jnp.where(done, reason, api.FINISH_NONE)
    last = jnp.maximum(num_tokens - 1, 0)
    last_token = tokens[rows, last]
    emitted = (offsets[None] < num_tokens[:, None]).astype(jnp.int32)  # [n, t]

    def put(field: jax.Array, values: jax.Array) -> jax.Array:
        return field.at[:n].set(values)

    state = dataclasses.replace(
        state,
        tokens=put(state.tokens, jnp.where(active, last_token, state.tokens[:n])),
        generated=put(state.generated, generated + num_tokens),
        active=put(state.active, state.active[:n] & ~done),
        counts=state.counts.at[rows[:, None], tokens].add(emitted),  # rows < n: in place, no slice
    )
    logprobs = _step_logprobs(logits.reshape(n * t, -1), tokens, sampling, t)
    if drafting is not None:  # rows that go on: a finished request drafts nothing
        drafting = drafting & active & ~done
    next_drafts = _propose(heads, params, config, kernels, hidden[rows, last], last_token, drafting)
    packed = _pack(tokens, num_tokens, done, reason, logprobs, next_drafts)
    return state, _all_slots(packed, num_slots)


def power_of_two_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """smallest, 2*smallest, ... below largest, then largest itself."""
    buckets, b = [], smallest
    while b < largest:
        buckets.append(b)
        b *= 2
    return (*buckets, largest)


def with_midpoints(buckets: tuple[int, ...]) -> tuple[int, ...]:
    """Adds 3/2 of each bucket that the next one doubles: (64, 128, 256) -> (64, 96, 128, 192, 256)."""
    mid = [3 * a // 2 for a, b in zip(buckets, buckets[1:]) if b == 2 * a and a % 2 == 0]
    return tuple(sorted({*buckets, *mid}))


class _Pending(api.PendingStep):
    def __init__(self, packed: Sequence[jax.Array], t: int, depth: int):
        self._packed = list(packed)
        self._t, self._depth = t, depth
        for array in self._packed:
            array.copy_to_host_async()
        self._output: api.StepOutput | None = None

    def result(self) -> api.StepOutput:
        if self._output is None:
            rows = np.zeros_like(np.asarray(self._packed[0]))
            for array in self._packed:  # prefill: one array per chunk, each valid only in its slot's row
                host = np.asarray(array)
                rows = np.where(host[:, :1] > 0, host, rows)
            n, t, k = rows.shape[0], self._t, MAX_TOP_LOGPROBS
            at = 3
            tokens, at = rows[:, at : at + t], at + t
            chosen, at = rows[:, at : at + t].view(np.float32), at + t
            top_ids, at = rows[:, at : at + t * k].reshape(n, t, k), at + t * k
            top_vals, at = rows[:, at : at + t * k].view(np.float32).reshape(n, t, k), at + t * k
            self._output = api.StepOutput(
                tokens=tokens, num_tokens=rows[:, 0], done=rows[:, 1] == 1, reason=rows[:, 2],
                logprobs=chosen, top_ids=top_ids, top_logprobs=top_vals,
                drafts=rows[:, at : at + self._depth] if self._depth else None,
            )  # fmt: skip
        return self._output


class JaxEngine(api.Engine):
    """Continuous-batching engine over one model replica (possibly sharded over a mesh)."""

    def __init__(
        self,
        params: Params,
        config: ModelConfig,
        cache_config: CacheConfig,
        *,
        mesh: Mesh | None = None,
        max_prefill_chunk: int = 512,
        min_prefill_bucket: int = 16,
        min_attend_bucket: int = 64,
        kernels: KernelConfig | None = None,
        num_draft_tokens: int = 0,
        draft_heads: DraftHeads | None = None,
        draft_min_probability: float | Sequence[float] | None = 0.0,
        held_out_drafts: HeldOutDrafts | None = None,
        program_cache_dir: str | Path | None = None,
    ):
        """num_draft_tokens: most drafts a decode step verifies per row (0: no speculation);
        draft_heads: heads that propose drafts in every prefill and verification step (replicated);
        draft_min_probability: the heads draft while their guess is at least this likely, a threshold
        per depth (propose); None: chosen by warmup() for each row bucket from the heads'
        `held_out_drafts` and the step costs it measures (speculation.thresholds),
        DEFAULT_DRAFT_MIN_PROBABILITY until then or where either is missing; program_cache_dir:
        compiled programs kept there and loaded without tracing (program_cache; one device in one
        process)."""
        self.mesh = mesh or make_mesh()
        self.kernels = kernels or KernelConfig.for_backend(
            jax.default_backend(), "xla", single_device=self.mesh.size == 1
        )
        self.config = config
        self.cache_config = cache_config
        # Weights on their PARAM_RULES shardings (a no-op when loaded with sharding.param_placement).
        self.params = shard_params(params, self.mesh)
        if self.kernels.matmul == "native":  # one device: layers as one buffer per weight
            self.params = {**self.params, "layers": stack_layers(self.params["layers"])}
        self._sampler_params = {k: self.params[k] for k in _SAMPLER_PARAMS if k in self.params}
        max_len, page = cache_config.max_len, cache_config.page_size
        self._prefill_buckets = power_of_two_buckets(
            min(min_prefill_bucket, max_len), min(max_prefill_chunk, max_len)
        )
        # Page buckets: powers of two from the pages of min_attend_bucket positions to a full table.
        pages_per_seq = cache_config.pages_per_seq
        self._page_buckets = power_of_two_buckets(
            min(max(1, min_attend_bucket // page), pages_per_seq), pages_per_seq
        )
        # XLA decode of more than ROWS_AS_VECTORS rows also gets buckets halfway between powers of two:
        # there attention is a large share of a step (SmolLM2 at 16 rows: ~40%, all of it proportional
        # to the positions read), so ~12% padding instead of ~25% is worth twice the decode programs of
        # those rows. A few rows read mostly weights.
        self._many_rows_page_buckets = self._page_buckets
        if self.kernels.attention == "xla":
            self._many_rows_page_buckets = with_midpoints(self._page_buckets)
        # Decode computes a prefix of the slots; a slot split over `data` would reshard a prefix, so a
        # data-parallel mesh always computes every slot.
        slots = cache_config.num_slots
        prefix_ok = self.mesh.shape[DATA] == 1
        self._row_buckets = power_of_two_buckets(1, slots) if prefix_ok else (slots,)
        if num_draft_tokens < 0 or num_draft_tokens + 1 > MAX_QUERIES_AS_ROWS:
            raise ValueError(f"{num_draft_tokens=} must be in [0, {MAX_QUERIES_AS_ROWS - 1}]")
        if draft_heads is not None and draft_heads.hidden_size != config.hidden_size:
            raise ValueError(
                f"draft heads of hidden size {draft_heads.hidden_size}, not {config.hidden_size}"
            )
        self._num_draft_tokens = num_draft_tokens
        # Every process of a multi-host engine must draft alike, and each would measure its own costs.
        choose = draft_min_probability is None and jax.process_count() == 1
        self._held_out_drafts = held_out_drafts if choose and draft_heads is not None else None
        if self._held_out_drafts is not None and self._held_out_drafts.depth != draft_heads.depth:
            log.warning("held-out drafts %d deep for heads %d deep: draft thresholds stay the default",
                        self._held_out_drafts.depth, draft_heads.depth)  # fmt: skip
            self._held_out_drafts = None
        # Verification widths (drafts per row): a step verifies the narrowest that holds its longest row
        # of drafts, since each position costs every row of the step: every width up to 4, powers of two
        # past it (on CPU three drafts cost ~12% more at width 4 than at width 3, every step; the extra
        # program compiles once). Width 0 runs one token per row and only lets the heads propose (a step
        # after one whose heads were unsure of everything).
        self._verify_widths: tuple[int, ...] = ()
        if num_draft_tokens:
            widths = {*range(1, min(num_draft_tokens, 4) + 1), *power_of_two_buckets(1, num_draft_tokens)}
            self._verify_widths = ((0,) if draft_heads is not None else ()) + tuple(sorted(widths))
        replicated = NamedSharding(self.mesh, P())
        self._heads = (
            None
            if draft_heads is None
            else jax.device_put(for_serving(draft_heads, self.kernels), replicated)
        )
        # By row bucket: the heads with the thresholds that bucket's steps draft by (a prefill chunk
        # proposes by the smallest bucket's), and those thresholds per depth.
        self._drafters: dict[int, ServedHeads] = {}
        self.draft_min_probability: dict[int, tuple[float, ...]] = {}
        if draft_heads is not None:
            self.set_draft_min_probability(
                DEFAULT_DRAFT_MIN_PROBABILITY if draft_min_probability is None else draft_min_probability
            )
        self.state = self._init_state()
        self._programs: dict[tuple, object] = {}
        self._allow_all: dict[int, jax.Array] = {}
        self.compile_count = 0  # programs made ready: compiled, or loaded from the program cache
        self.loaded_count = 0  # of them, loaded
        self._warm = False
        self.step_costs: StepCosts | None = None  # measured by warmup() where the engine verifies drafts
        self._program_cache = None
        if program_cache_dir and serves(self.mesh):
            devices = list(self.mesh.devices.flat)
            static = (config, self.kernels, cache_config, self.mesh)
            context = repr((*static, [d.id for d in devices]))
            self._program_cache = ProgramCache(program_cache_dir, context, devices)
            register_chosen_kernels()

    # -- Engine properties -------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.cache_config.num_slots

    @property
    def max_seq_len(self) -> int:
        return self.cache_config.max_len

    @property
    def max_prefill_chunk(self) -> int:
        return self._prefill_buckets[-1]

    @property
    def page_size(self) -> int:
        return self.cache_config.page_size

    @property
    def num_pages(self) -> int:
        return self.cache_config.num_pages

    @property
    def max_draft_tokens(self) -> int:
        return self._num_draft_tokens

    @property
    def draft_heads_depth(self) -> int:
        return 0 if self._heads is None else self._heads.depth

    def set_draft_min_probability(
        self, min_probability: float | Sequence[float], rows: int | None = None
    ) -> None:
        """The probability each depth's draft needs under its head from now on (propose; the last value
        for every deeper draft), in the steps of row bucket `rows` (None: every bucket). Takes effect
        without compiling: the programs read it as an argument."""
        if self._heads is None:
            raise ValueError("this engine has no draft heads")
        if rows is not None and rows not in self._row_buckets:
            raise ValueError(f"{rows} rows is not a row bucket of this engine: {self._row_buckets}")
        given = min_probabilities(min_probability)
        values = tuple(depth_threshold(given, i) for i in range(self.draft_heads_depth))
        array = jax.device_put(np.asarray(values, np.float32), NamedSharding(self.mesh, P()))
        for bucket in self._row_buckets if rows is None else (rows,):
            self._drafters[bucket] = ServedHeads(self._heads, array)
            self.draft_min_probability[bucket] = values

    # -- State and programs ------------------------------------------------------------------------
    def _init_state(self) -> DecodeState:
        c, s = self.config, self.cache_config.num_slots
        slot_sharding = NamedSharding(self.mesh, slot_spec(s, self.mesh))
        matrix_sharding = NamedSharding(self.mesh, P(*slot_spec(s, self.mesh), None))

        def vec(value, dtype):
            return jax.device_put(np.full((s,), value, dtype), slot_sharding)

        def mat(value, dtype, width):
            return jax.device_put(np.full((s, width), value, dtype), matrix_sharding)

        return DecodeState(
            cache=init_cache(c, self.cache_config, self.mesh),
            tokens=vec(0, np.int32),
            active=vec(False, bool),
            generated=vec(0, np.int32),
            max_tokens=vec(1, np.int32),
            stop_ids=mat(-1, np.int32, MAX_STOP_IDS),
            sampling=SlotSampling(
                temperature=vec(0, np.float32),
                top_k=vec(0, np.int32),
                top_p=vec(1, np.float32),
                min_p=vec(0, np.float32),
                repetition_penalty=vec(1, np.float32),
                presence_penalty=vec(0, np.float32),
                frequency_penalty=vec(0, np.float32),
                num_logprobs=vec(-1, np.int32),
                seed=mat(0, np.uint32, 2),
            ),
            counts=mat(0, np.int32, c.vocab_size),
        )

    def _state_shardings(self):
        """The state is created on its declared shardings (kv_cache_spec, slot_spec); keep them fixed."""
        return jax.tree.map(lambda a: a.sharding, self.state)

    def _program(self, key: tuple, args: tuple):
        program = self._programs.get(key)
        if program is None:
            if self._warm:
                log.warning("compiling %s after warm-up: a bucket was missed", key)
            start = time.perf_counter()
            if self._program_cache is None:
                program = self._compile(key, args)
            elif (program := self._program_cache.load(key, args)) is not None:
                self.loaded_count += 1
            else:
                program = self._program_cache.compiled(key, args, lambda: self._compile(key, args))
            self._programs[key] = program
            self.compile_count += 1
            log.debug("made %s ready in %.2fs", key, time.perf_counter() - start)
        return program

    def _compile(self, key: tuple, args: tuple):
        step, samples = _STEPS[key[0]]
        fn = functools.partial(step, config=self.config, kernels=self.kernels)
        # A forward pass hands its hidden states to the sampler on whatever sharding XLA picks; the
        # sampler's packed rows go to the host, so every device holds them.
        out = NamedSharding(self.mesh, P()) if samples else None
        if samples:
            fn = functools.partial(fn, max_len=self.max_seq_len)
        jitted = jax.jit(fn, donate_argnums=(1,), out_shardings=(self._state_shardings(), out))
        return jitted.lower(*args).compile()

    def _run(self, key: tuple, *args) -> jax.Array:
        """Runs the program `key` over (params, state, *args), keeping its new state: its other output.
        The prefill sampler gets the output layer and embeddings alone: each argument buffer costs
        dispatch time (a layer's weights are a dozen)."""
        params = self._sampler_params if key[0] == "prefill_sample" else self.params
        args = (params, self.state, *args)
        self.state, out = self._program(key, args)(*args)
        return out

    def _prefill_chunk(
        self, tokens: np.ndarray, chunk: np.ndarray, page_row: np.ndarray, *sample_args
    ) -> jax.Array:
        """A chunk's two programs: the forward pass of its (T, N) bucket, then the one prefill sampler."""
        hidden = self._run(("prefill", tokens.shape[1], page_row.shape[1]), tokens, chunk, page_row)
        drafter = self._drafters.get(self._row_buckets[0])
        return self._run(("prefill_sample",), drafter, hidden, chunk, *sample_args)

    def _decode_step(
        self,
        positions: np.ndarray,
        drafts: np.ndarray | None,
        page_table: np.ndarray,
        mask: jax.Array | np.ndarray,
        drafting: np.ndarray | None = None,
    ) -> jax.Array:
        """A decode (drafts None) or verification step (drafts [R, width]) of the (N, R) bucket: packed
        rows. With heads, `drafting` [R] bool: the rows whose next drafts they propose."""
        rows, pages = page_table.shape
        if drafts is None:
            return self._run(("decode", pages, rows), None, positions, np.zeros((rows, 0), np.int32),
                             page_table, mask)  # fmt: skip
        key = ("verify", pages, rows, drafts.shape[1])
        if self._heads is None:
            return self._run(key, None, positions, drafts, page_table, mask)
        if drafting is None:
            drafting = positions >= 0
        return self._run(key, self._drafters[rows], positions, drafts, page_table, mask, drafting)

    def _mask_rows(self, masks: np.ndarray | None, rows: int) -> jax.Array | np.ndarray:
        """Token masks [rows, words] in the model's vocabulary width: tokens a shorter tokenizer
        vocabulary lacks are never allowed to a constrained row. Without masks, a cached allow-all array
        (replicated), so nothing crosses to the device. Given masks stay a host array: the program's
        call copies it to its replicated input faster than a device_put of its own (SmolLM2 at 16
        streams on XLA:CPU: ~0.35 ms of a constrained step, where the host waits)."""
        words = mask_words(self.config.vocab_size)
        if masks is None:
            if rows not in self._allow_all:
                replicated = NamedSharding(self.mesh, P())
                self._allow_all[rows] = jax.device_put(allow_all(rows, words), replicated)
            return self._allow_all[rows]
        out = allow_all(rows, words)
        given = np.asarray(masks, np.int32)[:rows]
        width = min(words, given.shape[1])
        constrained = ~np.all(given == ALLOW_ALL, axis=1)
        out[: len(given)][constrained] = 0
        out[: len(given), :width] = np.where(constrained[:, None], given[:, :width], ALLOW_ALL)
        return out

    def _pages(self, positions: int) -> int:
        return -(-positions // self.page_size)

    def _prefill_pages(self, start: int, t: int) -> int:
        """The page bucket of a chunk of bucket t at `start`: every page up to the chunk's end. The
        native kernel reads each query up to its own position: one bucket, the whole table."""
        if self.native_attention(t):
            return self.cache_config.pages_per_seq
        return self._bucket(self._page_buckets, self._pages(min(start + t, self.max_seq_len)))

    def native_attention(self, rows: int) -> bool:
        """Whether steps of `rows` query rows attend through the C++ kernel (kernel_dispatch)."""
        return native_attention(self.kernels, self.state.cache, self.config.head_dim, rows)

    def _decode_page_buckets(self, rows: int) -> tuple[int, ...]:
        """The page buckets of decode steps over `rows` (a row bucket). The native and Pallas kernels
        read each row up to its own length: one program for a whole page table, whatever the lengths."""
        if self.native_attention(rows) or self.kernels.attention == "pallas":
            return (self.cache_config.pages_per_seq,)
        return self._many_rows_page_buckets if rows > ROWS_AS_VECTORS else self._page_buckets

    def _verify_page_buckets(self, rows: int, width: int) -> tuple[int, ...]:
        """The page buckets of verification steps over `rows` rows of width + 1 tokens each."""
        t = width + 1
        if self.native_attention(rows * t):  # each token attends as a decode row of its own
            return (self.cache_config.pages_per_seq,)
        return (
            self._decode_page_buckets(rows)
            if self.kernels.attention == "pallas"
            else (self._many_rows_page_buckets if rows * t > ROWS_AS_VECTORS else self._page_buckets)
        )

    def decode_attend_len(self, rows: int, length: int) -> int:
        """Cache positions a decode step over `rows` rows reads once its longest row holds `length`."""
        if self.native_attention(rows):
            return min(length + 1, self.max_seq_len)
        pages = self._bucket(self._decode_page_buckets(rows), self._pages(length + 1))
        return pages * self.page_size

    def _verify_rows(self) -> tuple[int, ...]:
        """Row buckets of verification steps: all of them, since a row bucket covers slot indices, not a
        count of requests (two requests in slots 0 and 5 decode in the bucket of 8)."""
        return self._row_buckets if self._num_draft_tokens else ()

    def _bucket(self, buckets: tuple[int, ...], n: int) -> int:
        for b in buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")

    # -- Engine API ---------------------------------------------------------------------------------
    def prefill(self, chunks: Sequence[api.PrefillChunk]) -> api.PendingStep:
        slots = [c.slot for c in chunks]
        if len(set(slots)) != len(slots):
            raise ValueError(f"prefill chunks must name distinct slots, got {slots}")
        return _Pending([self._prefill_one(chunk) for chunk in chunks], 1, self.draft_heads_depth)

    def _prefill_one(self, chunk: api.PrefillChunk) -> jax.Array:
        n = len(chunk.token_ids)
        if not 0 <= chunk.slot < self.num_slots:
            raise ValueError(f"slot {chunk.slot} out of range [0, {self.num_slots})")
        if n == 0 or n > self.max_prefill_chunk:
            raise ValueError(f"a prefill chunk holds 1..{self.max_prefill_chunk} tokens, got {n}")
        if chunk.start < 0 or chunk.start + n > self.max_seq_len:
            raise ValueError(
                f"chunk [{chunk.start}, {chunk.start + n}) exceeds the context {self.max_seq_len}"
            )
        if len(chunk.page_ids) < self._pages(chunk.start + n):
            raise ValueError(f"{len(chunk.page_ids)} pages do not cover positions [0, {chunk.start + n})")
        s = chunk.sampling
        if len(s.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(
                f"at most {MAX_STOP_IDS} stop token ids (incl. eos), got {len(s.stop_token_ids)}"
            )
        t = self._bucket(self._prefill_buckets, n)
        pages = self._prefill_pages(chunk.start, t)
        tokens = np.zeros((1, t), np.int32)
        tokens[0, :n] = chunk.token_ids
        page_row = np.zeros((1, pages), np.int32)
        page_ids = chunk.page_ids[:pages]
        page_row[0, : len(page_ids)] = page_ids
        counts_row = np.zeros((1, self.config.vocab_size), np.int32)
        if chunk.is_last:
            counts_row[0] = np.bincount(
                np.asarray(chunk.prompt_token_ids, np.int64), minlength=self.config.vocab_size
            )[: self.config.vocab_size]
        mask_row = self._mask_rows(None if chunk.token_mask is None else chunk.token_mask[None], 1)
        return self._prefill_chunk(
            tokens,
            np.array(
                [chunk.slot, chunk.start, n, int(chunk.is_last), chunk.num_generated, int(chunk.drafting)],
                np.int32,
            ),
            page_row,
            counts_row,
            mask_row,
            _settings(s),
            np.array([s.max_tokens], np.int32),
            _stop_row(s.stop_token_ids),
        )

    def decode(self, batch: api.DecodeBatch) -> api.PendingStep:
        listed = np.flatnonzero(batch.positions >= 0)
        rows = self._bucket(self._row_buckets, int(listed[-1]) + 1 if listed.size else 1)
        positions = np.asarray(batch.positions[:rows], np.int32)
        reach = positions + 1  # positions each row's step writes
        drafts = None
        if batch.drafts is not None:
            k = self._num_draft_tokens
            if k == 0 or batch.drafts.shape[1] > k:
                raise ValueError(f"{batch.drafts.shape[1]} drafts per row; this engine verifies up to {k}")
            given = np.asarray(batch.drafts[:rows], np.int32)
            counts = np.sum(np.cumprod(given >= 0, axis=1), axis=1)  # each row's drafts: up to its first -1
            longest = int(np.max(counts, initial=0))
            wanted = batch.drafting is None or bool(np.any(batch.drafting[:rows]))
            proposing = self._heads is not None and wanted
            if longest or proposing:  # no drafts and nothing for the heads to propose: a plain step
                drafts = np.full((rows, self._bucket(self._verify_widths, longest)), -1, np.int32)
                drafts[:, :longest] = given[:, :longest]
                reach = reach + counts
        if drafts is None:
            buckets = self._decode_page_buckets(rows)
        else:
            buckets = self._verify_page_buckets(rows, drafts.shape[1])
        pages = self._bucket(buckets, max(self._pages(int(np.max(reach, initial=0))), 1))
        page_table = np.zeros((rows, pages), np.int32)
        width = min(pages, batch.page_table.shape[1])
        page_table[:, :width] = batch.page_table[:rows, :width]
        drafting = None if batch.drafting is None else np.asarray(batch.drafting[:rows], bool)
        packed = self._decode_step(
            positions, drafts, page_table, self._mask_rows(batch.token_mask, rows), drafting
        )
        if drafts is not None:
            return _Pending([packed], drafts.shape[1] + 1, self.draft_heads_depth)
        return _Pending([packed], 1, 0)

    def _prefill_args(self, t: int, pages: int) -> tuple:
        """Bucket-shaped arguments of a prefill that changes nothing: an empty chunk into slot 0 (its
        padding writes go to the null page), not the last one, so the slot stays inactive."""
        return (
            np.zeros((1, t), np.int32), np.zeros(6, np.int32), np.zeros((1, pages), np.int32),
            np.zeros((1, self.config.vocab_size), np.int32), self._mask_rows(None, 1),
            _settings(SamplingParams()), np.ones(1, np.int32), _stop_row(()),
        )  # fmt: skip

    def warmup(self, prompt_lengths: Sequence[int] | None = None, max_new_tokens: int = 0) -> float:
        """Compiles programs ahead of use, runs each once, and returns the seconds it took.

        With no arguments, every program serving can hit: prefill for each chunk bucket with each page
        bucket that can hold its end, decode for each (pages, rows) bucket. With `prompt_lengths` (one
        job of that many prompts), only the programs that job needs, so its timings are clean.
        A program's first run costs ~0.4 s more than later ones on XLA:CPU (a SmolLM2 decode step: 440
        vs 42 ms), so each runs once here as a no-op: an empty prefill chunk that leaves slot 0 inactive,
        a decode step listing no row. It must run while no request holds a slot.
        """
        start = time.perf_counter()
        if self._program_cache is not None:
            self._program_cache.preload()
        if prompt_lengths is None:
            prefill = {
                (t, pages)
                for t in self._prefill_buckets
                for pages in self._page_buckets
                if pages >= self._prefill_pages(0, t)
            }
            decode = {(p, rows) for rows in self._row_buckets for p in self._decode_page_buckets(rows)}
            verify = {
                (p, rows, w)
                for rows in self._verify_rows()
                for w in self._verify_widths
                for p in self._verify_page_buckets(rows, w)
            }
        else:
            chunk = self.max_prefill_chunk
            prefill = set()
            for n in prompt_lengths:
                for begin in range(0, n, chunk):
                    t = self._bucket(self._prefill_buckets, min(chunk, n - begin))
                    prefill.add((t, self._prefill_pages(begin, t)))
            shortest = self._pages(min(prompt_lengths) + 1)
            longest = self._pages(min(max(prompt_lengths) + max_new_tokens, self.max_seq_len))
            most_rows = self._bucket(self._row_buckets, min(len(prompt_lengths), self.num_slots))
            decode = set()
            for rows in (r for r in self._row_buckets if r <= most_rows):
                buckets = self._decode_page_buckets(rows)
                first, last = self._bucket(buckets, shortest), self._bucket(buckets, longest)
                decode |= {(p, rows) for p in buckets if first <= p <= last}
            verify = set()
            reach = self._pages(
                min(max(prompt_lengths) + max_new_tokens + self.max_draft_tokens, self.max_seq_len)
            )
            for rows in (r for r in self._verify_rows() if r <= most_rows):
                for w in self._verify_widths:
                    buckets = self._verify_page_buckets(rows, w)
                    first, last = self._bucket(buckets, shortest), self._bucket(buckets, reach)
                    verify |= {(p, rows, w) for p in buckets if first <= p <= last}
        steps = [(pages, rows, None) for pages, rows in sorted(decode)]
        steps += sorted(verify)
        budget = MappingBudget(len(prefill) + len(steps))
        for done, (t, pages) in enumerate(sorted(prefill), 1):
            self._prefill_chunk(*self._prefill_args(t, pages))
            budget.check(done)
        for done, (pages, rows, width) in enumerate(steps, len(prefill) + 1):
            self._idle_step(pages, rows, width)
            budget.check(done)
        jax.block_until_ready(self.state)
        if self._program_cache is not None:
            self._program_cache.drop_preloaded()
        self._warm = prompt_lengths is None
        if verify:
            self.step_costs = self._measure_step_costs(decode, verify)
            if self._held_out_drafts is not None:
                self._choose_draft_thresholds()
        return time.perf_counter() - start

    def _choose_draft_thresholds(self) -> None:
        """For each row bucket whose step costs were just measured, the thresholds under which the
        heads' held-out drafts yield the most tokens per unit of those costs (speculation.thresholds);
        a bucket warm-up did not measure keeps what it had."""
        for rows in sorted(self.step_costs.plain):
            costs = [self.step_costs.ratio(rows, n) for n in range(self.draft_heads_depth + 1)]
            head = self.step_costs.head_ratio(rows)
            if None in costs or head is None:
                continue
            chosen, speed = best_thresholds(self._held_out_drafts, costs, rows, head)
            self.set_draft_min_probability(chosen, rows)
            log.info("draft thresholds at %d rows %s: %.3f modeled tokens per row and plain step (step "
                     "costs %s, a head %.3f)", rows, chosen, speed, " ".join(f"{c:.2f}" for c in costs),
                     head)  # fmt: skip

    def _measure_step_costs(
        self, decode: set[tuple[int, int]], verify: set[tuple[int, int, int]], calls: int = 4, rounds: int = 3
    ) -> StepCosts:
        """Times the warmed-up programs of each row bucket that verifies, in the smallest page bucket
        compiled for it, with no row listed (they change nothing): `calls` plain steps sent one after
        another as the serving loop sends them (their mean), `calls` verification steps per width,
        each read before the next goes out (their median), and where warm-up chooses the draft
        thresholds, the heads' full depth run apart (the median of `calls`, per depth). Each is the
        fastest of `rounds` rounds, the kinds interleaved: the noise of a shared machine only ever adds
        time."""
        plain, verified, head = {}, {}, {}
        for rows in sorted({r for _, r, _ in verify}):
            pages = min(p for p, r in decode if r == rows)
            widths = {
                w: min(p for p, r, v in verify if (r, v) == (rows, w)) for _, r, w in verify if r == rows
            }
            # Only the threshold choice prices the heads: a server that does not choose compiles no timer.
            heads = self._heads_timer(rows) if self._held_out_drafts is not None else None
            for _ in range(rounds):
                begin = time.perf_counter()
                steps = [self._idle_step(pages, rows, None) for _ in range(calls)]
                np.asarray(steps[-1])
                plain[rows] = min(plain.get(rows, np.inf), (time.perf_counter() - begin) / calls)
                for width, at in sorted(widths.items()):
                    seconds = _median_seconds(lambda: self._idle_step(at, rows, width), calls)  # noqa: B023
                    verified[rows, width] = min(verified.get((rows, width), np.inf), seconds)
                if heads is not None:
                    seconds = _median_seconds(heads, calls) / self.draft_heads_depth
                    head[rows] = min(head.get(rows, np.inf), seconds)
        return StepCosts(plain, verified, head)

    def _heads_timer(self, rows: int):
        """A call that runs the heads' full depth at `rows` rows (every draft sure) and returns its
        drafts: the heads' cost, which a warm-up step (no row listed) never pays."""
        depth = self.draft_heads_depth
        config, kernels, every = self.config, self.kernels, jnp.zeros(depth, jnp.float32)

        def full_depth(heads, params, hidden, token):
            return propose(heads, params, config, hidden, token, depth, kernels, every)

        fn = jax.jit(full_depth)
        hidden = jnp.zeros((rows, self.config.hidden_size), jnp.float32)
        token = jnp.zeros(rows, jnp.int32)
        compiled = fn.lower(self._heads, self._sampler_params, hidden, token).compile()
        return lambda: compiled(self._heads, self._sampler_params, hidden, token)

    def _idle_step(self, pages: int, rows: int, width: int | None) -> jax.Array:
        """A decode (width None) or verification step of the (pages, rows, width) bucket that lists no
        row: it runs the bucket's program and changes nothing (warm-up)."""
        drafts = None if width is None else np.full((rows, width), -1, np.int32)
        unlisted, page_table = np.full(rows, -1, np.int32), np.zeros((rows, pages), np.int32)
        return self._decode_step(unlisted, drafts, page_table, self._mask_rows(None, rows))


# What a sampler reads of the weights: the output layer (embed when tied) and, for draft heads, the
# embeddings and the final norm's dtype.
_SAMPLER_PARAMS = ("embed", "lm_head", "final_norm")

# Each program's function, and whether it samples (its second output goes to the host).
_STEPS = {
    "prefill": (_prefill_forward, False),
    "prefill_sample": (_prefill_sample, True),
    "decode": (_step, True),
    "verify": (_step, True),
}


def _median_seconds(call, calls: int) -> float:
    """The median wall time of `calls` calls, each one's result read before the next."""
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        np.asarray(call())
        times.append(time.perf_counter() - begin)
    return float(np.median(times))


def _settings(s: SamplingParams) -> SlotSampling:
    return SlotSampling(
        temperature=np.array([s.temperature], np.float32),
        top_k=np.array([s.top_k], np.int32),
        top_p=np.array([s.top_p], np.float32),
        min_p=np.array([s.min_p], np.float32),
        repetition_penalty=np.array([s.repetition_penalty], np.float32),
        presence_penalty=np.array([s.presence_penalty], np.float32),
        frequency_penalty=np.array([s.frequency_penalty], np.float32),
        num_logprobs=np.array([-1 if s.logprobs is None else s.logprobs], np.int32),
        seed=np.array([split_seed(s.seed)], np.uint32),
    )


def _stop_row(stop_ids: Sequence[int]) -> np.ndarray:
    row = np.full((1, MAX_STOP_IDS), -1, np.int32)
    row[0, : len(stop_ids)] = stop_ids
    return row
