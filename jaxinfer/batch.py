"""Offline batch generation from a JSONL file into a JSONL file: the `jaxinfer batch` path.

Input, one JSON object per line:
  {"id": "q1", "prompt": "Hello", "max_tokens": 32, "temperature": 0}
  {"id": 2, "messages": [{"role": "user", "content": "Hi"}], "stop": ["\\n"], "metadata": {...}}
`id` (a string or an integer, unique in the file) and exactly one of `prompt` / `messages` are required;
the sampling fields of request.py (max_tokens, temperature, stop, ...) override the CLI sampling flags,
which override the model's recommended values; `metadata` is copied to the output unchanged.
Output, one JSON object per line, in completion order (not input order):
  {"id", "text", "token_ids", "finish_reason", "usage": {prompt_tokens, completion_tokens, ttft_s,
   tpot_s, queue_time_s, e2e_s}, ["metadata"]}

How it runs: the input is parsed and validated first (a bad line is reported on stderr with its line
number and skipped, or with strict=True ends the run before any generation). Then an in-process
Orchestrator gets requests submitted ahead of the device - up to every slot plus its waiting queue -
so no slot idles while requests remain; a QueueFull just means waiting for the next completion.

Resumable: each result is appended as one complete line with a single write, then fsync'ed. A run
killed at any moment (SIGKILL included) leaves at most a partial last line; the next run with the
same arguments truncates the file to its last newline, skips the ids already there, and generates
the rest. Requests that end with "cancelled" or "error" are not written, so a rerun retries them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import IO, Any

import numpy as np

from jaxinfer.engine import Engine
from jaxinfer.orchestrator import NotAccepting, Orchestrator, QueueFull, RequestHandle
from jaxinfer.request import (
    FIELD_TYPES,
    FinishReason,
    ModelDefaults,
    SamplingParams,
    check_request,
    encode_prompt,
    parse_sampling,
)
from jaxinfer.speculation.config import SpeculationConfig

__all__ = [
    "BatchInputError",
    "BatchItem",
    "BatchSummary",
    "parse_input",
    "parse_input_line",
    "read_done_ids",
    "run_batch",
]

_SAMPLING_KEYS = set(FIELD_TYPES) - {"structured_output"}
_KNOWN_KEYS = {"id", "prompt", "messages", "metadata", *_SAMPLING_KEYS}
# The ones written; others are retried on the next run.
_RESULT_FINISH_REASONS = (FinishReason.STOP, FinishReason.LENGTH)


class BatchInputError(ValueError):
    """A bad input line under strict=True (the CLI exits with status 2)."""


@dataclasses.dataclass(frozen=True)
class BatchItem:
    line_number: int  # 1-based, in the input file
    id: str | int
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    metadata: Any = None


@dataclasses.dataclass
class BatchSummary:
    num_input_lines: int = 0  # non-blank lines
    num_bad_lines: int = 0
    num_already_done: int = 0  # ids found in the output at start (resumed)
    num_requests: int = 0  # generated in this run
    num_failed: int = 0  # ended "error" or "cancelled" (not written)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: dict[str, float | None] = dataclasses.field(default_factory=dict)  # p50 / p95 / p99
    tpot_s: dict[str, float | None] = dataclasses.field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def completion_tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.completion_tokens) / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {
            "requests_per_s": self.requests_per_s,
            "completion_tokens_per_s": self.completion_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
        }

    def format(self) -> str:
        def ms(stats: Mapping[str, float | None]) -> str:
            return " / ".join("-" if v is None else f"{v * 1e3:.1f}" for v in stats.values()) + " ms"

        return "\n".join(
            [
                f"requests: {self.num_requests} generated, {self.num_already_done} already done, "
                f"{self.num_failed} failed, {self.num_bad_lines} bad input lines "
                f"(of {self.num_input_lines} lines)",
                f"tokens: {self.prompt_tokens} prompt, {self.completion_tokens} completion",
                f"wall time: {self.wall_s:.2f} s; throughput: {self.requests_per_s:.2f} req/s, "
                f"{self.completion_tokens_per_s:.1f} completion tok/s, "
                f"{self.total_tokens_per_s:.1f} total tok/s",
                f"TTFT p50 / p95 / p99: {ms(self.ttft_s)}",
                f"TPOT p50 / p95 / p99: {ms(self.tpot_s)}",
            ]
        )


# ---- input ---------------------------------------------------------------------------------------------


def parse_input_line(
    line: str,
    *,
    tokenizer,
    engine: Engine,
    base_fields: Mapping[str, Any] | None = None,
    sampling_defaults: ModelDefaults | None = None,
    line_number: int = 0,
) -> BatchItem:
    """One input line -> BatchItem. Raises ValueError saying what is wrong (the caller adds the line)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _KNOWN_KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; expected some of {sorted(_KNOWN_KEYS)}")
    request_id = obj.get("id")
    if isinstance(request_id, bool) or not isinstance(request_id, str | int) or request_id == "":
        raise ValueError(f"id={request_id!r} must be a non-empty string or an integer")
    fields = dict(base_fields or {}) | {k: v for k, v in obj.items() if k in _SAMPLING_KEYS}
    sampling = parse_sampling(fields, defaults=sampling_defaults)
    messages = obj.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise ValueError("messages must be a list of {role, content} objects")
    prompt_ids = encode_prompt(tokenizer, prompt=obj.get("prompt"), messages=messages)
    # vocabulary, context length
    check_request(prompt_ids, sampling, vocab_size=tokenizer.vocab_size, max_seq_len=engine.max_seq_len)
    return BatchItem(line_number, request_id, tuple(prompt_ids), sampling, obj.get("metadata"))


