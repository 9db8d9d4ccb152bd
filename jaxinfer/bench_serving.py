"""Load-test a running jaxinfer server: `jaxinfer bench-serving --target HOST:PORT --result-file R.json`.

Over gRPC by default; `--backend openai --target http://HOST:PORT` drives the OpenAI-compatible HTTP API
instead (streamed POST /v1/completions of the same token-id prompts) and gives the same report.

One run:
  1. Requests come from a synthetic dataset (random token ids with input and output lengths drawn
     from fixed / uniform / normal distributions) or from a ShareGPT-style file (the first human turn
     is the prompt, the length of the gpt reply that follows is the output length). Prompts are sent
     as `prompt_token_ids` and with `ignore_eos` (the default), so both lengths are exact.
     `shared_prefix_len` N (synthetic): every prompt is one shared random document of N tokens (the
     same for every measured request, drawn from the seed; the warm-up requests get another one, so
     the measured run starts with the document uncached) followed by its own question of `input_len`
     tokens; the questions start with distinct tokens, so two prompts share exactly the document.
     `multi_turn` K: each of the `num_prompts` requests opens a conversation of K turns sent one after
     the other; turn i+1's prompt is turn i's prompt + the tokens the server returned for it + a new
     user message of `turn_input_len` random tokens (turns that would not fit the context are
     dropped). A failed turn ends its conversation.
  2. A dispatcher thread sends them with Poisson arrivals at `request_rate` (inf: all at once),
     waiting first for a free place when `max_concurrency` is set (a closed loop at that concurrency).
     With `multi_turn`, conversations arrive and hold the places (one request in flight each).
     A few warm-up requests go first and are not counted.
  3. Each request's stream is timed on the client: TTFT (send to first token), TPOT (the mean gap
     after the first token: (e2e - ttft) / (tokens - 1)), inter-token latency (each gap between
     token-bearing chunks, split evenly over the tokens of a chunk) and E2E latency. HTTP chunks hold
     text, not token ids: each counts as one token, and the final usage chunk gives the total.
  4. The summary counts completed (finish "stop" or "length") and failed requests (an RPC error, an
     HTTP status other than 200, or any other finish; completed + failed = sent), the throughputs over
     the run's duration (first send to last response), and mean / p50 / p90 / p95 / p99 / max of each
     latency; with SLOs, goodput is the rate of completed requests that met every SLO. With
     `multi_turn`, TTFT is also given per turn, and for the first turn against the later ones.
Several rates (`sweep_rates`) give one run each; the result file holds them all, and `--plot` draws
latency CDFs and, for a sweep, throughput and p99 latencies against the offered rate. Every rate sends
the same requests, so with a shared prefix or a multi-turn run, later rates may find the server's prefix
cache warm from earlier ones: compare prefix caching with one rate.
The OpenAI API has no tokenizer and returns no token ids, so `--backend openai` runs the synthetic dataset
only (ids below the model card's vocab_size, else `--vocab-size`), without multi-turn.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path

import numpy as np

from jaxinfer.request import FinishReason

__all__ = [
    "BenchConfig",
    "BenchRequest",
    "Conversation",
    "LengthDistribution",
    "OpenAIClient",
    "RequestResult",
    "add_bench_serving_args",
    "format_table",
    "main_from_args",
    "plot_results",
    "run_benchmark",
    "multi_turn_conversations",
    "next_turn_prompt",
    "run_conversations",
    "run_load",
    "shared_prefix_requests",
    "sharegpt_requests",
    "summarize",
    "synthetic_requests",
]

PERCENTILES = (50, 90, 95, 99)
_COMPLETED = (FinishReason.STOP, FinishReason.LENGTH)
BACKENDS = ("grpc", "openai")
DEFAULT_TARGETS = {"grpc": "127.0.0.1:50051", "openai": "http://127.0.0.1:8000"}
_NO_MULTI_TURN_OVER_HTTP = (
    "multi-turn runs need the token ids of each reply, which the OpenAI API does not return: "
    "use --backend grpc"
)


# ---- datasets ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Token lengths: fixed (a), uniform integers in [a, b], or normal (mean a, std b); always >= 1."""

    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self):
        if self.kind not in ("fixed", "uniform", "normal"):
            raise ValueError(f"kind={self.kind!r} must be fixed, uniform or normal")
        if (self.kind != "normal" and self.a < 1) or self.a <= 0:
            raise ValueError(f"{self.kind} length distribution needs a >= 1, got a={self.a}")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"uniform needs low <= high, got a={self.a}, b={self.b}")
        if self.kind == "normal" and self.b < 0:
            raise ValueError(f"normal needs std >= 0, got b={self.b}")

    @classmethod
    def parse(cls, spec: str) -> LengthDistribution:
        """Parses "64" or "fixed:64", "uniform:32,128", "normal:64,16"."""
        kind, _, values = spec.partition(":") if ":" in spec else ("fixed", "", spec)
        try:
            numbers = [float(v) for v in values.split(",")]
        except ValueError:
            raise ValueError(
                f"bad length distribution {spec!r}; e.g. 64, uniform:32,128, normal:64,16"
            ) from None
        want = 1 if kind == "fixed" else 2
        if len(numbers) != want:
            raise ValueError(f"length distribution {spec!r}: {kind} takes {want} number(s)")
        return cls(kind, *numbers)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n] int64 lengths >= 1."""
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b) + 1, size=n)
        else:
            x = rng.normal(self.a, self.b, size=n)
        return np.maximum(np.rint(x), 1).astype(np.int64)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g},{self.b:g}"


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def synthetic_requests(
    num_requests: int,
    input_len: LengthDistribution,
    output_len: LengthDistribution,
    *,
    vocab_size: int,
    context_length: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Random token-id prompts; lengths are clipped so prompt + output fits the context."""
    if num_requests <= 0 or vocab_size <= 0 or context_length < 2:
        raise ValueError(f"{num_requests=}, {vocab_size=} must be > 0 and {context_length=} >= 2")
    rng = np.random.default_rng(seed)
    inputs = np.minimum(input_len.sample(rng, num_requests), context_length - 1)
    outputs = np.minimum(output_len.sample(rng, num_requests), context_length - inputs)
    return [
        BenchRequest(tuple(int(t) for t in rng.integers(0, vocab_size, size=int(n_in))), int(n_out))
        for n_in, n_out in zip(inputs, outputs)
    ]


