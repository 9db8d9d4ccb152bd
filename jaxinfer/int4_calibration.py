"""Calibrated int4 clipping ranges, fitted with optax (OmniQuant's learnable weight clipping).

Round-to-nearest int4 spreads each group's 16 levels over the group's whole [min, max] range, so one
outlier weight coarsens every other weight of its group. Shrinking the range (a factor per output
channel and group) trades the outlier's error for finer steps everywhere else; which factor is best
depends on what the layer's inputs look like. So, layer by layer: the float model's hidden states on a
calibration text go through the layer twice, once with its float weights and once with its linear
weights fake-quantised at the current clipping factors (sigmoid of a learned logit; rounding passed
straight through to the gradient), and Adam lowers the mean squared difference of the two outputs.
A layer keeps plain round-to-nearest where the fit does not beat it.

`calibrate_int4` returns the factors for quantization.quantize_params(params, "int4", clips=...).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import optax

from jaxinfer.config import KernelConfig, ModelConfig
from jaxinfer.evaluation import cache_for
from jaxinfer.models.params import Params
from jaxinfer.models.transformer import embed_tokens, layer_runner
from jaxinfer.quantization import INT4_GROUP_SIZE, LINEAR_LEAVES
from jaxinfer.weight_formats import int4_grid, int4_group_size

log = logging.getLogger(__name__)

INITIAL_LOGIT = 5.0  # sigmoid(5) = 0.993: start next to round-to-nearest's full range

# A fixed English passage for calibration, distinct from evaluation.EVAL_TEXT (written for this project).
CALIBRATION_TEXT = (
    "The old railway station had been closed for twenty years when the town council decided to turn it "
    "into a library. Volunteers cleared the platforms, scraped the rust from the iron benches and carried "
    "boxes of donated books up from the cellar of the town hall. A carpenter built shelves along the walls "
    "of the waiting room, where passengers once sat with their luggage and newspapers, and the ticket "
    "office became a reading corner for children. On the opening day the stationmaster's granddaughter cut "
    "the ribbon. She remembered the smell of coal smoke, the whistle of the last evening train and the "
    "clock above the door that was always two minutes fast. The clock still hangs there, repaired and "
    "accurate now, and every hour it chimes softly over the rows of readers. In the summer, concerts are "
    "held on the platform, and in the autumn the library runs a course on local history, with photographs "
    "of the trains, maps of the old lines and letters written by the people who built them."
)


@dataclasses.dataclass(frozen=True)
class LayerFit:
    layer: int
    rtn_error: float  # mean squared output error of round-to-nearest
    calibrated_error: float  # of the fitted clipping factors (equal to rtn_error where they lost)


def fake_int4(w: jax.Array, clip: jax.Array, group_size: int) -> jax.Array:
    """w [out, in] through int4 at clipping factors `clip` and back to float32, with a straight-through
    rounding: the value is quantize_int4's, the gradient reaches `clip` through scale and minimum."""

    def straight_through(v: jax.Array) -> jax.Array:
        return v + jax.lax.stop_gradient(jnp.round(v) - v)

    q, scale, minimum = int4_grid(w, group_size, clip, straight_through)
    return (q * scale[..., None] + minimum[..., None]).reshape(w.shape)


def _layer_output(config, index, layer, x, positions, cache, page_table):
    run_layer = layer_runner(config, positions, cache, page_table)
    return run_layer(index, layer, x, cache, KernelConfig())[0]


@functools.partial(jax.jit, static_argnames=("config", "index", "groups"))
def _fit_error(logits, layer, x, target, positions, cache, page_table, *, config, index, groups):
    """Mean squared difference between the layer's output with its linear weights through fake_int4 at
    clipping factors sigmoid(logits) and `target`, the float layer's output."""
    fake = {name: fake_int4(layer[name], jax.nn.sigmoid(logits[name]), group) for name, group in groups}
    out = _layer_output(config, index, {**layer, **fake}, x, positions, cache, page_table)
    return jnp.mean(jnp.square(out - target))


def calibrate_int4(
    params: Params,
    config: ModelConfig,
    tokens: list[int],
    *,
    group_size: int = INT4_GROUP_SIZE,
    steps: int = 80,
    learning_rate: float = 5e-2,
) -> tuple[dict[tuple[int, str], jax.Array], list[LayerFit]]:
    """Fits clipping factors for every linear weight of every layer of a float model on `tokens`.

    Returns ({(layer index, weight name): clip [out, in / group_size]}, one LayerFit per layer).
    """
    cache, page_table = cache_for(config, 1, len(tokens), "float32")
    context = dict(
        positions=jnp.arange(len(tokens), dtype=jnp.int32)[None], cache=cache, page_table=page_table
    )
    optimizer = optax.adam(learning_rate)
    output = jax.jit(_layer_output, static_argnums=(0, 1))

    @functools.partial(jax.jit, static_argnames=("index", "groups"))
    def step(logits, state, layer, x, target, *, index, groups):
        error = functools.partial(_fit_error, config=config, index=index, groups=groups, **context)
        loss, grads = jax.value_and_grad(error)(logits, layer, x, target)
        # A group whose range is (nearly) a single value divides by a vanishing step: its gradient is not
        # finite and stays out of the update.
        grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), g, 0.0), grads)
        updates, state = optimizer.update(grads, state)
        return optax.apply_updates(logits, updates), state, loss

    x = jax.jit(embed_tokens, static_argnums=1)(params, config, jnp.asarray([tokens], jnp.int32))
    clips: dict[tuple[int, str], jax.Array] = {}
    fits = []
    for index, layer in enumerate(params["layers"]):
        # Layers of one kind compile once: the index only picks the kind (and a cache layer to scribble on).
        kind_index = config.layer_types.index(config.layer_types[index])
        sizes = {n: int4_group_size(w.shape[1], group_size) for n, w in layer.items() if n in LINEAR_LEAVES}
        groups = tuple(sorted((n, g) for n, g in sizes.items() if g is not None))
        static = dict(config=config, index=kind_index, groups=groups)
        target = output(config, kind_index, layer, x, *context.values())
        logits = {n: jnp.full((layer[n].shape[0], layer[n].shape[1] // g), INITIAL_LOGIT) for n, g in groups}
        full_range = {n: jnp.full_like(v, jnp.inf) for n, v in logits.items()}  # sigmoid(inf) = 1
        rtn_error = float(_fit_error(full_range, layer, x, target, **context, **static))
        state = optimizer.init(logits)
        for _ in range(steps):
            logits, state, _ = step(logits, state, layer, x, target, index=kind_index, groups=groups)
        fitted = float(_fit_error(logits, layer, x, target, **context, **static))
        if fitted < rtn_error:
            clips |= {(index, n): jax.nn.sigmoid(v) for n, v in logits.items()}
        fits.append(LayerFit(index, rtn_error, min(fitted, rtn_error)))
        log.info("layer %d: output error %.3g (round-to-nearest) -> %.3g", index, rtn_error, fitted)
        x = target  # the next layer sees the float model's states
    return clips, fits