def _id_key(request_id: str | int) -> str:
    return json.dumps(request_id)  # "1" and 1 are different ids


def parse_input(
    path: str | os.PathLike[str],
    *,
    tokenizer,
    engine: Engine,
    base_fields: Mapping[str, Any] | None = None,
    sampling_defaults: ModelDefaults | None = None,
    strict: bool = False,
    errors: IO[str] | None = None,
) -> tuple[list[BatchItem], int, int]:
    """Reads the whole input: (items, number of non-blank lines, number of bad lines).

    Each bad line is reported on `errors` (default stderr) as "PATH:LINE: message"; with strict=True
    the first one raises BatchInputError instead. A repeated id is bad at its second occurrence.
    """
    errors = errors if errors is not None else sys.stderr
    items: list[BatchItem] = []
    seen: dict[str, int] = {}
    num_lines = num_bad = 0
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            num_lines += 1
            try:
                item = parse_input_line(
                    line, tokenizer=tokenizer, engine=engine, base_fields=base_fields,
                    sampling_defaults=sampling_defaults, line_number=line_number,
                )  # fmt: skip
                first = seen.get(_id_key(item.id))
                if first is not None:
                    raise ValueError(f"duplicate id {item.id!r} (first on line {first})")
            except ValueError as e:
                message = f"{path}:{line_number}: {e}"
                if strict:
                    raise BatchInputError(message) from None
                num_bad += 1
                print(f"skipped {message}", file=errors)
                continue
            seen[_id_key(item.id)] = line_number
            items.append(item)
    return items, num_lines, num_bad


# ---- output --------------------------------------------------------------------------------------------


