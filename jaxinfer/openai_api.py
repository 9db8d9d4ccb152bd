"""The OpenAI-compatible HTTP API (FastAPI), served beside gRPC over the same Orchestrator.

Routes: POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events ending with
`data: [DONE]`, or one JSON body), GET /v1/models, GET /health, GET /metrics (Prometheus).
This module only renames OpenAI's fields to request.py's (max_completion_tokens -> max_tokens,
logprobs/top_logprobs -> logprobs, response_format -> structured_output) and shapes the answers;
request.py parses and validates them. Errors use OpenAI's body, {"error": {message, type, param,
code}}, with status 400 (bad request), 401 (missing or wrong API key), 404 (unknown model or route),
429 (waiting queue full), 500 (server failure) or 503 (shutting down). With an API key, /v1/* needs
`Authorization: Bearer <key>`; /health and /metrics stay open (probes and scrapers).

A client that disconnects cancels its requests: a stream when its send fails or the server sees the
disconnect, a non-streamed request when the connection closes while it waits; the slot and pages are
free for the next engine step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxinfer.orchestrator import NotAccepting, Orchestrator, QueueFull, RequestHandle, StreamEvent
from jaxinfer.request import (
    FinishReason,
    ModelDefaults,
    RequestError,
    SamplingParams,
    StructuredKind,
    StructuredOutput,
    encode_prompt,
    parse_sampling,
    structured_output_from_json_schema,
)
from jaxinfer.scheduler import TokenLogprobs

MAX_N = 16  # choices per request

# OpenAI field -> request.py field, for fields that only change name.
_SAMPLING_RENAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "speculative": "speculative",  # extensions, as vLLM takes its own: speculative decoding per request
    "num_draft_tokens": "num_draft_tokens",
}
_COMMON_FIELDS = {*_SAMPLING_RENAMES, "model", "max_tokens", "n", "stream", "stream_options", "user"}
_CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
}  # fmt: skip
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "response_format"}
_DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, type: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    def response(self) -> JSONResponse:
        body = {"message": str(self), "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


def _bad_request(e: ValueError) -> ApiError:
    return ApiError(400, str(e), type="invalid_request_error", param=getattr(e, "param", None))


@dataclasses.dataclass(frozen=True)
class _Parsed:
    prompt_token_ids: list[int]
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool


def _response_format(value: Any) -> StructuredOutput | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise RequestError(
            "response_format must be {'type': 'text' | 'json_object' | 'json_schema', ...}", "response_format"
        )
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping) or "schema" not in spec:
        raise RequestError("response_format.json_schema must hold a 'schema'", "response_format")
    return structured_output_from_json_schema(spec["schema"], "response_format.json_schema.schema")


class OpenAIServer:
    """Request translation and response shaping for one served model."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        tokenizer,
        *,
        model_name: str,
        context_length: int,
        defaults: ModelDefaults,
    ):
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context_length = context_length
        self.defaults = defaults
        self.created = int(time.time())

    # ---- requests --------------------------------------------------------------------------------------

    def parse(self, body: Any, *, chat: bool) -> _Parsed:
        """An OpenAI request body -> prompt ids and SamplingParams (request.py validates)."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", None)
        allowed = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise RequestError(f"unsupported fields {unknown}", unknown[0])
        # One model per server: a request that names none means it (as vLLM reads the field).
        model = body.get("model", self.model_name)
        if model != self.model_name:
            raise ApiError(
                404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                type="invalid_request_error", param="model", code="model_not_found",
            )  # fmt: skip
        if chat:
            prompt_ids = encode_prompt(self.tokenizer, messages=_list(body.get("messages"), "messages"))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                prompt_ids = encode_prompt(self.tokenizer, prompt_token_ids=prompt)
            elif isinstance(prompt, str):
                prompt_ids = encode_prompt(self.tokenizer, prompt=prompt)
            else:
                raise RequestError("prompt must be a string or a list of token ids", "prompt")

        fields = {ours: body.get(theirs) for theirs, ours in _SAMPLING_RENAMES.items()}
        max_tokens = (
            body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
        )
        if max_tokens is None:  # chat: the rest of the context, as vLLM does
            max_tokens = self.context_length - len(prompt_ids) if chat else _DEFAULT_COMPLETION_MAX_TOKENS
        fields["max_tokens"] = max_tokens
        if chat:
            top = body.get("top_logprobs")
            if top is not None and body.get("logprobs") is not True:
                raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
            if body.get("logprobs") not in (None, True, False):
                raise RequestError("logprobs must be a boolean", "logprobs")
            fields["logprobs"] = (top or 0) if body.get("logprobs") else None
        else:
            fields["logprobs"] = body.get("logprobs")
        fields["structured_output"] = _response_format(body.get("response_format"))
        sampling = parse_sampling(fields, defaults=self.defaults)

        n = body.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
            raise RequestError(f"n={n!r} must be an integer in [1, {MAX_N}]", "n")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be a boolean", "stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise RequestError(
                "stream_options may hold include_usage, continuous_usage_stats", "stream_options"
            )
        return _Parsed(prompt_ids, sampling, n, stream, bool(options.get("include_usage")))

    def submit(self, parsed: _Parsed, request_id: str) -> list[RequestHandle]:
        """One engine request per choice; choice i samples with seed + i, so n choices differ and a
        seeded request repeats."""
        handles = []
        try:
            for i in range(parsed.n):
                seed = (parsed.sampling.seed + i) % 2**63
                sampling = dataclasses.replace(parsed.sampling, seed=seed)
                handles.append(
                    self.orchestrator.submit(parsed.prompt_token_ids, sampling, f"{request_id}-{i}")
                )
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return handles

    # ---- responses -------------------------------------------------------------------------------------

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one server per process, bounded
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special=False)

    def _logprob_entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def chat_logprobs(self, logprobs: Sequence[TokenLogprobs]) -> dict:
        return {
            "content": [
                self._logprob_entry(lp.token_id, lp.logprob)
                | {"top_logprobs": [self._logprob_entry(t, v) for t, v in lp.top]}
                for lp in logprobs
            ]
        }

    def completion_logprobs(self, logprobs: Sequence[TokenLogprobs], offset: int) -> dict:
        tokens = [self.token_text(lp.token_id) for lp in logprobs]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "jaxinfer",
            "max_model_len": self.context_length,
            "vocab_size": self.tokenizer.vocab_size,
            "sampling_defaults": self.defaults.to_json(),
        }


def _list(value: Any, name: str) -> list:
    if not isinstance(value, list):
        raise RequestError(f"{name} must be a list", name)
    return value


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _finish_error(reasons: Sequence[FinishReason | None]) -> ApiError | None:
    if FinishReason.ERROR in reasons:
        return ApiError(500, "the server failed while generating", type="server_error")
    if FinishReason.CANCELLED in reasons:
        return ApiError(503, "the server is shutting down", type="service_unavailable")
    return None


async def _merged(handles: Sequence[RequestHandle]) -> AsyncIterator[tuple[int, StreamEvent]]:
    """(choice index, event) from every handle, as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        async for event in handle:
            await queue.put((i, event))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, event = await queue.get()
            remaining -= event.finish_reason is not None
            yield i, event
    finally:
        for t in tasks:
            t.cancel()


