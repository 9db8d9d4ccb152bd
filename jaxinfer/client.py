"""A small Python client for the jaxinfer gRPC service, and `client_main` for `jaxinfer client "prompt"`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator, Sequence

import grpc

from jaxinfer.proto.jaxinfer.v1 import inference_pb2 as pb
from jaxinfer.proto.jaxinfer.v1 import inference_pb2_grpc as pb_grpc

SAMPLING_FIELDS = tuple(pb.SamplingOptions.DESCRIPTOR.fields_by_name)
_FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}


@dataclasses.dataclass(frozen=True)
class GenerateChunk:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # set on the last chunk only
    usage: dict | None  # set on the last chunk only: prompt_tokens, completion_tokens, ttft_s, ...


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
            )

    def cancel(self) -> None:
        self._call.cancel()


class InferenceClient:
    def __init__(self, target: str, *, timeout_s: float | None = None):
        self.target = target
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(target)
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
        **sampling,
    ) -> GenerateStream:
        """Streams a completion of `prompt` (text or token ids) or of `chat` ([{"role", "content"}]).

        sampling: any of temperature, top_p, top_k, min_p, seed, repetition_penalty, presence_penalty.
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
        if chat is not None:
            request.chat.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in chat)
        elif isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.prompt_token_ids.extend(int(t) for t in prompt)
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        return GenerateStream(self._stub.Generate(request, timeout=timeout))

    def tokenize(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        request = pb.TokenizeRequest(text=text)
        if add_bos is not None:
            request.add_bos = add_bos
        return list(self._stub.Tokenize(request, timeout=self.timeout_s).token_ids)

    def detokenize(self, token_ids: Sequence[int], *, skip_special: bool = True) -> str:
        request = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special=skip_special)
        return self._stub.Detokenize(request, timeout=self.timeout_s).text

    def model_info(self) -> dict:
        info = self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout_s)
        out = {f.name: getattr(info, f.name) for f in info.DESCRIPTOR.fields if f.name != "mesh"}
        out["mesh"] = dict(info.mesh)
        return out

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
    args = parser.parse_args(argv)
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed}
    with InferenceClient(args.target, timeout_s=args.timeout) as client:
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
