"""Property-based fuzzing of the HTTP API: over a thousand generated requests, malformed or at the
edges, and never a 5xx; every refusal is an OpenAI error body; the server answers afterwards."""

from __future__ import annotations

import http.client
import json

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import launch, ringllm, with_tokenizer

pytestmark = pytest.mark.slow  # a server under a fuzzer's requests

CASES = 1200

scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=24)
anything = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12
)
small_ints = st.integers(-3, 4)  # valid counts stay tiny, so that accepted requests finish fast
roles = st.sampled_from(["system", "user", "assistant", "developer", "tool", "robot", ""])
messages = (
    st.lists(
        st.fixed_dictionaries({"role": roles | anything}, optional={"content": st.text(max_size=40) | anything, "name": anything}),
        max_size=3,
    )
    | anything
)
FIELDS = {
    "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 60_000), max_size=8) | st.lists(st.text(max_size=8), max_size=3) | anything,
    "messages": messages,
    "max_tokens": small_ints | st.text(max_size=4) | st.floats(allow_nan=False) | st.booleans() | st.lists(small_ints, max_size=2),
    "max_completion_tokens": small_ints | anything.filter(lambda v: v is not None),
    "temperature": st.floats(-1, 3, allow_nan=False) | anything,
    "top_p": st.floats(-0.5, 1.5, allow_nan=False) | anything,
    "top_k": small_ints | anything,
    "min_p": st.floats(-0.5, 1.5, allow_nan=False) | anything,
    "n": st.integers(-2, 70) | anything,
    "stream": st.booleans() | anything,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | anything}) | anything,
    "stop": st.text(max_size=6) | st.lists(st.text(max_size=6), max_size=20) | anything,
    "stop_token_ids": st.lists(st.integers(-3, 60_000), max_size=4) | anything,
    "logprobs": st.booleans() | small_ints | anything,
    "top_logprobs": st.integers(-2, 25) | anything,
    "seed": st.integers(-(2**64), 2**64) | anything,
    "presence_penalty": st.floats(-3, 3, allow_nan=False) | anything,
    "frequency_penalty": st.floats(-3, 3, allow_nan=False) | anything,
    "repetition_penalty": st.floats(-1, 3, allow_nan=False) | anything,
    "ignore_eos": st.booleans() | anything,
    "return_token_ids": st.booleans() | anything,
    "skip_special_tokens": st.booleans() | anything,
    "echo": st.booleans() | anything,
    "best_of": small_ints | anything,
    "logit_bias": st.dictionaries(st.text(max_size=5), st.integers(-100, 100), max_size=2) | anything,
    "tools": anything,
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | anything,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])}) | anything,
    "regex": st.text(max_size=8) | anything,
    "guided_choice": st.lists(st.text(max_size=4), max_size=3) | anything,
    "chat_template_kwargs": anything,
    "user": anything,
}


@st.composite
def requests(draw, model: str) -> tuple[str, str, dict[str, str], bytes]:
    path = draw(st.sampled_from(["/v1/chat/completions"] * 4 + ["/v1/completions"] * 4 + ["/v1/models", "/v1/nope", "/version"]))
    optional = {name: strategy for name, strategy in FIELDS.items() if name != "max_tokens"}
    body = draw(
        st.fixed_dictionaries(
            {"max_tokens": FIELDS["max_tokens"]}, optional={"model": st.sampled_from([model, "gpt-4", ""]) | anything, **optional}
        )
    )
    if draw(st.booleans()):
        body["model"] = model
    payload = json.dumps(body, ensure_ascii=False).encode()  # json: orjson refuses integers beyond 64 bits
    damage = draw(st.sampled_from(["none", "none", "none", "utf8", "truncate", "garbage", "array"]))
    if damage == "utf8":
        cut = draw(st.integers(0, len(payload)))
        payload = payload[:cut] + b"\xff\xfe" + payload[cut:]
    elif damage == "truncate":
        payload = payload[: draw(st.integers(0, len(payload)))]
    elif damage == "garbage":
        payload = draw(st.binary(max_size=64))
    elif damage == "array":
        payload = b"[" + payload + b"]"
    kinds = ["application/json"] * 6 + ["application/json; charset=utf-8", "text/plain", "application/x-www-form-urlencoded"]
    headers = {"Content-Type": draw(st.sampled_from(kinds))}  # most bodies must get past the 415 to reach the parser
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT"] if path.endswith("completions") else ["GET", "POST"]))
    return method, path, headers, payload


@pytest.fixture(scope="module")
def fuzz_server(tiny_model, smollm2, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    server = launch(with_tokenizer(tiny_model("qwen2"), smollm2, folder / "model"), folder / "serve.log", "--api-workers", "2")
    yield server
    assert server.stop() < 5


def test_fuzzed_requests_never_get_a_5xx(fuzz_server):
    seen: dict[int, int] = {}
    connection = http.client.HTTPConnection("127.0.0.1", fuzz_server.port, timeout=60)

    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(requests(fuzz_server.model))
    def one(case) -> None:
        nonlocal connection
        method, path, headers, payload = case
        try:
            connection.request(method, path, body=payload, headers=headers)
            reply = connection.getresponse()
            status, body = reply.status, reply.read()
        except (http.client.HTTPException, ConnectionError):  # the server closed a keep-alive connection
            connection.close()
            connection = http.client.HTTPConnection("127.0.0.1", fuzz_server.port, timeout=60)
            seen["closed"] = seen.get("closed", 0) + 1
            return
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (case, body[:500])
        if status >= 400:
            assert "message" in orjson.loads(body)["error"], body[:300]

    one()
    connection.close()
    closed = seen.pop("closed", 0)
    print(f"fuzz: {sum(seen.values())} requests answered, by status {dict(sorted(seen.items()))}; {closed} connections closed")
    assert sum(seen.values()) >= 1000
    assert fuzz_server.get("/health")["status"] == "ok"
    rows = orjson.loads(ringllm("status", "--json", "--port", str(fuzz_server.port)).stdout)
    assert all(row["restarts"] == 0 for row in rows), rows  # no actor, api workers included, died on the way
