"""Teacher-forced quality of a model variant against a reference: greedy agreement and perplexity.

Used to keep quantisation honest: the int8 model reads the same fixed text as the float model, and we
compare, position by position, whether both would pick the same next token, and how well each predicts
the text's actual next token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import CacheConfig, KernelConfig, ModelConfig
from jaxinfer.kv_cache import contiguous_page_table, init_cache
from jaxinfer.models.params import Params
from jaxinfer.models.transformer import forward
from jaxinfer.sharding import make_mesh

PAGE_SIZE = 64  # the CPU default (runtime.DEFAULT_PAGE_SIZE)

# A fixed English passage (written for this project) used as the evaluation text.
EVAL_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a small lamp, a "
    "notebook and a flask of tea, and he counted the steps out of habit: one hundred and twelve. At the top "
    "he wiped the great lens with a soft cloth, checked the oil, and wrote the weather in his book. Most "
    "nights were quiet. Ships passed far out to sea, their lights moving slowly along the horizon, and the "
    "only sounds were the wind and the waves breaking on the rocks below. In winter the storms came from "
    "the north. Rain hammered the windows, the tower shook, and the keeper stayed awake until morning, "
    "watching the beam sweep across the water. He liked to think that somewhere out there a sailor saw the "
    "light and knew where the land was. When spring returned, he painted the railings, repaired the roof "
    "of the storehouse and planted potatoes in the small garden behind the cottage. Children from the "
    "village sometimes visited to ask about the sea, and he told them about tides, currents and the stars "
    "that sailors once used to find their way home."
)


@dataclasses.dataclass(frozen=True)
class Agreement:
    positions: int
    greedy_agreement: float  # fraction of positions where both models pick the same next token
    reference_perplexity: float
    candidate_perplexity: float


def teacher_forced_logits(
    params: Params, config: ModelConfig, tokens: list[int], kernels: KernelConfig
) -> np.ndarray:
    """[t, vocab] float32 logits of one pass over `tokens`."""
    t = len(tokens)
    cache, page_table = cache_for(config, 1, t, "float32")
    run = jax.jit(forward, static_argnames=("config", "kernels"))
    logits, _ = run(
        params, config, jnp.asarray([tokens], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None], cache,
        page_table, kernels=kernels,
    )  # fmt: skip
    return np.asarray(logits[0])


def teacher_forced_decode_logits(
    params: Params,
    config: ModelConfig,
    tokens: list[int],
    kernels: KernelConfig,
    *,
    rows: int,
    cache_dtype: str,
) -> np.ndarray:
    """[t, vocab] float32 logits of `tokens` fed one decode step at a time to `rows` identical rows, so
    the path under test is decode at that many rows with that KV cache (e.g. the CPU default: more than
    four rows multiply a bfloat16 cache in bfloat16)."""
    t = len(tokens)
    cache, page_table = cache_for(config, rows, t, cache_dtype)

    # The weights are an argument, as in the engine's programs: closed over, they would be constants
    # that XLA folds into the arithmetic around them, differently at each row count.
    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(params: Params, token: jax.Array, cache, position: jax.Array):
        inputs = jnp.full((rows, 1), token, jnp.int32)
        positions = jnp.full((rows, 1), position, jnp.int32)
        logits, cache = forward(params, config, inputs, positions, cache, page_table, kernels=kernels)
        return logits[0, 0], cache

    out = []
    for position, token in enumerate(tokens):
        logits, cache = step(params, jnp.int32(token), cache, jnp.int32(position))
        out.append(logits)
    return np.asarray(jnp.stack(out))


def cache_for(config: ModelConfig, rows: int, length: int, dtype: str):
    """A page pool holding `rows` sequences of `length` positions, and their page table (for passes over a
    fixed text: evaluation here, int4 calibration)."""
    pages = -(-length // PAGE_SIZE)
    cache_config = CacheConfig(
        num_pages=rows * pages + 1, page_size=PAGE_SIZE, max_len=length, num_slots=rows, dtype=dtype
    )
    return init_cache(config, cache_config, make_mesh()), jnp.asarray(contiguous_page_table(rows, pages))


def perplexity(logits: np.ndarray, tokens: list[int]) -> float:
    """exp(mean NLL) of tokens[1:] under logits[:-1]."""
    log_probs = jax.nn.log_softmax(jnp.asarray(logits[:-1]), axis=-1)
    nll = -np.asarray(log_probs)[np.arange(len(tokens) - 1), tokens[1:]]
    return float(np.exp(nll.mean()))


def compare(reference: np.ndarray, candidate: np.ndarray, tokens: list[int]) -> Agreement:
    agree = np.argmax(reference[:-1], -1) == np.argmax(candidate[:-1], -1)
    return Agreement(
        positions=len(tokens) - 1,
        greedy_agreement=float(agree.mean()),
        reference_perplexity=perplexity(reference, tokens),
        candidate_perplexity=perplexity(candidate, tokens),
    )