def shared_prefix_requests(
    num_requests: int,
    shared_prefix_len: int,
    question_len: LengthDistribution,
    output_len: LengthDistribution,
    *,
    vocab_size: int,
    context_length: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Prompts = one random document of shared_prefix_len tokens (the same in every request, drawn from
    `seed`) + a random question per request. Questions start with distinct tokens (while num_requests <=
    vocab_size), so any two prompts have exactly the document in common. Question and output lengths are
    clipped so each request fits the context."""
    if num_requests <= 0 or vocab_size <= 0:
        raise ValueError(f"{num_requests=} and {vocab_size=} must be > 0")
    if not 1 <= shared_prefix_len <= context_length - 2:
        raise ValueError(
            f"{shared_prefix_len=} must be in [1, context_length - 2] (context_length={context_length}): "
            "a question and an output token must fit after it"
        )
    rng = np.random.default_rng(seed)
    document = [int(t) for t in rng.integers(0, vocab_size, size=shared_prefix_len)]
    room = context_length - shared_prefix_len
    questions = np.minimum(question_len.sample(rng, num_requests), room - 1)
    outputs = np.minimum(output_len.sample(rng, num_requests), room - questions)
    if num_requests <= vocab_size:
        firsts = rng.permutation(vocab_size)[:num_requests]
    else:
        firsts = rng.integers(0, vocab_size, size=num_requests)
    requests = []
    for first, n_question, n_out in zip(firsts, questions, outputs):
        rest = rng.integers(0, vocab_size, size=int(n_question) - 1)
        question = [int(first), *(int(t) for t in rest)]
        requests.append(BenchRequest(tuple(document + question), int(n_out)))
    return requests


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A multi-turn conversation: `first` is turn 1; each follow-up holds the new user message of a later
    turn (its prompt_token_ids) and that turn's max_tokens. Turn i+1 is sent with next_turn_prompt(turn
    i's prompt, turn i's output token ids, follow-up message)."""

    first: BenchRequest
    follow_ups: tuple[BenchRequest, ...] = ()

    @property
    def num_turns(self) -> int:
        return 1 + len(self.follow_ups)


def next_turn_prompt(
    prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], message_token_ids: Sequence[int]
) -> tuple[int, ...]:
    """The next turn's prompt: the whole previous turn (prompt and reply) and the new user message."""
    return (*prompt_token_ids, *output_token_ids, *message_token_ids)


def multi_turn_conversations(
    first_turns: Sequence[BenchRequest],
    num_turns: int,
    message_len: LengthDistribution,
    output_len: LengthDistribution,
    *,
    vocab_size: int,
    context_length: int,
    seed: int = 0,
) -> list[Conversation]:
    """One conversation per first turn, with num_turns - 1 follow-ups of random message tokens.

    The plan assumes every reply is max_tokens long (it is with ignore_eos): a message or output length
    that would overflow the context is clipped, and a turn with no room left (and the ones after) dropped.
    """
    if num_turns < 1 or vocab_size <= 0:
        raise ValueError(f"{num_turns=} must be >= 1 and {vocab_size=} > 0")
    rng = np.random.default_rng([seed, 1])  # a stream of its own, apart from the first turns'
    conversations = []
    for first in first_turns:
        length = len(first.prompt_token_ids) + first.max_tokens
        follow_ups = []
        messages = message_len.sample(rng, num_turns - 1)
        outputs = output_len.sample(rng, num_turns - 1)
        for n_message, n_out in zip(messages, outputs):
            n_message = min(int(n_message), context_length - length - 1)
            if n_message < 1:
                break
            n_out = min(int(n_out), context_length - length - n_message)
            tokens = tuple(int(t) for t in rng.integers(0, vocab_size, size=n_message))
            follow_ups.append(BenchRequest(tokens, n_out))
            length += n_message + n_out
        conversations.append(Conversation(first, tuple(follow_ups)))
    return conversations


def _load_conversations(path: str | os.PathLike[str]) -> list:
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # JSONL
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list or JSONL of {{conversations: [...]}} objects")
    return data


