"""The serving front ends over one Orchestrator: the gRPC `jaxinfer.v1.InferenceService`, and the
OpenAI-compatible HTTP API (openai_api.py) in the same process when an HTTP port is given.

Besides InferenceService the gRPC server runs the standard `grpc.health.v1.Health` service (SERVING
while up, NOT_SERVING once shutdown begins) and server reflection, so stock tools (grpcurl,
grpc_health_probe) work. Status codes:
  INVALID_ARGUMENT    a bad request; the message says which field and why (request.py)
  FAILED_PRECONDITION a chat request for a model without a chat template
  RESOURCE_EXHAUSTED  the waiting queue (or the RPC limit) is full; returned at once, never queued
  UNAVAILABLE         the server is shutting down
  UNAUTHENTICATED     an API key is set and the call's `authorization: Bearer <key>` metadata is not it
A client cancel or an expired deadline ends the request in the scheduler at once; its slot is
released in the next engine step. Health and reflection need no key.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import signal
import threading
from collections.abc import Iterator, Mapping
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxinfer.orchestrator import NotAccepting, Orchestrator, QueueFull, StreamEvent
from jaxinfer.proto.jaxinfer.v1 import inference_pb2 as pb
from jaxinfer.proto.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from jaxinfer.request import (
    FinishReason,
    ModelDefaults,
    NoChatTemplate,
    StructuredKind,
    StructuredOutput,
    check_token_ids,
    encode_prompt,
    parse_sampling,
)

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
FINISH_REASON_PROTO = {None: pb.FINISH_REASON_UNSPECIFIED} | {
    r: pb.FinishReason.Value(f"FINISH_REASON_{r.name}") for r in FinishReason
}


def model_info_proto(model_info: Mapping[str, object]) -> pb.ModelInfo:
    """Builds ModelInfo from a dict with the proto's field names (mesh: {axis name: size})."""
    fields = set(pb.ModelInfo.DESCRIPTOR.fields_by_name)
    unknown = set(model_info) - fields
    if unknown:
        raise ValueError(f"unknown model_info keys {sorted(unknown)}; expected some of {sorted(fields)}")
    info = dict(model_info)
    mesh = info.pop("mesh", None) or {}
    proto = pb.ModelInfo(**info)
    proto.mesh.update({str(k): int(v) for k, v in dict(mesh).items()})
    return proto


def _optional(message, names) -> dict:
    return {name: getattr(message, name) for name in names if message.HasField(name)}


def _structured_output(request: pb.GenerateRequest) -> StructuredOutput | None:
    kind = request.structured_output.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return StructuredOutput(StructuredKind.JSON_OBJECT)
    return StructuredOutput(StructuredKind(kind), getattr(request.structured_output, kind))


def sampling_fields(request: pb.GenerateRequest) -> dict:
    """The request's sampling fields by request.py's names (only those set)."""
    options = pb.SamplingOptions.DESCRIPTOR.fields_by_name
    return (
        _optional(request.sampling, options)
        | _optional(request, ("max_tokens", "logprobs"))
        | {
            "stop": list(request.stop) or None,
            "stop_token_ids": list(request.stop_token_ids) or None,
            "ignore_eos": request.ignore_eos or None,
            "structured_output": _structured_output(request),
        }
    )


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(
        self, orchestrator: Orchestrator, tokenizer, model_info: pb.ModelInfo, defaults: ModelDefaults
    ):
        self._orchestrator = orchestrator
        self._tokenizer = tokenizer
        self._model_info = model_info
        self._defaults = defaults

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        try:
            prompt_token_ids = encode_prompt(
                self._tokenizer,
                prompt=request.prompt or None,
                prompt_token_ids=list(request.prompt_token_ids) or None,
                messages=[{"role": m.role, "content": m.content} for m in request.chat] or None,
                add_bos=request.add_bos if request.HasField("add_bos") else None,
                messages_name="chat",
            )
            sampling = parse_sampling(sampling_fields(request), defaults=self._defaults)
            handle = self._orchestrator.submit(prompt_token_ids, sampling, request.request_id or None)
        except NoChatTemplate as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except NotAccepting as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        # Runs when the RPC ends for any reason: client cancel and deadline free the slot; after a
        # normal finish it is a no-op.
        if not context.add_callback(handle.cancel):
            handle.cancel()
        for event in handle:
            yield _response(event, handle.request_id)

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        add_bos = request.add_bos if request.HasField("add_bos") else None
        try:
            return pb.TokenizeResponse(token_ids=self._tokenizer.encode(request.text, add_bos=add_bos))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.ServicerContext
    ) -> pb.DetokenizeResponse:
        skip_special = request.skip_special if request.HasField("skip_special") else True
        try:
            ids = list(request.token_ids)
            check_token_ids(ids, self._tokenizer.vocab_size, "token_ids")
            return pb.DetokenizeResponse(text=self._tokenizer.decode(ids, skip_special=skip_special))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        return self._model_info


