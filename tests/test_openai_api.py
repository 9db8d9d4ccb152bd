"""The OpenAI-compatible HTTP API end to end: a real server on loopback (MockEngine + FakeTokenizer),
driven by the official `openai` client, curl and httpx; plus API keys and TLS on both front ends."""

from __future__ import annotations

import json
import ssl
import subprocess

import grpc
import httpx
import jsonschema
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxinfer.client import InferenceClient
from jaxinfer.orchestrator import Orchestrator
from jaxinfer.request import ModelDefaults, SamplingParams
from jaxinfer.service import TlsFiles, build_server
from jaxinfer.testing import FakeTokenizer, MockEngine, mock_logprob, wait_until

TOK = FakeTokenizer()
MODEL = "mock-model"
KEY = "sk-test-123"
INFO = {"model_name": MODEL, "architecture": "arithmetic", "dtype": "float32", "quantization": "none"}
# The model's "recommended" sampling: requests that leave temperature unset get 0.5.
DEFAULTS = ModelDefaults({"temperature": 0.5}, "test")


def start(*, api_key=KEY, tls=None, max_queue=64, step_delay_s=0.001, num_slots=4):
    engine = MockEngine(
        num_slots=num_slots, max_seq_len=256, max_prefill_chunk=8, vocab_size=TOK.vocab_size,
        step_delay_s=step_delay_s,
    )  # fmt: skip
    orchestrator = Orchestrator(engine, TOK, max_queue=max_queue)
    running = build_server(
        orchestrator, TOK, INFO, host="127.0.0.1", port=0, http_port=0, api_key=api_key, tls=tls,
        sampling_defaults=DEFAULTS,
    )  # fmt: skip
    return engine, running


@pytest.fixture(scope="module")
def server():
    engine, running = start()
    yield engine, running
    running.stop(1.0)


def client(running, key=KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{running.http_port}/v1", api_key=key, max_retries=0)


def expected_text(engine, prompt_ids, **sampling):
    s = SamplingParams(**sampling)
    s = SamplingParams(**{**s.__dict__, "stop_token_ids": TOK.eos_ids})
    tokens = engine.reference_tokens(prompt_ids, s)
    return tokens, TOK.decode(tokens)


def chat_ids(text):
    return TOK.encode_chat([{"role": "user", "content": text}])


def wait_idle(running, timeout_s=5.0):
    wait_until(lambda: running.orchestrator.stats()["num_live"] == 0, timeout_s)


def test_chat_completion_matches_the_engine_and_counts_usage(server):
    engine, running = server
    r = client(running).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, seed=3
    )
    tokens, text = expected_text(engine, chat_ids("hello"), seed=3, max_tokens=6)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.choices[0].finish_reason == ("stop" if len(tokens) < 6 else "length")
    assert r.usage.prompt_tokens == len(chat_ids("hello"))
    assert r.usage.completion_tokens == len(tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + len(tokens)
    wait_idle(running)


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(server):
    engine, running = server
    c = client(running)
    whole = c.completions.create(model=MODEL, prompt="the ", max_tokens=7, seed=5, temperature=0)
    chunks = list(
        c.completions.create(
            model=MODEL, prompt="the ", max_tokens=7, seed=5, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text == expected_text(engine, TOK.encode("the "), seed=5, max_tokens=7)[1]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_use_consecutive_seeds_and_equal_grpc_requests(server):
    engine, running = server
    r = client(running).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2, seed=7
    )
    texts = [ch.message.content for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert texts[0] != texts[1]
    with InferenceClient(f"127.0.0.1:{running.port}", api_key=KEY) as g:
        for i, text in enumerate(texts):
            chunks = list(g.generate(chat=[{"role": "user", "content": "hi"}], max_tokens=5, seed=7 + i))
            assert "".join(ch.text for ch in chunks) == text


def test_unset_sampling_fields_take_the_model_defaults(server):
    _, running = server
    card = client(running).models.list().data[0]
    assert card.id == MODEL and card.model_extra["sampling_defaults"]["values"] == {"temperature": 0.5}
    with InferenceClient(f"127.0.0.1:{running.port}", api_key=KEY) as g:
        info = g.model_info()
    assert info["sampling_defaults"] == {"temperature": 0.5} and info["sampling_defaults_source"] == "test"


def test_logprobs_of_chosen_and_top_tokens_in_both_apis(server):
    engine, running = server
    r = client(running).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=2,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    tokens, _ = expected_text(engine, chat_ids("hi"), seed=2, max_tokens=4)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([mock_logprob(t) for t in tokens])
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].top_logprobs[0].token == TOK.decode([tokens[0]], skip_special=False)
    completion = client(running).completions.create(
        model=MODEL, prompt="hi", max_tokens=3, seed=2, logprobs=2
    )
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    with InferenceClient(f"127.0.0.1:{running.port}", api_key=KEY) as g:
        chunks = list(g.generate(chat=[{"role": "user", "content": "hi"}], max_tokens=4, seed=2, logprobs=3))
    got = [lp for ch in chunks for lp in ch.logprobs]
    assert [t for t, _, _ in got] == tokens
    assert [v for _, v, _ in got] == pytest.approx([c.logprob for c in content])
    assert all(len(top) == 3 for _, _, top in got)


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}


def test_json_schema_response_parses_and_validates(server):
    _, running = server
    for seed in range(3):
        r = client(running).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "json please"}], max_tokens=40, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
        )  # fmt: skip
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
    r = client(running).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60, seed=1,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with InferenceClient(f"127.0.0.1:{running.port}", api_key=KEY) as g:
        chunks = list(g.generate("x", max_tokens=40, seed=4, json_schema=json.dumps(SCHEMA)))
    jsonschema.validate(json.loads("".join(ch.text for ch in chunks)), SCHEMA)
    wait_idle(running)