def sharegpt_requests(
    path: str | os.PathLike[str],
    tokenize: Callable[..., list[int]],
    *,
    num_requests: int,
    context_length: int,
    seed: int = 0,
    max_output_len: int | None = None,
) -> list[BenchRequest]:
    """Prompts from a ShareGPT-style file: `conversations: [{from: human|gpt, value}, ...]` per entry.

    Entries are shuffled with `seed`; each gives its first human turn as the prompt and the token count
    of the gpt turn after it as max_tokens (capped by max_output_len). `tokenize(text, add_bos=...)` is
    e.g. InferenceClient.tokenize: the prompt gets the model's default BOS (add_bos=None), the reply none.
    Pairs that do not fit the context are skipped. Raises ValueError if the file yields no usable pair.
    """
    entries = _load_conversations(path)
    random.Random(seed).shuffle(entries)
    requests: list[BenchRequest] = []
    for entry in entries:
        if len(requests) >= num_requests:
            break
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            continue
        pair = next(
            (
                (turns[i].get("value"), turns[i + 1].get("value"))
                for i in range(len(turns) - 1)
                if isinstance(turns[i], dict) and isinstance(turns[i + 1], dict)
                and turns[i].get("from") == "human" and turns[i + 1].get("from") == "gpt"
            ),
            None,
        )  # fmt: skip
        if pair is None or not all(isinstance(v, str) and v for v in pair):
            continue
        prompt_ids = tokenize(pair[0], add_bos=None)
        n_out = len(tokenize(pair[1], add_bos=False))
        if max_output_len is not None:
            n_out = min(n_out, max_output_len)
        if not prompt_ids or n_out < 1 or len(prompt_ids) + n_out > context_length:
            continue
        requests.append(BenchRequest(tuple(prompt_ids), n_out))
    if not requests:
        raise ValueError(f"{path}: no human/gpt pair fits the context length {context_length}")
    return requests


# ---- load generation -----------------------------------------------------------------------------------


@dataclasses.dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    send_s: float = 0.0  # from the run's start
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # gRPC status code name, or the finish reason of a failed stream
    conversation: int | None = None  # multi-turn runs: the conversation's index and this turn (from 1)
    turn: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason in _COMPLETED

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class _StreamTimer:
    """Client-side timings of one stream, the same for both backends: call tokens(n, now) per token-bearing
    chunk and end() after the stream."""

    def __init__(self, result: RequestResult, t0: float):
        self.result = result
        self.start = time.perf_counter()
        result.send_s = self.start - t0
        self.last: float | None = None

    def tokens(self, n: int, now: float) -> None:
        if n <= 0:
            return
        if self.last is None:
            self.result.ttft_s = now - self.start
        else:
            self.result.itl_s.extend([(now - self.last) / n] * n)
        self.last = now
        self.result.output_tokens += n

    def end(self) -> None:
        self.result.e2e_s = time.perf_counter() - self.start


def _send(
    client, prompt_token_ids: Sequence[int], max_tokens: int, *, sampling: dict, ignore_eos: bool, timeout_s,
    t0: float,
) -> tuple[RequestResult, list[int]]:  # fmt: skip
    """One streamed request: its timings, and the output token ids the server sent (none over HTTP)."""
    if isinstance(client, OpenAIClient):
        return _send_openai(
            client, prompt_token_ids, max_tokens, sampling=sampling, ignore_eos=ignore_eos,
            timeout_s=timeout_s, t0=t0,
        ), []  # fmt: skip
    import grpc

    result = RequestResult(prompt_tokens=len(prompt_token_ids))
    output_ids: list[int] = []
    timer = _StreamTimer(result, t0)
    try:
        stream = client.generate(
            list(prompt_token_ids), max_tokens=max_tokens, ignore_eos=ignore_eos, timeout_s=timeout_s,
            **sampling,
        )  # fmt: skip
        for chunk in stream:
            timer.tokens(len(chunk.token_ids), time.perf_counter())
            output_ids.extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                result.finish_reason = chunk.finish_reason
        timer.end()
        if result.finish_reason not in _COMPLETED:
            result.error = f"finish_{result.finish_reason}"
    except grpc.RpcError as e:
        result.error = e.code().name
        timer.end()
    return result, output_ids