def build_app(server: OpenAIServer, *, api_key: str | None = None, metrics_registry=None) -> FastAPI:
    app = FastAPI(title="jaxinfer", docs_url=None, redoc_url=None, openapi_url=None)
    expected = f"Bearer {api_key}".encode() if api_key else None

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return ApiError(e.status_code, str(e.detail), type=kind).response()

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if expected is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return ApiError(
                    401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                    type="invalid_request_error", code="invalid_api_key",
                ).response()  # fmt: skip
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        ok = server.orchestrator.accepting
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        registry = metrics_registry or server.orchestrator.metrics.registry
        return Response(
            prometheus_client.generate_latest(registry), media_type=prometheus_client.CONTENT_TYPE_LATEST
        )

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [server.model_card()]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(request, chat=False)

    async def _complete(request: Request, *, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", type="invalid_request_error") from None
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            # Tokenising, grammar compilation and admission run off the event loop.
            parsed = await run_in_threadpool(server.parse, body, chat=chat)
            handles = await run_in_threadpool(server.submit, parsed, request_id)
        except ValueError as e:  # RequestError, or a request the KV pool could never hold
            raise _bad_request(e) from None
        except QueueFull as e:
            raise ApiError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except NotAccepting as e:
            raise ApiError(503, str(e), type="service_unavailable") from None
        shape = _ChatShape(server, request_id) if chat else _CompletionShape(server, request_id)
        if parsed.stream:
            return StreamingResponse(
                _stream(handles, shape, parsed), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )  # fmt: skip
        return await _whole(request, handles, shape, parsed)

    return app


async def _stream(handles: list[RequestHandle], shape: _Shape, parsed: _Parsed) -> AsyncIterator[str]:
    completion_tokens = 0
    try:
        for i in range(parsed.n):
            if (first := shape.first_chunk(i)) is not None:
                yield _sse(first)
        async for i, event in _merged(handles):
            completion_tokens += len(event.token_ids)
            error = _finish_error([event.finish_reason])
            if error is not None:
                yield _sse(
                    {"error": {"message": str(error), "type": error.type, "param": None, "code": None}}
                )
                continue
            if event.text or event.token_ids or event.finish_reason is not None:
                yield _sse(shape.chunk(i, event))
        if parsed.include_usage:
            yield _sse(
                shape.envelope([]) | {"usage": _usage(len(parsed.prompt_token_ids), completion_tokens)}
            )
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the task is cancelled) or the stream ended: no-ops once finished
        for h in handles:
            h.cancel()


