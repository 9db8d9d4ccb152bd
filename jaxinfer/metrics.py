"""Serving metrics: per-request latencies, throughput and occupancy, exported in Prometheus format.

Latencies (seconds) are recorded twice: as Prometheus histograms (cumulative, for dashboards) and in a
sliding window of the last `window` requests, from which p50/p95/p99 are computed at scrape time
(`jaxinfer_<name>_window_seconds{quantile="0.5"}`) and by `snapshot()`.

  queue_time   submit -> slot assigned          ttft  submit -> first token
  tpot         (last token - first token) / (output tokens - 1), i.e. excluding the first token
  itl          gap between consecutive token deliveries of one request, split evenly over the tokens
               delivered together (tokens delivered with the first one are not counted)
  e2e          submit -> finish

Throughput (prefill and decode tokens/s) is measured over the last `rate_window_s` seconds. Gauges:
queue depth, running requests, slot occupancy (busy slots / slots) and KV-cache utilisation
(tokens held in slots / (slots * max_seq_len)). Every ServingMetrics owns its CollectorRegistry, so two
servers in one process do not collide.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIServer

import numpy as np
import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCIES = ("queue_time", "ttft", "tpot", "itl", "e2e")
QUANTILES = (0.5, 0.95, 0.99)
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_HELP = {
    "queue_time": "Time from submit to slot assignment.",
    "ttft": "Time from submit to the first output token.",
    "tpot": "Mean time per output token after the first, per request.",
    "itl": "Time between consecutive output tokens of a request.",
    "e2e": "Time from submit to the end of the request.",
}


class _RateWindow:
    """Events (time, count) over the last `span_s` seconds -> count per second."""

    def __init__(self, span_s: float):
        self.span_s = span_s
        self._events: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, count: int) -> None:
        self._events.append((now, count))
        self._trim(now)

    def rate(self, now: float) -> float:
        self._trim(now)
        if not self._events:
            return 0.0
        # Divide by the span actually observed (at least 1 s), not the whole window, right after start.
        elapsed = max(now - self._events[0][0], 1.0)
        return sum(c for _, c in self._events) / min(elapsed, self.span_s)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.span_s:
            self._events.popleft()


_GAUGES = {  # name: (Prometheus name after jaxinfer_, help)
    "queue_depth": ("queue_depth", "Requests waiting for a slot or KV pages."),
    "running": ("running_requests", "Requests holding a slot."),
    "slot_occupancy": ("slot_occupancy", "Busy slots / slots."),
    "kv_cache_utilization": ("kv_cache_utilization", "KV pages held by requests / usable pages."),
    "kv_pages_used": ("kv_pages_used", "KV pages held by requests."),
    "kv_pages_total": ("kv_pages_total", "Usable KV pages in the pool."),
}
_COUNTS = {
    "preemptions": ("preemptions", "Requests preempted for lack of KV pages (recomputed later)."),
    "prefix_cache_queries": ("prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache."),
    "spec_draft_tokens": ("spec_decode_draft_tokens", "Draft tokens verified (speculative decoding)."),
    "spec_accepted_tokens": ("spec_decode_accepted_tokens", "Draft tokens accepted (speculative decoding)."),
    "spec_verify_steps": (
        "spec_decode_verify_steps",
        "Request-steps that verified drafts; accepted / verify steps is the mean accepted length per step.",
    ),
    "spec_batch_plain_steps": (
        "spec_decode_batch_plain_steps",
        "Decode steps of several requests kept plain: their recent verification steps cost the batch more "
        "than they gave.",
    ),
}


class ServingMetrics:
    """Thread-safe recorder; `registry` is what the Prometheus endpoint serves."""

    def __init__(
        self,
        *,
        window: int = 1000,
        rate_window_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if window <= 0 or rate_window_s <= 0:
            raise ValueError(f"{window=} and {rate_window_s=} must be > 0")
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self._clock = clock
        self._lock = threading.Lock()
        self._windows = {name: collections.deque(maxlen=window) for name in LATENCIES}
        self._prefill_rate = _RateWindow(rate_window_s)
        self._decode_rate = _RateWindow(rate_window_s)
        self._state = dict.fromkeys(_GAUGES, 0.0) | dict.fromkeys(_COUNTS, 0.0)
        r = self.registry
        self._histograms = {
            name: prometheus_client.Histogram(
                f"jaxinfer_{name}_seconds", _HELP[name], buckets=_BUCKETS, registry=r
            )
            for name in LATENCIES
        }
        self._prompt_tokens = prometheus_client.Counter(
            "jaxinfer_prompt_tokens", "Prompt tokens prefilled.", registry=r
        )
        self._generation_tokens = prometheus_client.Counter(
            "jaxinfer_generation_tokens", "Output tokens generated.", registry=r
        )
        self._requests = prometheus_client.Counter(
            "jaxinfer_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        self._gauges = {
            name: prometheus_client.Gauge(f"jaxinfer_{metric}", text, registry=r)
            for name, (metric, text) in _GAUGES.items()
        }
        # Totals the scheduler keeps; set_state adds what they grew by since the last call.
        self._counters = {
            name: prometheus_client.Counter(f"jaxinfer_{metric}", text, registry=r)
            for name, (metric, text) in _COUNTS.items()
        }
        r.register(_WindowCollector(self))

    # ---- recording -----------------------------------------------------------------------------------

    def observe_request(
        self,
        *,
        queue_time_s: float | None,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float,
        finish_reason: str,
    ) -> None:
        """One finished request; None where the request never got that far (e.g. cancelled early)."""
        values = {"queue_time": queue_time_s, "ttft": ttft_s, "tpot": tpot_s, "e2e": e2e_s}
        with self._lock:
            for name, value in values.items():
                if value is not None:
                    self._windows[name].append(value)
        for name, value in values.items():
            if value is not None:
                self._histograms[name].observe(value)
        self._requests.labels(finish_reason=finish_reason).inc()

    def observe_inter_token(self, gaps_s: Iterable[float]) -> None:
        gaps = list(gaps_s)
        with self._lock:
            self._windows["itl"].extend(gaps)
        for gap in gaps:
            self._histograms["itl"].observe(gap)

    def observe_step(self, *, num_prefill_tokens: int, num_decode_tokens: int) -> None:
        now = self._clock()
        with self._lock:
            if num_prefill_tokens:
                self._prefill_rate.add(now, num_prefill_tokens)
            if num_decode_tokens:
                self._decode_rate.add(now, num_decode_tokens)
        if num_prefill_tokens:
            self._prompt_tokens.inc(num_prefill_tokens)
        if num_decode_tokens:
            self._generation_tokens.inc(num_decode_tokens)

    def set_state(
        self,
        *,
        queue_depth: int,
        running: int,
        slot_occupancy: float,
        kv_cache_utilization: float,
        kv_pages_used: int = 0,
        kv_pages_total: int = 0,
        num_preemptions: int = 0,
        prefix_cache_query_tokens: int = 0,
        prefix_cache_hit_tokens: int = 0,
        spec_draft_tokens: int = 0,
        spec_accepted_tokens: int = 0,
        spec_verify_steps: int = 0,
        spec_batch_plain_steps: int = 0,
    ) -> None:
        """Gauges as they are now, and the scheduler's running totals (counters)."""
        gauges = {
            "queue_depth": float(queue_depth),
            "running": float(running),
            "slot_occupancy": float(slot_occupancy),
            "kv_cache_utilization": float(kv_cache_utilization),
            "kv_pages_used": float(kv_pages_used),
            "kv_pages_total": float(kv_pages_total),
        }
        totals = {
            "preemptions": float(num_preemptions),
            "prefix_cache_queries": float(prefix_cache_query_tokens),
            "prefix_cache_hits": float(prefix_cache_hit_tokens),
            "spec_draft_tokens": float(spec_draft_tokens),
            "spec_accepted_tokens": float(spec_accepted_tokens),
            "spec_verify_steps": float(spec_verify_steps),
            "spec_batch_plain_steps": float(spec_batch_plain_steps),
        }
        with self._lock:
            grown = {name: value - self._state[name] for name, value in totals.items()}
            self._state.update(gauges | totals)
        for name, value in gauges.items():
            self._gauges[name].set(value)
        for name, delta in grown.items():
            if delta > 0:
                self._counters[name].inc(delta)

    # ---- reading -------------------------------------------------------------------------------------

    def percentiles(self) -> dict[str, dict[str, float]]:
        """{latency name: {"p50": s, "p95": s, "p99": s, "count": n}} over the sliding window."""
        with self._lock:
            windows = {name: list(w) for name, w in self._windows.items()}
        out = {}
        for name, values in windows.items():
            if values:
                qs = np.quantile(np.asarray(values, np.float64), QUANTILES)
                out[name] = {f"p{round(q * 100)}": float(v) for q, v in zip(QUANTILES, qs, strict=True)}
            else:
                out[name] = {f"p{round(q * 100)}": float("nan") for q in QUANTILES}
            out[name]["count"] = len(values)
        return out

    def throughput(self) -> dict[str, float]:
        now = self._clock()
        with self._lock:
            return {
                "prefill_tokens_per_s": self._prefill_rate.rate(now),
                "decode_tokens_per_s": self._decode_rate.rate(now),
            }

    def snapshot(self) -> dict:
        with self._lock:
            state = dict(self._state)
        return {"latency": self.percentiles(), **self.throughput(), **state}

    def serve_http(self, port: int, host: str = "127.0.0.1") -> tuple[WSGIServer, int]:
        """Starts the /metrics endpoint in a daemon thread; returns (server, bound port).

        Stop it with `server.shutdown(); server.server_close()`.
        """
        server, _ = prometheus_client.start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_port


class _WindowCollector(Collector):
    """Sliding-window quantiles and token rates, computed when scraped."""

    def __init__(self, metrics: ServingMetrics):
        self._metrics = metrics

    def collect(self):
        for name, stats in self._metrics.percentiles().items():
            family = GaugeMetricFamily(
                f"jaxinfer_{name}_window_seconds",
                f"{_HELP[name]} Quantiles over the recent window.",
                labels=["quantile"],
            )
            for q in QUANTILES:
                family.add_metric([str(q)], stats[f"p{round(q * 100)}"])
            yield family
        rates = self._metrics.throughput()
        for key, help_text in [
            ("prefill_tokens_per_s", "Prompt tokens prefilled per second (recent window)."),
            ("decode_tokens_per_s", "Output tokens decoded per second (recent window)."),
        ]:
            yield GaugeMetricFamily(
                f"jaxinfer_{key.replace('_per_s', '_per_second')}", help_text, value=rates[key]
            )