class OpenAIClient:
    """The benchmark's client of the OpenAI-compatible HTTP API at `base_url` (http://HOST:PORT; a missing
    scheme means http, a trailing /v1 is dropped). One httpx.Client is shared by the dispatcher's threads."""

    def __init__(self, base_url: str, *, api_key: str | None = None, connect_timeout_s: float = 10.0):
        import httpx

        url = base_url.strip().rstrip("/")
        if "://" not in url:
            url = "http://" + url
        self.base_url = url.removesuffix("/v1")
        self.connect_timeout_s = connect_timeout_s
        self.model: str | None = None  # set by model_info()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Each request in flight holds one HTTP/1.1 connection for its stream: no cap on the pool (httpx
        # defaults to 100), and idle ones stay open so later requests do not pay a connect in their TTFT.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, limits=limits,
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
        )  # fmt: skip

    def model_info(self) -> dict:
        """The first model of GET /v1/models, as the server info (model_name, context_length and, where
        the card gives it, vocab_size, beside the card's own fields). Raises ValueError if no OpenAI API
        answers, it refuses the API key, or it lists no model."""
        import httpx

        try:
            response = self._http.get("/v1/models", timeout=self.connect_timeout_s)
        except httpx.HTTPError as e:
            name = type(e).__name__
            raise ValueError(f"no OpenAI-compatible server answers at {self.base_url} ({name})") from None
        if response.status_code != 200:
            raise ValueError(f"GET {self.base_url}/v1/models: {_http_error(response)}")
        models = response.json().get("data") or []
        if not models or not isinstance(models[0], dict) or not models[0].get("id"):
            raise ValueError(f"GET {self.base_url}/v1/models lists no model")
        card = models[0]
        self.model = card["id"]
        return card | {
            "model_name": card["id"], "context_length": card.get("max_model_len"),
            "vocab_size": card.get("vocab_size"),
        }  # fmt: skip

    def stream_completion(self, body: dict, *, timeout_s: float | None):
        """A streamed POST /v1/completions (a context manager yielding the httpx response)."""
        import httpx

        timeout = httpx.Timeout(timeout_s, connect=self.connect_timeout_s)
        return self._http.stream("POST", "/v1/completions", json=body, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> OpenAIClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _http_error(response) -> str:
    """`HTTP <status>: <error.message>` of a failed response (the body's text if it is not OpenAI's)."""
    response.read()
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    return f"HTTP {response.status_code}: {message}"


def _send_openai(
    client: OpenAIClient, prompt_token_ids: Sequence[int], max_tokens: int, *, sampling: dict,
    ignore_eos: bool, timeout_s: float | None, t0: float,
) -> RequestResult:  # fmt: skip
    """_send over HTTP: server-sent events of text chunks, then a usage chunk and `data: [DONE]`."""
    import httpx

    result = RequestResult(prompt_tokens=len(prompt_token_ids))
    body = {
        "model": client.model, "prompt": list(prompt_token_ids), "max_tokens": max_tokens,
        "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True},
    } | {k: v for k, v in sampling.items() if v is not None}  # fmt: skip
    timer = _StreamTimer(result, t0)
    deadline = None if timeout_s is None else timer.start + timeout_s
    usage_tokens = None
    try:
        with client.stream_completion(body, timeout_s=timeout_s) as response:
            if response.status_code != 200:
                result.error = _http_error(response)
            else:
                for line in response.iter_lines():
                    now = time.perf_counter()
                    if deadline is not None and now > deadline:  # httpx times single reads only
                        result.error = "timeout"
                        break
                    if not line.startswith("data:"):
                        continue  # the blank line after each event, comments
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:  # the server failed the request after the 200
                        error = event["error"]
                        message = error.get("message") if isinstance(error, dict) else error
                        result.error = f"stream error: {message}"
                        break
                    if event.get("usage"):
                        usage_tokens = event["usage"].get("completion_tokens")
                    for choice in event.get("choices") or ():
                        # One chunk per engine event with new tokens (its text may be empty: a special
                        # token, a partial character), the last one with the finish.
                        timer.tokens(1, now)
                        if choice.get("finish_reason") is not None:
                            result.finish_reason = choice["finish_reason"]
        if usage_tokens is not None:
            result.output_tokens = usage_tokens  # a chunk may hold several tokens
        timer.end()
        if result.error is None and result.finish_reason not in _COMPLETED:
            result.error = f"finish_{result.finish_reason}"
    except httpx.TimeoutException:
        result.error = "timeout"
        timer.end()
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = type(e).__name__
        timer.end()
    return result


def _dispatch(
    jobs: Sequence,
    run_job: Callable[[int, object, float], list[RequestResult]],
    *,
    request_rate: float,
    max_concurrency: int | None,
    seed: int,
    duration_s: float | None,
) -> tuple[list[RequestResult], float]:
    """Starts run_job(index, job, t0) for each job with Poisson arrivals at request_rate, at most
    max_concurrency at once; returns (every job's results, in job order, seconds from the first send to
    the last response). duration_s stops starting new jobs after that long."""
    if not request_rate > 0:
        raise ValueError(f"{request_rate=} must be > 0 (inf: all at once)")
    if max_concurrency is not None and max_concurrency <= 0:
        raise ValueError(f"{max_concurrency=} must be > 0")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / request_rate, size=len(jobs)) if math.isfinite(request_rate) else None
    places = threading.Semaphore(max_concurrency) if max_concurrency else None
    # Every job in flight holds a thread for its streams.
    pool = futures.ThreadPoolExecutor(max_workers=max_concurrency or max(1, min(len(jobs), 1024)))
    submitted: list[futures.Future] = []

    def work(index: int, job, t0: float) -> list[RequestResult]:
        try:
            return run_job(index, job, t0)
        finally:
            if places is not None:
                places.release()

    t0 = time.perf_counter()
    arrival = 0.0
    try:
        for i, job in enumerate(jobs):
            if gaps is not None:
                arrival += gaps[i]
                delay = t0 + arrival - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            if duration_s is not None and time.perf_counter() - t0 >= duration_s:
                break
            if places is not None:
                places.acquire()
            submitted.append(pool.submit(work, i, job, t0))
        results = [r for f in submitted for r in f.result()]
    finally:
        pool.shutdown(wait=True)
    if not results:
        return [], 0.0
    first = min(r.send_s for r in results)
    end = max(r.send_s + (r.e2e_s or 0.0) for r in results)
    return results, end - first