def read_done_ids(path: str | os.PathLike[str]) -> set[str]:
    """Ids (as JSON text) already in the output; first truncates a partial last line left by a kill."""
    path = Path(path)
    if not path.exists():
        return set()
    with open(path, "r+b") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1  # 0 when there is no complete line at all
        if keep != len(data):
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    done = set()
    for line_number, line in enumerate(data[:keep].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            done.add(_id_key(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}:{line_number}: not a result line written by jaxinfer batch ({e})"
            ) from None
    return done


class _ResultWriter:
    """Appends whole lines: one os.write per line, then fsync, so a kill never splits or loses a
    finished result (a partial write can only be the last line, which read_done_ids drops)."""

    def __init__(self, path: str | os.PathLike[str]):
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        written = os.write(self._fd, data)
        while written < len(data):  # regular files take it all at once; this is for odd filesystems
            written += os.write(self._fd, data[written:])
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


# ---- running -------------------------------------------------------------------------------------------


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(np.asarray(values, np.float64), [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def _result_record(item: BatchItem, token_ids: list[int], text: str, last) -> dict:
    u = last.usage
    record = {
        "id": item.id,
        "text": text,
        "token_ids": token_ids,
        "finish_reason": last.finish_reason,
        "usage": dataclasses.asdict(u) if u is not None else None,
    }
    if item.metadata is not None:
        record["metadata"] = item.metadata
    return record


def run_batch(
    engine: Engine,
    tokenizer,
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    base_fields: Mapping[str, Any] | None = None,
    sampling_defaults: ModelDefaults | None = None,
    strict: bool = False,
    max_queue: int = 64,
    progress: bool = True,
    errors: IO[str] | None = None,
    speculation: SpeculationConfig | None = None,
) -> BatchSummary:
    """Generates a completion for every input line whose id is not yet in the output (module docstring).

    base_fields: sampling fields every line starts from (the CLI flags); sampling_defaults: the
    model's recommended values for fields neither sets. Raises BatchInputError on the first bad line
    under strict=True, before anything is generated.
    """
    if max_queue <= 0:
        raise ValueError(f"{max_queue=} must be > 0")
    parse_sampling(dict(base_fields or {})).validate()
    errors = errors if errors is not None else sys.stderr
    items, num_lines, num_bad = parse_input(
        input_path, tokenizer=tokenizer, engine=engine, base_fields=base_fields,
        sampling_defaults=sampling_defaults, strict=strict, errors=errors,
    )  # fmt: skip
    done = read_done_ids(output_path)
    todo = [item for item in items if _id_key(item.id) not in done]
    summary = BatchSummary(
        num_input_lines=num_lines, num_bad_lines=num_bad, num_already_done=len(items) - len(todo)
    )
    ttfts: list[float] = []
    tpots: list[float] = []
    writer = _ResultWriter(output_path)
    orchestrator = Orchestrator(
        engine, tokenizer, max_queue=max_queue, structured_output=False, speculation=speculation
    ).start()
    # One collector thread per request in flight: at most every slot plus the waiting queue.
    max_in_flight = engine.num_slots + max_queue
    pool = futures.ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="jaxinfer-batch")
    bar = _progress_bar(len(todo), enabled=progress, file=errors)
    start = time.perf_counter()
    in_flight: dict[futures.Future, tuple[BatchItem, RequestHandle]] = {}
    next_index = 0
    try:
        while next_index < len(todo) or in_flight:
            # Submit ahead until the queue pushes back.
            while next_index < len(todo) and len(in_flight) < max_in_flight:
                item = todo[next_index]
                try:
                    handle = orchestrator.submit(item.prompt_token_ids, item.sampling)
                except QueueFull:
                    break
                except NotAccepting:  # the engine failed: what was not submitted counts as failed
                    summary.num_failed += len(todo) - next_index
                    print(f"the engine failed ({orchestrator.failure!r}); {len(todo) - next_index} "
                          "requests not run", file=errors)  # fmt: skip
                    next_index = len(todo)
                    break
                in_flight[pool.submit(handle.collect)] = (item, handle)
                next_index += 1
            if not in_flight:  # QueueFull with nothing of ours in flight cannot last: retry shortly
                time.sleep(0.01)
                continue
            finished, _ = futures.wait(in_flight, timeout=1.0, return_when=futures.FIRST_COMPLETED)
            for future in finished:
                item, _ = in_flight.pop(future)
                token_ids, text, last = future.result()
                if last.finish_reason not in _RESULT_FINISH_REASONS:
                    summary.num_failed += 1
                    print(f"request {item.id!r} (line {item.line_number}) ended {last.finish_reason!r}",
                          file=errors)  # fmt: skip
                    continue
                writer.write(_result_record(item, token_ids, text, last))
                u = last.usage
                summary.num_requests += 1
                summary.prompt_tokens += u.prompt_tokens
                summary.completion_tokens += u.completion_tokens
                if u.ttft_s is not None:
                    ttfts.append(u.ttft_s)
                if u.tpot_s is not None:
                    tpots.append(u.tpot_s)
                if bar is not None:
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"{summary.completion_tokens / elapsed:.1f} tok/s", refresh=False)
                    bar.update(1)
    finally:
        for _, handle in in_flight.values():
            handle.cancel()
        orchestrator.stop(grace_s=0.0)
        pool.shutdown(wait=True)
        writer.close()
        if bar is not None:
            bar.close()
    summary.wall_s = time.perf_counter() - start
    summary.ttft_s = _percentiles(ttfts)
    summary.tpot_s = _percentiles(tpots)
    return summary


def _progress_bar(total: int, *, enabled: bool, file: IO[str]):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="batch", file=file, dynamic_ncols=True, smoothing=0.1)
