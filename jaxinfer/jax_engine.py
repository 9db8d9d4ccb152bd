"""The Engine on JAX: jitted prefill and decode over one donated device state (cache + per-slot sampling).

Programs, all compiled ahead of time and kept in a table keyed by their static shape bucket:
  prefill(T, A): one prompt chunk of T tokens (bucketed) into one slot, attending over A cache positions
                 (A = T's bucket at a prompt's start, the whole slot for later chunks).
  decode(A, R):  one token for each of the first R slots (the smallest power of two holding every active
                 slot), attending over the first A cache positions, where A is the smallest bucket that
                 holds the longest active slot.
  release:       deactivate one slot.
Nothing else is traced while serving: `warmup()` compiles every bucket, and `compile_count` tells a test
whether anything compiled later. With JAX's persistent compilation cache on, a second start reuses them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer import engine as api
from jaxinfer.config import CacheConfig, KernelConfig, ModelConfig
from jaxinfer.kernel_dispatch import ROWS_AS_VECTORS, native_decode_attention
from jaxinfer.kv_cache import KVCache, init_cache
from jaxinfer.model import forward
from jaxinfer.params import Params
from jaxinfer.request import SamplingParams
from jaxinfer.sampling import SlotSampling, sample, split_seed
from jaxinfer.sharding import DATA, make_mesh, shard_params, slot_spec

log = logging.getLogger(__name__)

MAX_STOP_IDS = 16  # stop token ids per request checked on device (eos ids included)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything on the device that lives across steps. Arrays are [slots, ...]."""

    cache: KVCache
    tokens: jax.Array  # int32: the last sampled token, input of the next decode step
    lengths: jax.Array  # int32: tokens held in the cache = position of `tokens`
    active: jax.Array  # bool
    generated: jax.Array  # int32: output tokens so far
    max_tokens: jax.Array  # int32
    stop_ids: jax.Array  # int32 [slots, MAX_STOP_IDS], -1 padded
    sampling: SlotSampling
    seen: jax.Array  # bool [slots, vocab]: tokens of the prompt and output, for penalties


def _finish(
    stop_ids: jax.Array,  # [n, MAX_STOP_IDS]
    max_tokens: jax.Array,  # [n]
    token: jax.Array,  # [n], newly sampled
    generated: jax.Array,  # [n], output tokens including `token`
    lengths: jax.Array,  # [n], tokens in the cache
    max_len: int,
):
    """Done flags and reasons for newly sampled tokens."""
    hit_stop = jnp.any(stop_ids == token[:, None], axis=-1)
    too_long = (generated >= max_tokens) | (lengths >= max_len)
    reason = jnp.where(hit_stop, api.FINISH_STOP, jnp.where(too_long, api.FINISH_LENGTH, api.FINISH_NONE))
    return hit_stop | too_long, reason.astype(jnp.int32)


def _pack(token, valid, done, reason) -> jax.Array:
    """One [n, 4] int32 array per step: copying one array to the host beats four."""
    return jnp.stack([token, valid.astype(jnp.int32), done.astype(jnp.int32), reason], axis=-1)


def _prefill_step(
    params: Params,
    state: DecodeState,
    tokens: jax.Array,  # [1, T] int32, padded
    chunk: jax.Array,  # int32 [4]: slot, start, true_len, is_last
    settings: SlotSampling,  # this request's settings, arrays of shape [1]
    max_tokens: jax.Array,  # [1] int32
    stop_ids: jax.Array,  # [1, MAX_STOP_IDS] int32
    *,
    config: ModelConfig,
    attend_len: int,
    kernels: KernelConfig,
) -> tuple[DecodeState, jax.Array]:
    slot, start, true_len, is_last = chunk[0], chunk[1], chunk[2], chunk[3].astype(bool)
    t = tokens.shape[1]
    offsets = jnp.arange(t, dtype=jnp.int32)
    in_prompt = offsets < true_len
    max_len = state.cache.max_len
    positions = jnp.where(in_prompt, start + offsets, max_len)[None]  # padding writes are dropped
    slots = slot[None]
    logits, cache = forward(
        params, config, tokens, positions, state.cache, slots,
        attend_len=attend_len, logits_index=(true_len - 1)[None], kernels=kernels,
    )  # fmt: skip

    # A request's penalty set starts empty at its first chunk and gathers every prompt token.
    seen_row = jnp.where(start == 0, False, state.seen[slot])
    seen_row = seen_row.at[jnp.where(in_prompt, tokens[0], config.vocab_size)].set(True, mode="drop")
    token = sample(logits, seen_row[None], settings, jnp.zeros(1, jnp.int32))  # [1]
    length = start + true_len
    done, reason = _finish(
        stop_ids, max_tokens, token, jnp.ones(1, jnp.int32), length[None], state.cache.max_len
    )
    seen_row = jnp.where(is_last, seen_row.at[token[0]].set(True), seen_row)

    def put(field, value):
        return field.at[slot].set(value)

    state = DecodeState(
        cache=cache,
        tokens=put(state.tokens, token[0]),
        lengths=put(state.lengths, length),
        active=put(state.active, is_last & ~done[0]),
        generated=put(state.generated, 1),
        max_tokens=put(state.max_tokens, max_tokens[0]),
        stop_ids=put(state.stop_ids, stop_ids[0]),
        sampling=jax.tree.map(lambda f, v: f.at[slot].set(v[0]), state.sampling, settings),
        seen=put(state.seen, seen_row),
    )
    num_slots = state.tokens.shape[0]
    row = jnp.stack([token[0], is_last.astype(jnp.int32), done[0].astype(jnp.int32), reason[0]])
    out = jnp.zeros((num_slots, 4), jnp.int32).at[slot].set(row)
    return state, out