def run_load(
    client,
    requests: Sequence[BenchRequest],
    *,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    sampling: dict | None = None,
    ignore_eos: bool = True,
    timeout_s: float | None = None,
    duration_s: float | None = None,
) -> tuple[list[RequestResult], float]:
    """Sends `requests` through `client` (an InferenceClient or OpenAIClient); returns (results of the
    sent ones, seconds from the first send to the last response). duration_s stops sending new requests
    after that long."""
    options = dict(sampling=sampling or {}, ignore_eos=ignore_eos, timeout_s=timeout_s)

    def one(index: int, request: BenchRequest, t0: float) -> list[RequestResult]:
        return [_send(client, request.prompt_token_ids, request.max_tokens, t0=t0, **options)[0]]

    return _dispatch(
        requests, one, request_rate=request_rate, max_concurrency=max_concurrency, seed=seed,
        duration_s=duration_s,
    )  # fmt: skip


def run_conversations(
    client,
    conversations: Sequence[Conversation],
    *,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    seed: int = 0,
    sampling: dict | None = None,
    ignore_eos: bool = True,
    timeout_s: float | None = None,
    duration_s: float | None = None,
    on_turn: Callable[[int, int, tuple[int, ...], list[int]], None] | None = None,
) -> tuple[list[RequestResult], float]:
    """Like run_load, for conversations: each arrives (Poisson at request_rate) and holds one place of
    max_concurrency while it sends its turns one after the other (see Conversation). Results carry their
    conversation index and turn; a failed turn ends its conversation. on_turn(conversation, turn,
    prompt_token_ids, output_token_ids) is called after each turn (for tests and logs)."""
    if isinstance(client, OpenAIClient):
        raise ValueError(_NO_MULTI_TURN_OVER_HTTP)
    options = dict(sampling=sampling or {}, ignore_eos=ignore_eos, timeout_s=timeout_s)

    def converse(index: int, conversation: Conversation, t0: float) -> list[RequestResult]:
        results = []
        prompt, max_tokens = conversation.first.prompt_token_ids, conversation.first.max_tokens
        output_ids: list[int] = []
        for turn in range(1, conversation.num_turns + 1):
            if turn > 1:
                follow_up = conversation.follow_ups[turn - 2]
                prompt = next_turn_prompt(prompt, output_ids, follow_up.prompt_token_ids)
                max_tokens = follow_up.max_tokens
            result, output_ids = _send(client, prompt, max_tokens, t0=t0, **options)
            result.conversation, result.turn = index, turn
            results.append(result)
            if on_turn is not None:
                on_turn(index, turn, tuple(prompt), output_ids)
            if not result.ok:
                break
        return results

    return _dispatch(
        conversations, converse, request_rate=request_rate, max_concurrency=max_concurrency, seed=seed,
        duration_s=duration_s,
    )  # fmt: skip


# ---- statistics ----------------------------------------------------------------------------------------


def _stats_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    keys = ["mean", *(f"p{p}" for p in PERCENTILES), "max"]
    if len(values_s) == 0:
        return dict.fromkeys(keys)
    x = np.asarray(values_s, np.float64) * 1e3
    return dict(zip(keys, [float(x.mean()), *map(float, np.percentile(x, PERCENTILES)), float(x.max())]))


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    """Counts, throughputs (over duration_s) and latency statistics in ms; see the module docstring."""
    done = [r for r in results if r.ok]
    seconds = max(duration_s, 1e-9)
    n_in = sum(r.prompt_tokens for r in done)
    n_out = sum(r.output_tokens for r in done)
    summary = {
        "sent": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": dict(Counter(r.error or "unknown" for r in results if not r.ok)),
        "duration_s": duration_s,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(done) / seconds,
        "input_throughput": n_in / seconds,
        "output_throughput": n_out / seconds,
        "total_token_throughput": (n_in + n_out) / seconds,
        "ttft_ms": _stats_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": _stats_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": _stats_ms([g for r in done for g in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in done]),
        "goodput": None,
    }
    turns = sorted({r.turn for r in results if r.turn is not None})
    if turns:  # a multi-turn run

        def ttft(keep: Callable[[int], bool]) -> dict[str, float | None]:
            return _stats_ms([r.ttft_s for r in done if r.ttft_s is not None and keep(r.turn)])

        summary["conversations"] = len({r.conversation for r in results})
        summary["ttft_ms_first_turn"] = ttft(lambda t: t == 1)
        summary["ttft_ms_later_turns"] = ttft(lambda t: t > 1)
        summary["ttft_ms_by_turn"] = {str(n): ttft(lambda t, n=n: t == n) for n in turns}
        summary["completed_by_turn"] = {str(n): sum(r.turn == n for r in done) for n in turns}
    if slo_ttft_ms is not None or slo_tpot_ms is not None:

        def good(r: RequestResult) -> bool:
            ttft_ok = slo_ttft_ms is None or (r.ttft_s is not None and r.ttft_s * 1e3 <= slo_ttft_ms)
            tpot_ok = slo_tpot_ms is None or r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms
            return ttft_ok and tpot_ok

        num_good = sum(good(r) for r in done)
        summary["goodput"] = {
            "slo_ttft_ms": slo_ttft_ms,
            "slo_tpot_ms": slo_tpot_ms,
            "good_requests": num_good,
            "requests_per_s": num_good / seconds,
        }
    return summary