def _response(event: StreamEvent, request_id: str) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        text=event.text,
        token_ids=event.token_ids,
        finish_reason=FINISH_REASON_PROTO[event.finish_reason],
        request_id=request_id,
        logprobs=[
            pb.TokenLogprobs(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            )
            for lp in event.logprobs
        ],
    )
    if event.usage is not None:
        u = event.usage
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                ttft_s=u.ttft_s or 0.0,
                tpot_s=u.tpot_s or 0.0,
                queue_time_s=u.queue_time_s or 0.0,
                e2e_s=u.e2e_s,
            )
        )
    return response


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files of the server's certificate (chain) and private key, for gRPC and HTTP alike."""

    cert: Path
    key: Path

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())])


class _ApiKeyInterceptor(grpc.ServerInterceptor):
    """InferenceService calls need `authorization: Bearer <key>`; health and reflection do not."""

    def __init__(self, api_key: str):
        self._expected = f"Bearer {api_key}".encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or incorrect API key")

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream
            else grpc.unary_unary_rpc_method_handler
        )
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)  # fmt: skip


class _HttpServer:
    """uvicorn serving the OpenAI API on its own thread and event loop."""

    def __init__(self, app, host: str, port: int, tls: TlsFiles | None):
        import socket

        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port = self._socket.getsockname()[1]
        tls_args = {} if tls is None else {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)}
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=1, **tls_args
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="jaxinfer-http", daemon=True
        )
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            self._thread.join(0.01)
        if not self._server.started:
            raise OSError(f"the HTTP server did not start on {host}:{port}")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(5.0)
        self._socket.close()