@pytest.mark.parametrize(
    "kwargs, error, param",
    [
        ({"temperature": -1}, openai.BadRequestError, "temperature"),
        ({"top_p": 1.5, "temperature": -2}, openai.BadRequestError, "temperature"),
        ({"n": 0}, openai.BadRequestError, "n"),
        ({"model": "other"}, openai.NotFoundError, "model"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
         openai.BadRequestError, "structured_output"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(server, kwargs, error, param):
    _, running = server
    args = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3} | kwargs
    with pytest.raises(error) as e:
        client(running).chat.completions.create(**args)
    assert e.value.body["param"] == param and e.value.body["message"]
    if "top_p" in kwargs:  # one message per mistake, all of them
        assert "top_p" in e.value.body["message"] and "temperature" in e.value.body["message"]


def test_wrong_or_missing_api_key_is_401_and_unauthenticated_but_health_stays_open(server):
    _, running = server
    with pytest.raises(openai.AuthenticationError) as e:
        client(running, key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    base = f"http://127.0.0.1:{running.http_port}"
    assert httpx.get(f"{base}/health").status_code == 200
    assert b"jaxinfer_requests" in httpx.get(f"{base}/metrics").content
    with InferenceClient(f"127.0.0.1:{running.port}", api_key="wrong") as g:
        with pytest.raises(grpc.RpcError) as e:
            list(g.generate("hi", max_tokens=2))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with InferenceClient(f"127.0.0.1:{running.port}") as g:
        with pytest.raises(grpc.RpcError) as e:
            g.model_info()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_curl_streams_sse_and_reports_errors(server):
    _, running = server
    url = f"http://127.0.0.1:{running.http_port}/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    out = subprocess.run(
        ["curl", "-sN", url, "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json",
         "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    events = [line[len("data: ") :] for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    bad = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", url, "-H", f"Authorization: Bearer {KEY}",
         "-d", json.dumps(body | {"temperature": "hot"})],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.rsplit("\n", 1)  # fmt: skip
    assert bad[1] == "400" and json.loads(bad[0])["error"]["param"] == "temperature"
    denied = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", url, "-H", "Authorization: Bearer wrong",
         "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.rsplit("\n", 1)  # fmt: skip
    assert denied[1] == "401" and json.loads(denied[0])["error"]["code"] == "invalid_api_key"
    # curl users often leave out "model": a one-model server reads that as its model.
    unnamed = {k: v for k, v in body.items() if k != "model"} | {"stream": False}
    reply = subprocess.run(
        ["curl", "-s", url, "-H", f"Authorization: Bearer {KEY}", "-d", json.dumps(unnamed)],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert json.loads(reply)["model"] == MODEL


def test_a_client_that_disconnects_frees_its_slot():
    # 200 steps of 50 ms: the stream outlives a disconnect noticed late on a loaded machine.
    _, running = start(step_delay_s=0.05)
    try:
        base = f"http://127.0.0.1:{running.http_port}/v1"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", f"{base}/completions", json=body, headers=headers) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    break
        # The slot frees when the scheduler ends the request; the stream thread counts it just after.
        wait_until(lambda: running.orchestrator.stats()["finished"]["cancelled"] == 1, timeout_s=15.0)
        stats = running.orchestrator.stats()
        assert stats["num_live"] == 0 and stats["num_free_slots"] == stats["num_slots"]
        # A non-streamed request whose client gives up is cancelled too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/completions", json=body | {"stream": False}, headers=headers, timeout=0.3)
        wait_until(lambda: running.orchestrator.stats()["finished"]["cancelled"] == 2, timeout_s=15.0)
        assert running.orchestrator.stats()["num_live"] == 0
    finally:
        running.stop(1.0)


def test_full_queue_is_429():
    _, running = start(max_queue=1, num_slots=1, step_delay_s=0.05)
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 50, "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        base = f"http://127.0.0.1:{running.http_port}/v1/completions"
        with (
            httpx.stream("POST", base, json=body, headers=headers),
            httpx.stream("POST", base, json=body, headers=headers),
        ):
            r = httpx.post(base, json=body, headers=headers)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    finally:
        running.stop(1.0)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
        check=True, capture_output=True,
    )  # fmt: skip
    return TlsFiles(d / "cert.pem", d / "key.pem")


def test_tls_serves_both_apis(certificate):
    engine, running = start(tls=certificate)
    try:
        http = httpx.Client(verify=ssl.create_default_context(cafile=str(certificate.cert)))
        c = openai.OpenAI(
            base_url=f"https://localhost:{running.http_port}/v1", api_key=KEY, http_client=http, max_retries=0
        )
        r = c.completions.create(model=MODEL, prompt="hi", max_tokens=3, seed=1)
        assert r.choices[0].text == expected_text(engine, TOK.encode("hi"), seed=1, max_tokens=3)[1]
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP is not served
            httpx.get(f"http://localhost:{running.http_port}/health")
        with InferenceClient(f"localhost:{running.port}", api_key=KEY, tls_ca=str(certificate.cert)) as g:
            assert "".join(ch.text for ch in g.generate("hi", max_tokens=3, seed=1)) == r.choices[0].text
    finally:
        running.stop(1.0)