# ---- the benchmark -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    target: str | None = None  # default: DEFAULT_TARGETS[backend]
    backend: str = "grpc"  # or "openai": the OpenAI-compatible HTTP API at the base URL `target`
    api_key: str | None = dataclasses.field(default=None, repr=False)  # kept out of reprs and results
    vocab_size: int | None = None  # synthetic prompt ids are drawn below it (default: the server's)
    dataset: str = "synthetic"  # or "sharegpt"
    dataset_path: str | None = None
    num_prompts: int = 100
    input_len: LengthDistribution = LengthDistribution("fixed", 128)
    output_len: LengthDistribution = LengthDistribution("fixed", 64)
    max_output_len: int | None = None  # ShareGPT cap
    shared_prefix_len: int = 0  # synthetic: one shared document of this many tokens before each question
    multi_turn: int = 1  # turns per conversation (num_prompts conversations)
    turn_input_len: LengthDistribution = LengthDistribution("fixed", 32)  # later turns' user messages
    request_rates: tuple[float, ...] = (math.inf,)
    max_concurrency: int | None = None
    duration_s: float | None = None  # per rate: stop sending after this long
    warmup_requests: int = 4
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    connect_timeout_s: float = 10.0

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} must be one of {BACKENDS}")
        if self.target is None:
            object.__setattr__(self, "target", DEFAULT_TARGETS[self.backend])
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"{self.vocab_size=} must be > 0")
        if self.backend == "openai" and self.dataset != "synthetic":
            raise ValueError(
                "the sharegpt dataset needs the server's tokenizer, which the OpenAI API does not offer: "
                "use --backend grpc"
            )
        if self.backend == "openai" and self.multi_turn > 1:
            raise ValueError(_NO_MULTI_TURN_OVER_HTTP)
        if self.dataset not in ("synthetic", "sharegpt"):
            raise ValueError(f"dataset={self.dataset!r} must be synthetic or sharegpt")
        if self.dataset == "sharegpt" and not self.dataset_path:
            raise ValueError("dataset='sharegpt' needs dataset_path")
        if self.num_prompts <= 0 or self.warmup_requests < 0:
            raise ValueError(f"{self.num_prompts=} must be > 0 and {self.warmup_requests=} >= 0")
        if not self.request_rates or any(not r > 0 for r in self.request_rates):
            raise ValueError(f"request_rates={self.request_rates} must be non-empty and > 0")
        if self.shared_prefix_len < 0 or self.multi_turn < 1:
            raise ValueError(f"{self.shared_prefix_len=} must be >= 0 and {self.multi_turn=} >= 1")
        if self.shared_prefix_len and self.dataset != "synthetic":
            raise ValueError("shared_prefix_len needs the synthetic dataset")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        del d["api_key"]  # a secret: result files get shared
        d["input_len"], d["output_len"] = str(self.input_len), str(self.output_len)
        d["turn_input_len"] = str(self.turn_input_len)
        d["request_rates"] = [_rate_json(r) for r in self.request_rates]
        return d


def _rate_json(rate: float) -> float | str:
    return rate if math.isfinite(rate) else "inf"


def _connect(config: BenchConfig):
    """(client, server info) for config.backend; raises ValueError if the server does not answer."""
    if config.backend == "openai":
        client = OpenAIClient(
            config.target, api_key=config.api_key, connect_timeout_s=config.connect_timeout_s
        )
        try:
            return client, client.model_info()
        except BaseException:
            client.close()
            raise
    import grpc

    from jaxinfer.client import InferenceClient

    client = InferenceClient(config.target, api_key=config.api_key)
    try:
        grpc.channel_ready_future(client._channel).result(timeout=config.connect_timeout_s)
        info = client.model_info()
    except (grpc.FutureTimeoutError, grpc.RpcError) as e:
        client.close()
        if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise ValueError(f"the server at {config.target} refused the API key ({e.details()})") from None
        raise ValueError(f"no jaxinfer server answers at {config.target} ({type(e).__name__})") from None
    return client, info


