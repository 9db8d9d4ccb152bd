"""The gRPC front end: a thin `jaxinfer.v1.InferenceService` servicer over an Orchestrator.

Besides InferenceService the server runs the standard `grpc.health.v1.Health` service (SERVING while
up, NOT_SERVING once shutdown begins) and server reflection, so stock tools (grpcurl, grpc_health_probe)
work. Status codes:
  INVALID_ARGUMENT    a bad request; the message says which field and why
  FAILED_PRECONDITION a chat request for a model without a chat template
  RESOURCE_EXHAUSTED  the waiting queue (or the RPC limit) is full; returned at once, never queued
  UNAVAILABLE         the server is shutting down
A client cancel or an expired deadline ends the request in the scheduler at once; its slot is
released in the next engine step.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections.abc import Iterator, Mapping
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxinfer.orchestrator import NotAccepting, Orchestrator, QueueFull, StreamEvent
from jaxinfer.proto.jaxinfer.v1 import inference_pb2 as pb
from jaxinfer.proto.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from jaxinfer.request import SamplingParams

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
CHAT_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MAX_TOKENS = SamplingParams().max_tokens
_FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "cancelled": pb.FINISH_REASON_CANCELLED,
    "error": pb.FINISH_REASON_ERROR,
}
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
)


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


class InferenceServicer(pb_grpc.InferenceServiceServicer):
    def __init__(self, orchestrator: Orchestrator, tokenizer, model_info: pb.ModelInfo):
        self._orchestrator = orchestrator
        self._tokenizer = tokenizer
        self._model_info = model_info

    # ---- request conversion (ValueError -> INVALID_ARGUMENT) -----------------------------------------

    def _check_token_ids(self, ids, name: str) -> list[int]:
        vocab = self._tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab})")
        return list(ids)

    def _prompt_token_ids(self, request: pb.GenerateRequest) -> list[int]:
        given = [
            name
            for name, present in [
                ("prompt", bool(request.prompt)),
                ("prompt_token_ids", bool(request.prompt_token_ids)),
                ("chat", bool(request.chat)),
            ]
            if present
        ]
        if len(given) != 1:
            raise ValueError(
                "exactly one of prompt, prompt_token_ids and chat must be set and non-empty, got "
                + (", ".join(given) if given else "none (the prompt is empty)")
            )
        if request.prompt_token_ids:
            return self._check_token_ids(request.prompt_token_ids, "prompt_token_ids")
        if request.chat:
            for i, message in enumerate(request.chat):
                if message.role not in CHAT_ROLES:
                    raise ValueError(f"chat[{i}].role={message.role!r} is not one of {CHAT_ROLES}")
            if not self._tokenizer.has_chat_template:
                raise _FailedPrecondition("this model has no chat template; send a plain prompt")
            messages = [{"role": m.role, "content": m.content} for m in request.chat]
            return self._tokenizer.encode_chat(messages)
        add_bos = request.add_bos if request.HasField("add_bos") else None
        return self._tokenizer.encode(request.prompt, add_bos=add_bos)

    @staticmethod
    def _sampling_params(request: pb.GenerateRequest) -> SamplingParams:
        options = request.sampling
        kwargs = {name: getattr(options, name) for name in _SAMPLING_FIELDS if options.HasField(name)}
        max_tokens = request.max_tokens if request.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        sampling = SamplingParams(
            **kwargs,
            max_tokens=max_tokens,
            stop=tuple(request.stop),
            stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
        )
        sampling.validate()
        return sampling

    # ---- RPCs ----------------------------------------------------------------------------------------

    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateResponse]:
        try:
            prompt_token_ids = self._prompt_token_ids(request)
            sampling = self._sampling_params(request)
            handle = self._orchestrator.submit(prompt_token_ids, sampling, request.request_id or None)
        except _FailedPrecondition as e:
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
            ids = self._check_token_ids(request.token_ids, "token_ids")
            return pb.DetokenizeResponse(text=self._tokenizer.decode(ids, skip_special=skip_special))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        return self._model_info


class _FailedPrecondition(Exception):
    pass


def _response(event: StreamEvent, request_id: str) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        text=event.text,
        token_ids=event.token_ids,
        finish_reason=_FINISH_REASONS[event.finish_reason],
        request_id=request_id,
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


@dataclasses.dataclass
class RunningServer:
    """A started server. `stop()` is idempotent and safe from any thread; `wait()` blocks until stopped."""

    server: grpc.Server
    port: int
    orchestrator: Orchestrator
    health: health.HealthServicer
    metrics_port: int | None = None
    _metrics_http: object | None = None
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
    max_workers: int | None = None,
) -> RunningServer:
    """Starts the orchestrator (if needed), the gRPC server and optionally the /metrics HTTP endpoint.

    port=0 / metrics_port=0 pick free ports (see RunningServer.port / .metrics_port). Each streaming
    Generate holds a worker thread, so max_workers defaults to slots + queue + 16, and RPCs beyond it
    get RESOURCE_EXHAUSTED at once instead of waiting for a thread.
    """
    info = dict(model_info)
    info.setdefault("vocab_size", tokenizer.vocab_size)
    info.setdefault("num_slots", orchestrator.engine.num_slots)
    info.setdefault("context_length", orchestrator.engine.max_seq_len)
    info.setdefault("page_size", orchestrator.engine.page_size)
    info.setdefault("num_kv_pages", orchestrator.engine.num_pages - 1)  # less the null page
    info.setdefault("prefix_caching", orchestrator.enable_prefix_caching)
    info_proto = model_info_proto(info)
    if max_workers is None:
        max_workers = orchestrator.engine.num_slots + orchestrator.max_queue + 16
    if max_workers <= 0:
        raise ValueError(f"{max_workers=} must be > 0")

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="jaxinfer-grpc"),
        maximum_concurrent_rpcs=max_workers,
    )
    pb_grpc.add_InferenceServiceServicer_to_server(
        InferenceServicer(orchestrator, tokenizer, info_proto), server
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound_port = server.add_insecure_port(f"{host}:{port}")
    if bound_port == 0:
        raise OSError(f"could not bind the gRPC server to {host}:{port}")

    metrics_http, bound_metrics_port = None, None
    if metrics_port is not None:
        metrics_http, bound_metrics_port = orchestrator.metrics.serve_http(metrics_port, host)
    running = RunningServer(
        server=server,
        port=bound_port,
        orchestrator=orchestrator,
        health=health_servicer,
        metrics_port=bound_metrics_port,
        _metrics_http=metrics_http,
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
    log.info("jaxinfer serving on %s:%d (metrics port %s)", host, bound_port, bound_metrics_port)
    return running


def serve_forever(
    orchestrator: Orchestrator,
    tokenizer,
    model_info: Mapping[str, object],
    *,
    host: str = "0.0.0.0",
    port: int = 50051,
    metrics_port: int | None = None,
    grace_s: float = 10.0,
) -> int:
    """Serves until SIGTERM/SIGINT (graceful shutdown within grace_s) or a fatal error.

    Returns the process exit status: 0 after a signal, 1 after a fatal orchestrator error. Must be
    called from the main thread (signal handlers).
    """
    running = build_server(
        orchestrator, tokenizer, model_info, host=host, port=port, metrics_port=metrics_port
    )

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
