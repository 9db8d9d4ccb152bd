"""The bound a decode step cannot beat: the device's read bandwidth, measured, for the benchmarks'
roofline columns (each step reads every weight once, kernel_dispatch.weight_read_bytes, plus its KV)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def measure_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s of a device-side sum over `megabytes` of float32 (the best of `repeats` timed runs)."""
    x = jax.jit(lambda: jnp.ones((megabytes * 2**20 // 4,), jnp.float32))()  # made on the device
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        total(x).block_until_ready()
        times.append(time.perf_counter() - start)
    nbytes = x.nbytes
    x.delete()
    return nbytes / min(times) / 1e9