def run_benchmark(config: BenchConfig, *, log: Callable[[str], None] | None = None) -> dict:
    """Warm-up, then one load run per rate; returns the result document (see the module docstring)."""
    log = log or (lambda message: None)
    client, info = _connect(config)
    try:
        log(f"backend {config.backend}: {config.target}, model {info.get('model_name')}")
        context = int(info.get("context_length") or 0)
        vocab_size = int(config.vocab_size or info.get("vocab_size") or 0)
        if not vocab_size:  # the OpenAI model card need not say
            raise ValueError(
                f"the server at {config.target} does not give its vocabulary size: pass --vocab-size"
            )
        if context < 2:
            raise ValueError(f"the server at {config.target} gives no usable context length ({context})")
        total = config.num_prompts + config.warmup_requests
        if config.shared_prefix_len:
            shared = dict(vocab_size=vocab_size, context_length=context)
            # The warm-up requests share a document of their own: the measured run starts uncached.
            requests = shared_prefix_requests(
                config.warmup_requests, config.shared_prefix_len, config.input_len, config.output_len,
                seed=config.seed + 1, **shared,
            ) if config.warmup_requests else []  # fmt: skip
            requests += shared_prefix_requests(
                config.num_prompts, config.shared_prefix_len, config.input_len, config.output_len,
                seed=config.seed, **shared,
            )  # fmt: skip
        elif config.dataset == "synthetic":
            requests = synthetic_requests(
                total, config.input_len, config.output_len,
                vocab_size=vocab_size, context_length=context, seed=config.seed,
            )  # fmt: skip
        else:
            requests = sharegpt_requests(
                config.dataset_path, client.tokenize,
                num_requests=total, context_length=context, seed=config.seed,
                max_output_len=config.max_output_len,
            )  # fmt: skip
        warmup, measured = requests[: config.warmup_requests], requests[config.warmup_requests :]
        if not measured:
            raise ValueError(f"the dataset gave {len(requests)} requests, all used for warm-up")
        conversations = None
        if config.multi_turn > 1:
            conversations = multi_turn_conversations(
                measured, config.multi_turn, config.turn_input_len, config.output_len,
                vocab_size=vocab_size, context_length=context, seed=config.seed,
            )  # fmt: skip
        # The same sampling fields go to both backends (they have the same names in OpenAI's API).
        load = dict(
            max_concurrency=config.max_concurrency,
            sampling={"temperature": config.temperature, "seed": config.seed},
            ignore_eos=config.ignore_eos, timeout_s=config.timeout_s,
        )  # fmt: skip
        if warmup:
            log(f"warm-up: {len(warmup)} requests")
            run_load(client, warmup, seed=config.seed, **load)
        runs = []
        for rate in config.request_rates:
            timing = dict(request_rate=rate, seed=config.seed, duration_s=config.duration_s)
            if conversations is None:
                log(f"rate {_rate_json(rate)} req/s: {len(measured)} requests")
                results, duration = run_load(client, measured, **timing, **load)
            else:
                turns = sum(c.num_turns for c in conversations)
                log(f"rate {_rate_json(rate)} conv/s: {len(conversations)} conversations, {turns} turns")
                results, duration = run_conversations(client, conversations, **timing, **load)
            summary = summarize(
                results, duration, slo_ttft_ms=config.slo_ttft_ms, slo_tpot_ms=config.slo_tpot_ms
            )
            per_request = [dataclasses.asdict(r) | {"tpot_s": r.tpot_s, "ok": r.ok} for r in results]
            for r in per_request:
                r.pop("itl_s")  # kept in the itl_ms summary; per token it would dominate the file
            runs.append(
                {"request_rate": _rate_json(rate), "max_concurrency": config.max_concurrency}
                | summary | {"requests": per_request}
            )  # fmt: skip
    finally:
        client.close()
    return {
        "benchmark": "jaxinfer bench-serving",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "server": info,
        "config": config.to_json(),
        "runs": runs,
    }


