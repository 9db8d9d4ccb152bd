"""The device contract between the scheduler and a model: prefill into a slot, step every slot, release.

A fixed number of decode *slots* share one preallocated KV cache. The engine owns the device state
(cache and per-slot sampling state); the host owns the policy (which request goes to which slot, when).

One request's life on the engine:
  1. `prefill([PrefillChunk(slot, tokens, start, sampling, is_last)])` writes the prompt's KV entries
     into the slot (in several chunks for a long prompt: `start` is where the chunk begins). The last
     chunk samples the first output token and makes the slot active.
  2. `decode()` samples one more token for every active slot at once. The device tracks stop token ids,
     max_tokens and the context limit itself, so steps can be dispatched back to back without waiting.
  3. `release(slot)` deactivates a slot early (stop string seen on the host, cancel, deadline).

Results come back as `Pending*` handles: calling `.result()` blocks until that step's small packed
array is on the host, so the caller can dispatch step n+1 before reading step n.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxinfer.request import SamplingParams


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """A piece of one prompt to write into `slot` at positions [start, start + len(token_ids))."""

    slot: int
    token_ids: Sequence[int]
    start: int
    sampling: SamplingParams
    # The last chunk of a prompt samples the first output token and activates the slot.
    is_last: bool = True
    # Every token id of the prompt (needed for repetition/presence penalties); only read when is_last.
    prompt_token_ids: Sequence[int] = ()


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """One decode step, on the host. All arrays are [num_slots].

    token:  the sampled token of each slot (meaningless where `valid` is False).
    valid:  the slot was active at this step and produced `token`.
    done:   this token ended the request on the device: a stop token id, max_tokens, or the context end.
    reason: why it ended (FINISH_* codes below) where done.
    """

    token: np.ndarray
    valid: np.ndarray
    done: np.ndarray
    reason: np.ndarray


FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2


class PendingStep(abc.ABC):
    @abc.abstractmethod
    def result(self) -> StepOutput:
        """Blocks until the step's results are on the host."""


class Engine(abc.ABC):
    """What the scheduler drives. Implementations: `jax_engine.JaxEngine`, `testing.MockEngine`."""

    @property
    @abc.abstractmethod
    def num_slots(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_seq_len(self) -> int:
        """Most tokens (prompt plus output) one slot can hold."""

    @property
    @abc.abstractmethod
    def max_prefill_chunk(self) -> int:
        """Most prompt tokens one PrefillChunk may carry (the largest prefill bucket)."""

    @abc.abstractmethod
    def prefill(self, chunks: Sequence[PrefillChunk]) -> PendingStep:
        """Writes each chunk into its slot. Chunks must name distinct slots.

        The returned step has one entry per slot: for each chunk with is_last, the first sampled token
        (valid=True, done set if that token already ends the request); all other entries invalid.
        """

    @abc.abstractmethod
    def decode(self) -> PendingStep:
        """Samples one token for every active slot; a slot whose token is `done` becomes inactive."""

    @abc.abstractmethod
    def release(self, slot: int) -> None:
        """Deactivates `slot` now; its next decode produces nothing for it."""

    def warmup(self) -> float:
        """Compiles every program the engine will run; returns the seconds it took."""
        return 0.0