def _decode_step(
    params: Params,
    state: DecodeState,
    *,
    config: ModelConfig,
    attend_len: int,
    kernels: KernelConfig,
    num_rows: int,
) -> tuple[DecodeState, jax.Array]:
    """One token for each of the first `num_rows` slots (every active slot lies below it: the scheduler
    fills the lowest free slot first). A decode step costs every row it computes, so at low load a
    smaller row bucket is several times faster on CPU."""
    n, num_slots = num_rows, state.tokens.shape[0]
    slots = jnp.arange(n, dtype=jnp.int32)
    active = state.active[:n]
    positions = jnp.where(active, state.lengths[:n], state.cache.max_len)[:, None]
    logits, cache = forward(
        params, config, state.tokens[:n, None], positions, state.cache, slots,
        attend_len=attend_len, all_slots=True, logits_index=jnp.zeros(n, jnp.int32), kernels=kernels,
    )  # fmt: skip
    sampling = jax.tree.map(lambda a: a[:n], state.sampling)
    seen = state.seen[:n]
    token = sample(logits, seen, sampling, state.generated[:n])
    generated = state.generated[:n] + 1
    lengths = state.lengths[:n] + 1
    done, reason = _finish(
        state.stop_ids[:n], state.max_tokens[:n], token, generated, lengths, state.cache.max_len
    )
    done &= active

    def put(field: jax.Array, rows: jax.Array) -> jax.Array:
        return field.at[:n].set(rows)

    state = dataclasses.replace(
        state,
        cache=cache,
        tokens=put(state.tokens, jnp.where(active, token, state.tokens[:n])),
        lengths=put(state.lengths, jnp.where(active, lengths, state.lengths[:n])),
        generated=put(state.generated, jnp.where(active, generated, state.generated[:n])),
        active=put(state.active, active & ~done),
        seen=put(state.seen, seen.at[slots, token].set(seen[slots, token] | active)),
    )
    packed = _pack(token, active, done, reason)
    if n < num_slots:
        packed = jnp.concatenate([packed, jnp.zeros((num_slots - n, 4), jnp.int32)])
    return state, packed