def format_table(result: dict) -> str:
    """A Markdown table, one row per run."""
    head = (
        "| rate (req/s) | completed / failed | duration (s) | req/s | output tok/s | TTFT p50 / p99 (ms) "
        "| TPOT p50 / p99 (ms) | ITL p50 / p99 (ms) | E2E p50 / p99 (ms) |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]

    def pair(stats: dict) -> str:
        return " / ".join("-" if stats[k] is None else f"{stats[k]:.0f}" for k in ("p50", "p99"))

    for run in result["runs"]:
        rows.append(
            f"| {run['request_rate']} | {run['completed']} / {run['failed']} | {run['duration_s']:.1f} "
            f"| {run['request_throughput']:.2f} | {run['output_throughput']:.1f} | {pair(run['ttft_ms'])} "
            f"| {pair(run['tpot_ms'])} | {pair(run['itl_ms'])} | {pair(run['e2e_ms'])} |"
        )
    turn_runs = [run for run in result["runs"] if "ttft_ms_by_turn" in run]
    if turn_runs:
        head = (
            "| rate (conv/s) | conversations | TTFT p50 / p99 turn 1 (ms) | TTFT p50 / p99 later turns (ms) "
            "| TTFT p50 by turn (ms) |"
        )
        rows += ["", head, "|" + "---|" * (head.count("|") - 1)]
        for run in turn_runs:
            by_turn = ", ".join(
                f"{turn}: " + ("-" if stats["p50"] is None else f"{stats['p50']:.0f}")
                for turn, stats in run["ttft_ms_by_turn"].items()
            )
            rows.append(
                f"| {run['request_rate']} | {run['conversations']} | {pair(run['ttft_ms_first_turn'])} "
                f"| {pair(run['ttft_ms_later_turns'])} | {by_turn} |"
            )
    return "\n".join(rows)


# ---- plots ---------------------------------------------------------------------------------------------


def plot_results(result: dict, prefix: str | os.PathLike[str]) -> list[Path]:
    """PNG plots: PREFIX_latency_cdf.png, and for two or more finite rates PREFIX_sweep.png."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    prefix = Path(prefix)
    written = []
    metrics = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4))
    for ax, (key, title) in zip(axes, metrics):
        for run in result["runs"]:
            x = np.sort([r[key] * 1e3 for r in run["requests"] if r["ok"] and r[key] is not None])
            if len(x):
                ax.step(
                    x, np.arange(1, len(x) + 1) / len(x), where="post", label=f"{run['request_rate']} req/s"
                )
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].legend(title="offered rate")
    fig.tight_layout()
    written.append(prefix.with_name(prefix.name + "_latency_cdf.png"))
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    runs = [run for run in result["runs"] if run["request_rate"] != "inf"]
    if len(runs) >= 2:
        rates = [run["request_rate"] for run in runs]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        left.plot(rates, [run["output_throughput"] for run in runs], "o-", label="output tok/s")
        left.set(xlabel="offered rate (req/s)", ylabel="output tokens/s", title="Throughput")
        twin = left.twinx()
        twin.plot(
            rates, [run["request_throughput"] for run in runs], "s--", color="tab:orange", label="req/s"
        )
        twin.set_ylabel("completed requests/s")
        left.legend(loc="upper left")
        twin.legend(loc="lower right")
        for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
            right.plot(rates, [run[key]["p99"] for run in runs], "o-", label=f"p99 {label}")
        right.set(xlabel="offered rate (req/s)", ylabel="ms", title="p99 latency", yscale="log")
        right.legend()
        for ax in (left, right):
            ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(prefix.with_name(prefix.name + "_sweep.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


# ---- command line --------------------------------------------------------------------------------------


def add_bench_serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend", choices=BACKENDS, default="grpc",
        help="grpc: the gRPC API; openai: the OpenAI-compatible HTTP API (jaxinfer serve --http-port)",
    )  # fmt: skip
    p.add_argument(
        "--target", default=None,
        help="grpc: host:port of a running jaxinfer server (default 127.0.0.1:50051); openai: its HTTP base "
        "URL (default http://127.0.0.1:8000)",
    )  # fmt: skip
    p.add_argument("--api-key", default=None, help="the server's API key (default: $JAXINFER_API_KEY)")
    p.add_argument(
        "--vocab-size", type=int, default=None,
        help="draw synthetic prompt ids below N (default: the server's vocab_size; the OpenAI API's model "
        "card may not give it)",
    )  # fmt: skip
    p.add_argument("--result-file", default="bench_serving.json", help="where the JSON result goes")
    p.add_argument("--dataset", choices=["synthetic", "sharegpt"], default="synthetic")
    p.add_argument("--dataset-path", default=None, help="ShareGPT-style JSON/JSONL (--dataset sharegpt)")
    p.add_argument("--num-prompts", type=int, default=100, help="measured requests per rate")
    p.add_argument("--input-len", default="fixed:128", help="e.g. 128, uniform:32,256, normal:128,32")
    p.add_argument("--output-len", default="fixed:64", help="like --input-len")
    p.add_argument("--max-output-len", type=int, default=None, help="cap on ShareGPT output lengths")
    p.add_argument(
        "--shared-prefix-len", type=int, default=0,
        help="synthetic: every prompt starts with one shared random document of N tokens, then its own "
        "question of --input-len tokens (prefix-caching load)",
    )  # fmt: skip
    p.add_argument(
        "--multi-turn", type=int, default=1,
        help="K turns per conversation (--num-prompts conversations): turn i+1's prompt is turn i's prompt, "
        "its output tokens and a new user message of --turn-input-len tokens; TTFT is reported per turn",
    )  # fmt: skip
    p.add_argument("--turn-input-len", default="fixed:32", help="--multi-turn: later turns' message lengths")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals/s (inf: at once)")
    p.add_argument("--sweep-rates", default=None, help="comma-separated rates, one run each, e.g. 0.5,1,2")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--duration", type=float, default=None, help="per rate: stop sending after S seconds")
    p.add_argument("--warmup-requests", type=int, default=4, help="sent first, not counted")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None, help="per-request deadline in seconds")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--plot", action="store_true", help="also write PNG plots beside the result file")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from jaxinfer.client import api_key_or_env

    if args.sweep_rates:
        try:
            rates = tuple(float(r) for r in args.sweep_rates.split(","))
        except ValueError:
            raise ValueError(f"--sweep-rates={args.sweep_rates!r} must be comma-separated numbers") from None
    else:
        rates = (args.request_rate,)
    return BenchConfig(
        target=args.target, backend=args.backend, api_key=api_key_or_env(args.api_key),
        vocab_size=args.vocab_size, dataset=args.dataset, dataset_path=args.dataset_path,
        num_prompts=args.num_prompts, input_len=LengthDistribution.parse(args.input_len),
        output_len=LengthDistribution.parse(args.output_len), max_output_len=args.max_output_len,
        shared_prefix_len=args.shared_prefix_len, multi_turn=args.multi_turn,
        turn_input_len=LengthDistribution.parse(args.turn_input_len),
        request_rates=rates, max_concurrency=args.max_concurrency, duration_s=args.duration,
        warmup_requests=args.warmup_requests, ignore_eos=args.ignore_eos, temperature=args.temperature,
        seed=args.seed, timeout_s=args.timeout, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
    )  # fmt: skip


def main_from_args(args: argparse.Namespace) -> int:
    """Runs the benchmark from parsed arguments, prints the table, writes the result (and plots)."""
    import sys

    config = config_from_args(args)
    result = run_benchmark(config, log=lambda message: print(message, file=sys.stderr, flush=True))
    path = Path(args.result_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    print(f"wrote {path}", file=sys.stderr)
    if args.plot:
        for png in plot_results(result, path.with_suffix("")):
            print(f"wrote {png}", file=sys.stderr)
    return 0 if all(run["completed"] for run in result["runs"]) else 1