async def _whole(request: Request, handles: list[RequestHandle], shape: _Shape, parsed: _Parsed) -> Response:
    async def collect(handle: RequestHandle) -> tuple[list[int], str, list[TokenLogprobs], StreamEvent]:
        tokens, texts, logprobs, last = [], [], [], None
        async for last in handle:
            tokens += last.token_ids
            texts.append(last.text)
            logprobs += last.logprobs
        return tokens, "".join(texts), logprobs, last

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.gather(*(collect(h) for h in handles))
    watch = asyncio.create_task(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:  # the client is gone: nobody reads the answer
            return Response(status_code=499)
        results = work.result()
    finally:
        watch.cancel()
        for h in handles:
            h.cancel()
    error = _finish_error([last.finish_reason for *_, last in results])
    if error is not None:
        raise error
    choices = [
        shape.choice(i, text, logprobs, last.finish_reason)
        for i, (_, text, logprobs, last) in enumerate(results)
    ]
    completion_tokens = sum(len(tokens) for tokens, *_ in results)
    return JSONResponse(
        shape.envelope(choices, whole=True)
        | {"usage": _usage(len(parsed.prompt_token_ids), completion_tokens)}
    )


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Shape:
    """The OpenAI body shapes of one endpoint."""

    object_whole: str
    object_chunk: str

    def __init__(self, server: OpenAIServer, request_id: str):
        self.server, self.request_id, self.created = server, request_id, int(time.time())
        self.text_offsets: dict[int, int] = {}

    def envelope(self, choices: list, *, whole: bool = False) -> dict:
        return {
            "id": self.request_id,
            "object": self.object_whole if whole else self.object_chunk,
            "created": self.created,
            "model": self.server.model_name,
            "choices": choices,
        }

    def first_chunk(self, index: int) -> dict | None:
        return None


class _ChatShape(_Shape):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"

    def first_chunk(self, index: int) -> dict:
        delta = {"role": "assistant", "content": ""}
        return self.envelope([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])

    def chunk(self, index: int, event: StreamEvent) -> dict:
        logprobs = self.server.chat_logprobs(event.logprobs) if event.logprobs else None
        finish = None if event.finish_reason is None else str(event.finish_reason)
        delta = {"content": event.text} if event.text else {}
        return self.envelope(
            [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
        )

    def choice(self, index: int, text: str, logprobs: list[TokenLogprobs], reason: FinishReason) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": self.server.chat_logprobs(logprobs) if logprobs else None,
            "finish_reason": str(reason),
        }


class _CompletionShape(_Shape):
    object_whole = object_chunk = "text_completion"

    def chunk(self, index: int, event: StreamEvent) -> dict:
        offset = self.text_offsets.get(index, 0)
        logprobs = self.server.completion_logprobs(event.logprobs, offset) if event.logprobs else None
        self.text_offsets[index] = offset + len(event.text)
        finish = None if event.finish_reason is None else str(event.finish_reason)
        return self.envelope(
            [{"index": index, "text": event.text, "logprobs": logprobs, "finish_reason": finish}]
        )

    def choice(self, index: int, text: str, logprobs: list[TokenLogprobs], reason: FinishReason) -> dict:
        return {
            "index": index,
            "text": text,
            "logprobs": self.server.completion_logprobs(logprobs, 0) if logprobs else None,
            "finish_reason": str(reason),
        }