def _release_step(state: DecodeState, slot: jax.Array) -> DecodeState:
    return dataclasses.replace(state, active=state.active.at[slot].set(False))


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
    def __init__(self, packed: Sequence[jax.Array], on_result):
        self._packed = list(packed)
        for array in self._packed:
            array.copy_to_host_async()
        self._on_result = on_result
        self._output: api.StepOutput | None = None

    def result(self) -> api.StepOutput:
        if self._output is None:
            rows = np.zeros_like(np.asarray(self._packed[0])) if self._packed else np.zeros((0, 4), np.int32)
            for array in self._packed:  # prefill: one array per chunk, each valid only in its slot's row
                host = np.asarray(array)
                rows = np.where(host[:, 1:2] == 1, host, rows)
            self._output = api.StepOutput(
                token=rows[:, 0], valid=rows[:, 1] == 1, done=rows[:, 2] == 1, reason=rows[:, 3]
            )
            self._on_result(self._output)
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
    ):
        self.mesh = mesh or make_mesh()
        self.kernels = kernels or KernelConfig.for_backend(
            jax.default_backend(), "xla", single_device=self.mesh.size == 1
        )
        if self.kernels.attention == "pallas" and (
            cache_config.layout != "bhsd" or cache_config.dtype == "int8"
        ):
            raise ValueError("the Pallas attention kernels need a float KV cache in the 'bhsd' layout")
        self.config = config
        self.cache_config = cache_config
        # Weights on their PARAM_RULES shardings (a no-op when loaded with sharding.param_placement).
        self.params = shard_params(params, self.mesh)
        max_len = cache_config.max_len
        self._prefill_buckets = power_of_two_buckets(
            min(min_prefill_bucket, max_len), min(max_prefill_chunk, max_len)
        )
        self._attend_buckets = power_of_two_buckets(min(min_attend_bucket, max_len), max_len)
        # XLA decode of more than ROWS_AS_VECTORS rows also gets buckets halfway between powers of two:
        # there attention is a large share of a step (SmolLM2 at 16 rows: ~40%, all of it proportional
        # to the positions read), so ~12% padding instead of ~25% is worth twice the decode programs of
        # those rows (16 rows at 128-192 positions: 46 -> 43 ms per step). A few rows read mostly weights.
        self._many_rows_attend_buckets = self._attend_buckets
        if self.kernels.attention == "xla":
            self._many_rows_attend_buckets = with_midpoints(self._attend_buckets)
        # Decode computes a prefix of the slots. The Pallas kernel reads the whole cache, and a slot split
        # over `data` would reshard a prefix, so those always compute every slot.
        slots = cache_config.num_slots
        prefix_ok = self.kernels.attention in ("xla", "native") and self.mesh.shape[DATA] == 1
        self._row_buckets = power_of_two_buckets(1, slots) if prefix_ok else (slots,)
        self.state = self._init_state()
        self._programs: dict[tuple, object] = {}
        self.compile_count = 0
        self._warm = False
        # Host mirror of what the device will hold: an upper bound on each active slot's length.
        self._host_len = np.zeros(cache_config.num_slots, np.int64)
        self._host_active = np.zeros(cache_config.num_slots, bool)

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
            lengths=vec(0, np.int32),
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
                seed=mat(0, np.uint32, 2),
            ),
            seen=mat(False, bool, c.vocab_size),
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
            replicated = NamedSharding(self.mesh, P())
            out_shardings = (self._state_shardings(), replicated)
            kind = key[0]
            if kind == "prefill":
                fn = functools.partial(
                    _prefill_step, config=self.config, attend_len=key[2], kernels=self.kernels
                )
            elif kind == "decode":
                fn = functools.partial(
                    _decode_step, config=self.config, attend_len=key[1], kernels=self.kernels,
                    num_rows=key[2],
                )  # fmt: skip
            else:
                fn, out_shardings = _release_step, out_shardings[0]
            jitted = jax.jit(
                fn, donate_argnums=(1,) if kind != "release" else (0,), out_shardings=out_shardings
            )
            program = jitted.lower(*args).compile()
            self._programs[key] = program
            self.compile_count += 1
            log.debug("compiled %s in %.2fs", key, time.perf_counter() - start)
        return program

    def _prefill_attend_len(self, start: int, t: int) -> int:
        """A chunk at the start of a prompt attends over its own bucket; a later chunk over the whole
        slot. Two programs per chunk bucket instead of one per (chunk, context) pair; the extra keys a
        later chunk reads cost little next to its matmuls."""
        return self._bucket(self._attend_buckets, t) if start == 0 else self.max_seq_len

    def native_decode_attention(self, rows: int) -> bool:
        """Whether decode steps over `rows` rows attend through the C++ kernel (kernel_dispatch)."""
        return native_decode_attention(self.kernels, self.state.cache, self.config.head_dim, rows)

    def _decode_attend_buckets(self, rows: int) -> tuple[int, ...]:
        """The attend buckets of decode steps over `rows` (a row bucket). The native kernel reads each
        slot up to its own length: one program for the whole cache, whatever the lengths."""
        if self.native_decode_attention(rows):
            return (self.max_seq_len,)
        return self._many_rows_attend_buckets if rows > ROWS_AS_VECTORS else self._attend_buckets

    def _decode_bucket(self, rows: int, length: int) -> int:
        """The attend bucket (program) of a decode step over `rows` rows whose longest slot holds `length`."""
        return self._bucket(self._decode_attend_buckets(rows), min(length + 1, self.max_seq_len))

    def decode_attend_len(self, rows: int, length: int) -> int:
        """Cache positions a decode step over `rows` rows reads once its longest slot holds `length`."""
        if self.native_decode_attention(rows):
            return min(length + 1, self.max_seq_len)
        return self._decode_bucket(rows, length)

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
        packed = []
        for chunk in chunks:
            packed.append(self._prefill_one(chunk))
        return _Pending(packed, self._on_result)

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
        s = chunk.sampling
        if len(s.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(
                f"at most {MAX_STOP_IDS} stop token ids (incl. eos), got {len(s.stop_token_ids)}"
            )
        t = self._bucket(self._prefill_buckets, n)
        a = self._prefill_attend_len(chunk.start, t)
        tokens = np.zeros((1, t), np.int32)
        tokens[0, :n] = chunk.token_ids
        args = (
            self.params,
            self.state,
            tokens,
            np.array([chunk.slot, chunk.start, n, int(chunk.is_last)], np.int32),
            _settings(s),
            np.array([s.max_tokens], np.int32),
            _stop_row(s.stop_token_ids),
        )
        program = self._program(("prefill", t, a), args)
        self.state, packed = program(*args)
        self._host_len[chunk.slot] = chunk.start + n
        self._host_active[chunk.slot] = chunk.is_last
        return packed

    def decode(self) -> api.PendingStep:
        longest = int(self._host_len[self._host_active].max(initial=0))
        active = np.flatnonzero(self._host_active)
        rows = self._bucket(self._row_buckets, int(active[-1]) + 1 if active.size else 1)
        a = self._decode_bucket(rows, longest)
        args = (self.params, self.state)
        self.state, packed = self._program(("decode", a, rows), args)(*args)
        self._host_len[self._host_active] += 1
        return _Pending([packed], self._on_result)

    def release(self, slot: int) -> None:
        args = (self.state, np.int32(slot))
        self.state = self._program(("release",), args)(*args)
        self._host_active[slot] = False

    def _on_result(self, out: api.StepOutput) -> None:
        self._host_active[out.valid & out.done] = False

    def warmup(self, prompt_lengths: Sequence[int] | None = None, max_new_tokens: int = 0) -> float:
        """Compiles programs ahead of use, runs each once, and returns the seconds it took.

        With no arguments, every program serving can hit: prefill for each chunk bucket (at a prompt's
        start and later), decode for each (attend, rows) bucket, and release. With `prompt_lengths`
        (one job of that many prompts), only the programs that job needs, so its timings are clean.
        A program's first run costs ~0.4 s more than later ones on XLA:CPU (a SmolLM2 decode step: 440
        vs 42 ms), so while no slot is active each runs once here, as a no-op on the state: prefill
        with an empty chunk (every write dropped, the slot left inactive), decode over inactive slots.
        """
        start = time.perf_counter()
        if prompt_lengths is None:
            prefill = {
                (t, self._prefill_attend_len(begin, t)) for t in self._prefill_buckets for begin in (0, 1)
            }
            decode = {(a, rows) for rows in self._row_buckets for a in self._decode_attend_buckets(rows)}
        else:
            chunk = self.max_prefill_chunk
            prefill = set()
            for n in prompt_lengths:
                for begin in range(0, n, chunk):
                    t = self._bucket(self._prefill_buckets, min(chunk, n - begin))
                    prefill.add((t, self._prefill_attend_len(begin, t)))
            shortest = min(prompt_lengths)
            longest = min(max(prompt_lengths) + max_new_tokens, self.max_seq_len)
            most_rows = self._bucket(self._row_buckets, min(len(prompt_lengths), self.num_slots))
            decode = set()
            for rows in (r for r in self._row_buckets if r <= most_rows):
                buckets = self._decode_attend_buckets(rows)
                last = self._bucket(buckets, longest)
                decode |= {(a, rows) for a in buckets if shortest <= a <= last}
        dummy = SamplingParams()
        run = not self._host_active.any()
        for t, a in sorted(prefill):
            # The programs are looked up by bucket, so lower with bucket-shaped dummies: slot 0, start 0,
            # no tokens, not the last chunk.
            args = (
                self.params, self.state, np.zeros((1, t), np.int32), np.zeros(4, np.int32),
                _settings(dummy), np.ones(1, np.int32), _stop_row(()),
            )  # fmt: skip
            program = self._program(("prefill", t, a), args)
            if run:
                self.state, _ = program(*args)
        for a, rows in sorted(decode):
            program = self._program(("decode", a, rows), (self.params, self.state))
            if run:
                self.state, _ = program(self.params, self.state)
        self._program(("release",), (self.state, np.int32(0)))
        jax.block_until_ready(self.state)
        self._warm = prompt_lengths is None
        return time.perf_counter() - start


def _settings(s: SamplingParams) -> SlotSampling:
    return SlotSampling(
        temperature=np.array([s.temperature], np.float32),
        top_k=np.array([s.top_k], np.int32),
        top_p=np.array([s.top_p], np.float32),
        min_p=np.array([s.min_p], np.float32),
        repetition_penalty=np.array([s.repetition_penalty], np.float32),
        presence_penalty=np.array([s.presence_penalty], np.float32),
        seed=np.array([split_seed(s.seed)], np.uint32),
    )


def _stop_row(stop_ids: Sequence[int]) -> np.ndarray:
    row = np.full((1, MAX_STOP_IDS), -1, np.int32)
    row[0, : len(stop_ids)] = stop_ids
    return row
