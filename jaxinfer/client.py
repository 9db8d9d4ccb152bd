"""A small Python client for the jaxinfer gRPC service, and `client_main` for `jaxinfer client "prompt"`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterator, Sequence

import grpc

from jaxinfer.proto.jaxinfer.v1 import inference_pb2 as pb
from jaxinfer.proto.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from jaxinfer.request import FinishReason

SAMPLING_FIELDS = tuple(pb.SamplingOptions.DESCRIPTOR.fields_by_name)
_FINISH_REASONS = {pb.FINISH_REASON_UNSPECIFIED: None} | {
    pb.FinishReason.Value(f"FINISH_REASON_{r.name}"): r for r in FinishReason
}
_MAP_FIELDS = ("mesh", "sampling_defaults")
API_KEY_ENV = "JAXINFER_API_KEY"


def api_key_or_env(given: str | None) -> str | None:
    """The API key a command was given, else $JAXINFER_API_KEY, else None (for servers and clients)."""
    return given or os.environ.get(API_KEY_ENV) or None


@dataclasses.dataclass(frozen=True)
class GenerateChunk:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None  # set on the last chunk only
    usage: dict | None  # set on the last chunk only: prompt_tokens, completion_tokens, ttft_s, ...
    # When asked for: per token (token id, log-probability, [(alternative id, log-probability), ...]).
    logprobs: tuple[tuple[int, float, tuple[tuple[int, float], ...]], ...] = ()


class GenerateStream:
    """An iterator of GenerateChunks; `cancel()` ends the request on the server (its slot is freed)."""

    def __init__(self, call):
        self._call = call
        self._chunks = self._read()

    def __iter__(self) -> Iterator[GenerateChunk]:
        return self

    def __next__(self) -> GenerateChunk:
        return next(self._chunks)

    def _read(self) -> Iterator[GenerateChunk]:
        for response in self._call:
            usage = None
            if response.HasField("usage"):
                u = response.usage
                usage = {f.name: getattr(u, f.name) for f in u.DESCRIPTOR.fields}
            yield GenerateChunk(
                text=response.text,
                token_ids=tuple(response.token_ids),
                finish_reason=_FINISH_REASONS[response.finish_reason],
                usage=usage,
                logprobs=tuple(
                    (lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
                    for lp in response.logprobs
                ),
            )

    def cancel(self) -> None:
        self._call.cancel()


class InferenceClient:
    """api_key: sent as `authorization: Bearer <key>` metadata; tls_ca: PEM file of the certificate
    authority to trust (or the server's self-signed certificate) for a TLS connection."""

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float | None = None,
        api_key: str | None = None,
        tls_ca: str | None = None,
    ):
        self.target = target
        self.timeout_s = timeout_s
        if tls_ca is not None:
            with open(tls_ca, "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
            self._channel = grpc.secure_channel(target, credentials)
        else:
            self._channel = grpc.insecure_channel(target)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._stub = pb_grpc.InferenceServiceStub(self._channel)

    def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        chat: Sequence[dict] | None = None,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        request_id: str = "",
        timeout_s: float | None = None,
        logprobs: int | None = None,
        json_schema: str | None = None,
        regex: str | None = None,
        **sampling,
    ) -> GenerateStream:
        """Streams a completion of `prompt` (text or token ids) or of `chat` ([{"role", "content"}]).

        sampling: any of SAMPLING_FIELDS (temperature, top_p, top_k, min_p, seed, penalties).
        logprobs: return each token's log-probability and this many alternatives'.
        json_schema (JSON text) / regex: the output must match it.
        """
        unknown = set(sampling) - set(SAMPLING_FIELDS)
        if unknown:
            raise ValueError(
                f"unknown sampling options {sorted(unknown)}; expected some of {SAMPLING_FIELDS}"
            )
        if (prompt is None) == (chat is None):
            raise ValueError("pass exactly one of prompt and chat")
        request = pb.GenerateRequest(
            sampling=pb.SamplingOptions(**{k: v for k, v in sampling.items() if v is not None}),
            stop=list(stop),
            stop_token_ids=list(stop_token_ids),
            ignore_eos=ignore_eos,
            request_id=request_id,
        )
        if max_tokens is not None:
            request.max_tokens = max_tokens
        if logprobs is not None:
            request.logprobs = logprobs
        if json_schema is not None:
            request.structured_output.json_schema = json_schema
        if regex is not None:
            request.structured_output.regex = regex
        if chat is not None:
            request.chat.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in chat)
        elif isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.extend(int(t) for t in prompt)
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        return GenerateStream(self._stub.Generate(request, timeout=timeout, metadata=self._metadata))

    def tokenize(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        request = pb.TokenizeRequest(text=text)
        if add_bos is not None:
            request.add_bos = add_bos
        return list(self._stub.Tokenize(request, timeout=self.timeout_s, metadata=self._metadata).token_ids)

    def detokenize(self, token_ids: Sequence[int], *, skip_special: bool = True) -> str:
        request = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special=skip_special)
        return self._stub.Detokenize(request, timeout=self.timeout_s, metadata=self._metadata).text

    def model_info(self) -> dict:
        info = self._stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=self.timeout_s, metadata=self._metadata
        )
        out = {f.name: getattr(info, f.name) for f in info.DESCRIPTOR.fields if f.name not in _MAP_FIELDS}
        return out | {name: dict(getattr(info, name)) for name in _MAP_FIELDS}

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def client_main(argv: Sequence[str] | None = None) -> int:
    """`jaxinfer client "prompt"`: streams the completion to stdout, usage to stderr. Returns exit status."""
    parser = argparse.ArgumentParser(prog="jaxinfer client", description="Stream a completion from a server.")
    parser.add_argument("prompt")
    parser.add_argument("--target", default="127.0.0.1:50051", help="host:port of the server")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    parser.add_argument("--json-schema", default=None, help="JSON Schema (JSON text) the output must follow")
    parser.add_argument("--api-key", default=None, help="default: $JAXINFER_API_KEY")
    parser.add_argument("--tls-ca", default=None, help="PEM certificate to trust: connect over TLS")
    args = parser.parse_args(argv)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
    sampling["json_schema"] = args.json_schema
    api_key = api_key_or_env(args.api_key)
    with InferenceClient(args.target, timeout_s=args.timeout, api_key=api_key, tls_ca=args.tls_ca) as client:
        if args.chat:
            stream = client.generate(
                chat=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens, **sampling
            )
        else:
            stream = client.generate(args.prompt, max_tokens=args.max_tokens, **sampling)
        try:
            for chunk in stream:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason is not None:
                    sys.stdout.write("\n")
                    u = chunk.usage or {}
                    print(
                        f"[{chunk.finish_reason}] prompt {u.get('prompt_tokens')} tokens, completion "
                        f"{u.get('completion_tokens')} tokens, ttft {u.get('ttft_s', 0):.3f} s, "
                        f"tpot {u.get('tpot_s', 0) * 1000:.1f} ms",
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            stream.cancel()
            return 130
    return 0