@dataclasses.dataclass
class RunningServer:
    """A started server. `stop()` is idempotent and safe from any thread; `wait()` blocks until stopped."""

    server: grpc.Server
    port: int
    orchestrator: Orchestrator
    health: health.HealthServicer
    metrics_port: int | None = None
    http_port: int | None = None
    _metrics_http: object | None = None
    _http: _HttpServer | None = None
    _stopped: threading.Event = dataclasses.field(default_factory=threading.Event)
    _stop_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _stopping: bool = False

    @property
    def failed(self) -> bool:
        return self.orchestrator.failure is not None

    def stop(self, grace_s: float = 5.0) -> None:
        """Graceful shutdown: NOT_SERVING, stop admitting, finish or cancel in-flight within grace_s."""
        with self._stop_lock:
            if self._stopping:
                self._stopped.wait()
                return
            self._stopping = True
        log.info("jaxinfer server on port %d stopping (grace %.1f s)", self.port, grace_s)
        self.health.enter_graceful_shutdown()
        try:
            self.orchestrator.stop(grace_s)  # every stream gets its last event here
        finally:
            self.server.stop(grace=1.0).wait()
            if self._http is not None:
                self._http.stop()
            if self._metrics_http is not None:
                self._metrics_http.shutdown()
                self._metrics_http.server_close()
            self._stopped.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until the server has stopped; returns False on timeout."""
        return self._stopped.wait(timeout_s)


def build_server(
    orchestrator: Orchestrator,
    tokenizer,
    model_info: Mapping[str, object],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int | None = None,
    http_port: int | None = None,
    api_key: str | None = None,
    tls: TlsFiles | None = None,
    sampling_defaults: ModelDefaults | None = None,
    max_workers: int | None = None,
) -> RunningServer:
    """Starts the orchestrator (if needed), the gRPC server, optionally the OpenAI HTTP API on
    http_port and the Prometheus /metrics endpoint on metrics_port.

    port=0 / http_port=0 / metrics_port=0 pick free ports (see RunningServer). api_key guards both
    APIs; tls serves both over TLS. Each streaming Generate holds a worker thread, so max_workers
    defaults to slots + queue + 16, and RPCs beyond it get RESOURCE_EXHAUSTED at once instead of
    waiting for a thread. HTTP streams hold no thread.
    """
    defaults = sampling_defaults or ModelDefaults()
    info = dict(model_info)
    info.setdefault("vocab_size", tokenizer.vocab_size)
    info.setdefault("num_slots", orchestrator.engine.num_slots)
    info.setdefault("context_length", orchestrator.engine.max_seq_len)
    info.setdefault("page_size", orchestrator.engine.page_size)
    info.setdefault("num_kv_pages", orchestrator.engine.num_pages - 1)  # less the null page
    info.setdefault("prefix_caching", orchestrator.enable_prefix_caching)
    info.setdefault("sampling_defaults", dict(defaults.values))
    info.setdefault("sampling_defaults_source", defaults.source)
    info_proto = model_info_proto(info)
    if max_workers is None:
        max_workers = orchestrator.engine.num_slots + orchestrator.max_queue + 16
    if max_workers <= 0:
        raise ValueError(f"{max_workers=} must be > 0")

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="jaxinfer-grpc"),
        maximum_concurrent_rpcs=max_workers,
        interceptors=[_ApiKeyInterceptor(api_key)] if api_key else None,
    )
    pb_grpc.add_InferenceServiceServicer_to_server(
        InferenceServicer(orchestrator, tokenizer, info_proto, defaults), server
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    bound_port = (
        server.add_secure_port(address, tls.grpc_credentials()) if tls else server.add_insecure_port(address)
    )
    if bound_port == 0:
        raise OSError(f"could not bind the gRPC server to {host}:{port}")

    http = None
    if http_port is not None:
        from jaxinfer.openai_api import OpenAIServer, build_app

        api = OpenAIServer(
            orchestrator, tokenizer, model_name=info_proto.model_name,
            context_length=info_proto.context_length, defaults=defaults,
        )  # fmt: skip
        http = _HttpServer(build_app(api, api_key=api_key), host, http_port, tls)
    metrics_http, bound_metrics_port = None, None
    if metrics_port is not None:
        metrics_http, bound_metrics_port = orchestrator.metrics.serve_http(metrics_port, host)
    running = RunningServer(
        server=server,
        port=bound_port,
        orchestrator=orchestrator,
        health=health_servicer,
        metrics_port=bound_metrics_port,
        http_port=http.port if http else None,
        _metrics_http=metrics_http,
        _http=http,
    )

    def on_fatal(exc: BaseException) -> None:
        # Called on an orchestrator thread, which stop() joins: shut down from a fresh thread.
        health_servicer.enter_graceful_shutdown()
        threading.Thread(target=running.stop, args=(0.0,), name="jaxinfer-fatal-stop", daemon=True).start()

    orchestrator.on_fatal = on_fatal
    if not orchestrator.started:
        orchestrator.start()
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "jaxinfer serving on %s:%d (gRPC; HTTP port %s, metrics port %s, TLS %s, API key %s)",
        host, bound_port, running.http_port, bound_metrics_port,
        "on" if tls else "off", "set" if api_key else "none",
    )  # fmt: skip
    return running


def serve_forever(
    orchestrator: Orchestrator,
    tokenizer,
    model_info: Mapping[str, object],
    *,
    grace_s: float = 10.0,
    **server_args,
) -> int:
    """Serves (build_server's arguments) until SIGTERM/SIGINT (graceful shutdown within grace_s) or a
    fatal error.

    Returns the process exit status: 0 after a signal, 1 after a fatal orchestrator error. Must be
    called from the main thread (signal handlers).
    """
    running = build_server(orchestrator, tokenizer, model_info, **server_args)

    def handle_signal(signum, frame) -> None:
        log.info("received signal %d; shutting down", signum)
        threading.Thread(
            target=running.stop, args=(grace_s,), name="jaxinfer-signal-stop", daemon=True
        ).start()

    previous = {sig: signal.signal(sig, handle_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not running.wait(0.5):  # a timed wait keeps the main thread responsive to signals
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if running.failed else 0
