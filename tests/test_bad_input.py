"""Bad input over HTTP: every malformed or out-of-range request must get an OpenAI-style error.

Covered: broken JSON and bytes (truncated, garbage, quotes, NaN, BOM, depth, invalid UTF-8, lone
surrogates, a body that claims gzip, deflate or br), bodies that are not objects, the model field, chat messages
and content parts, completion prompts (types, token ids outside the vocabulary, over the context, by
their bytes alone), stop strings and stop ids past their bounds, more completions than the server can ever hold, max_tokens, every
sampling field on both endpoints, logprobs, stop, streaming flags, a body over 8 MiB, wrong methods
and routes. Each case must answer its 4xx status with a JSON body
{"error": {"message": non-empty str, "type": str, ...}}: a client's mistake must never surface as
a 5xx, a hang, a plain-text page, or an accepted request. Then all cases at once, after which the
server must still be up and answer a real question. POST bodies that are not sent as application/json
(text/plain, forms, multipart, no Content-Type: what a web page may send to another origin without
a CORS preflight) get a 415 on every POST route; a body that stalls mid-upload gets a 408 and its
connection closed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest

pytestmark = pytest.mark.slow  # every case goes through the session's SmolLM2 server

VOCAB, CONTEXT = 49152, 8192
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
DROP, MODEL = object(), object()  # a field to leave out; the served model's name
TIMEOUT = aiohttp.ClientTimeout(total=30)
BODY_TIMEOUT_S = 3  # smol_server's --body-timeout (tests/conftest.py)

Body = Callable[[str], bytes]  # the served model's name -> the request's bytes


def raw(data: bytes) -> Body:
    """Bytes as they are; '@MODEL' stands for the served model's name."""
    return lambda model: data.replace(b"@MODEL", model.encode())


def fields(base: dict[str, Any], over: dict[str, Any]) -> Body:
    body = {k: v for k, v in {"model": MODEL, **base, **over}.items() if v is not DROP}
    return lambda model: orjson.dumps({k: model if v is MODEL else v for k, v in body.items()})


def chat(**over: Any) -> Body:
    return fields({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, over)


def completion(**over: Any) -> Body:
    return fields({"prompt": "hi", "max_tokens": 4}, over)


def user(content: Any) -> Body:
    return chat(messages=[{"role": "user", "content": content}])


@dataclass(frozen=True)
class Case:
    id: str
    path: str
    body: Body = field(default=raw(b""), repr=False)
    status: int = 400
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


LONG_TEXT = " ".join(["word"] * 40_000)
OVER_8_MIB = b'{"model": "@MODEL", "prompt": "' + b"a" * (9 << 20) + b'"}'
FIVE_MIB = "a" * (5 << 20)  # under the body limit, over the context by its bytes alone: refused unencoded
ENDPOINTS = {"chat": (CHAT, chat), "completions": (COMPLETIONS, completion)}

# Fields both endpoints validate alike: (id, field, bad value).
SHARED: list[tuple[str, str, Any]] = [
    ("max_tokens-negative", "max_tokens", -1),
    ("max_tokens-zero", "max_tokens", 0),
    ("max_tokens-string", "max_tokens", "16"),
    ("max_tokens-float", "max_tokens", 1.5),
    ("max_tokens-bool", "max_tokens", True),
    ("max_tokens-huge", "max_tokens", 10**9),
    ("n-zero", "n", 0),
    ("n-negative", "n", -1),
    ("n-huge", "n", 1000),
    ("n-string", "n", "2"),
    ("temperature-negative", "temperature", -0.5),
    ("temperature-over-2", "temperature", 2.5),
    ("temperature-string", "temperature", "hot"),
    ("top_p-zero", "top_p", 0),
    ("top_p-over-1", "top_p", 1.5),
    ("top_k-minus-5", "top_k", -5),
    ("top_k-float", "top_k", 1.5),
    ("min_p-2", "min_p", 2),
    ("presence_penalty-5", "presence_penalty", 5),
    ("frequency_penalty-minus-3", "frequency_penalty", -3),
    ("repetition_penalty-zero", "repetition_penalty", 0),
    ("seed-string", "seed", "42"),
    ("seed-over-64-bits", "seed", 2**64 - 1),
    ("stop-number", "stop", 5),
    ("stop-list-with-number", "stop", ["a", 5]),
    ("stop-empty-string", "stop", [""]),
    ("stop-20-strings", "stop", [f"s{i}" for i in range(20)]),
    ("stop_token_ids-not-list", "stop_token_ids", 5),
    ("stop_token_ids-strings", "stop_token_ids", ["a"]),
    ("stop_token_ids-negative", "stop_token_ids", [2, -1]),
    ("stop_token_ids-vocab-size", "stop_token_ids", [VOCAB]),
    ("stop_token_ids-257", "stop_token_ids", list(range(257))),
    ("stop-257-chars", "stop", ["x" * 257]),
    ("stream-string", "stream", "yes"),
    ("stream_options-without-stream", "stream_options", {"include_usage": True}),
    ("ignore_eos-string", "ignore_eos", "yes"),
    ("model-wrong-type", "model", 5),
    ("prompt_logprobs-21", "prompt_logprobs", 21),
    # fields that would change the output and are not implemented: a 400, never a plain-text 200
    ("best_of-2", "best_of", 2),
    ("prompt_logprobs-string", "prompt_logprobs", "all"),
    ("tool_choice-required-without-tools", "tool_choice", "required"),
    # malformed constraints and template options (tests/test_structured_output.py has the well-formed)
    ("response_format-unknown-type", "response_format", {"type": "yaml"}),
    ("response_format-string", "response_format", "json"),
    ("regex-number", "regex", 5),
    ("guided_choice-empty", "guided_choice", []),
    ("guided_json-list", "guided_json", [1, 2]),
    ("tools-string", "tools", "get_weather"),
    ("tools-of-numbers", "tools", [1, 2]),
    ("chat_template_kwargs-list", "chat_template_kwargs", [1]),
    ("logit_bias-out-of-vocabulary", "logit_bias", {str(VOCAB): 5}),
    ("logit_bias-too-strong", "logit_bias", {"3": -150}),
    ("priority-under-fcfs", "priority", 1),  # this server schedules first come, first served
    ("priority-string", "priority", "high"),
    ("crash_at-without-fault-injection", "crash_at", 3),  # a test hook, refused unless RINGLLM_FAULT_INJECTION=1
    ("model-unknown", "model", "gpt-4o"),
]

CASES: list[Case] = [
    # Broken JSON and bytes.
    Case("json-truncated", CHAT, raw(b'{"model": "@MODEL", "messages": [')),
    Case("json-trailing-garbage", CHAT, raw(b'{"model": "@MODEL", "messages": [{"role": "user", "content": "hi"}]} xyz')),
    Case("json-single-quotes", COMPLETIONS, raw(b"{'model': '@MODEL', 'prompt': 'hi'}")),
    Case("json-empty-body-chat", CHAT),
    Case("json-empty-body-completions", COMPLETIONS),
    Case("json-nan", COMPLETIONS, raw(b'{"model": "@MODEL", "prompt": "hi", "temperature": NaN}')),
    Case("json-trailing-comma", COMPLETIONS, raw(b'{"model": "@MODEL", "prompt": "hi",}')),
    Case("json-bom", COMPLETIONS, raw(b'\xef\xbb\xbf{"model": "@MODEL", "prompt": "hi"}')),
    Case("json-nested-2000-deep", COMPLETIONS, raw(b'{"model": "@MODEL", "prompt": "hi", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}")),
    Case("utf8-invalid-in-model", CHAT, raw(b'{"model": "\xff\xfe"}')),
    Case("utf8-invalid-in-content", CHAT, raw(b'{"model": "@MODEL", "messages": [{"role": "user", "content": "caf\xc3"}]}')),
    Case("utf8-overlong-in-prompt", COMPLETIONS, raw(b'{"model": "@MODEL", "prompt": "\xc0\xaf"}')),
    Case("utf16-lone-surrogate", CHAT, raw(b'{"model": "@MODEL", "messages": [{"role": "user", "content": "\\ud800"}]}')),
    *(
        Case(f"{coding}-header-on-plain-bytes", COMPLETIONS, completion(), headers={"Content-Encoding": coding})
        for coding in ("gzip", "deflate", "br")
    ),
    # Not an object.
    Case("body-array", CHAT, raw(b'[{"model": "@MODEL"}]')),
    Case("body-string", CHAT, raw(b'"hello"')),
    Case("body-number", COMPLETIONS, raw(b"42")),
    Case("body-null", COMPLETIONS, raw(b"null")),
    # Chat messages.
    Case("messages-missing", CHAT, chat(messages=DROP)),
    Case("messages-empty", CHAT, chat(messages=[])),
    Case("messages-string", CHAT, chat(messages="hi")),
    Case("messages-object", CHAT, chat(messages={"role": "user"})),
    Case("message-not-object", CHAT, chat(messages=["hi"])),
    Case("message-without-role", CHAT, chat(messages=[{"content": "hi"}])),
    Case("message-unknown-role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}])),
    Case("message-role-number", CHAT, chat(messages=[{"role": 5, "content": "hi"}])),
    Case("message-role-list", CHAT, chat(messages=[{"role": ["user"], "content": "hi"}])),
    Case("message-role-object", CHAT, chat(messages=[{"role": {"name": "user"}, "content": "hi"}])),
    Case("content-number", CHAT, user(5)),
    Case("content-object", CHAT, user({"text": "hi"})),
    Case("content-null-for-user", CHAT, user(None)),
    Case("content-part-image_url", CHAT, user([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])),
    Case("content-part-without-text", CHAT, user([{"type": "text"}])),
    Case("content-over-context", CHAT, user(LONG_TEXT)),
    Case("messages-9000-empty", CHAT, chat(messages=[{"role": "user", "content": ""}] * 9000)),
    # Completion prompts.
    Case("prompt-missing", COMPLETIONS, completion(prompt=DROP)),
    Case("prompt-empty-list", COMPLETIONS, completion(prompt=[])),
    Case("prompt-empty-string", COMPLETIONS, completion(prompt="")),
    Case("prompt-number", COMPLETIONS, completion(prompt=5)),
    Case("prompt-object", COMPLETIONS, completion(prompt={"text": "hi"})),
    Case("prompt-mixed-str-int", COMPLETIONS, completion(prompt=["hi", 5])),
    Case("prompt-bools", COMPLETIONS, completion(prompt=[True, False])),
    Case("prompt-empty-token-list", COMPLETIONS, completion(prompt=[[]])),
    Case("token-id-vocab-size", COMPLETIONS, completion(prompt=[VOCAB])),
    Case("token-id-negative", COMPLETIONS, completion(prompt=[1, -1])),
    Case("token-id-over-int32", COMPLETIONS, completion(prompt=[2**31])),
    Case("token-id-out-of-vocab-n2", COMPLETIONS, completion(prompt=[[1, 2], [VOCAB + 7]], n=2)),
    Case("token-id-out-of-vocab-stream", COMPLETIONS, completion(prompt=[VOCAB], stream=True)),
    Case("prompt-9000-ids", COMPLETIONS, completion(prompt=[1] * 9000)),
    Case("prompt-40000-words", COMPLETIONS, completion(prompt=LONG_TEXT)),
    Case("prompt-4-million-spaces", COMPLETIONS, completion(prompt=" " * 4_000_000)),
    Case("prompt-plus-max_tokens-over-context", COMPLETIONS, completion(prompt=[1] * (CONTEXT - 192), max_tokens=500)),
    Case("prompt-5-MiB", COMPLETIONS, completion(prompt=FIVE_MIB)),
    Case("content-5-MiB", CHAT, user(FIVE_MIB)),
    Case("prompts-times-n-over-capacity", COMPLETIONS, completion(prompt=["hi"] * 21, n=64)),  # 1,344 > 256 running + 1,024 queued
    # max_tokens and logprobs, endpoint-specific.
    Case("max_completion_tokens-zero", CHAT, chat(max_completion_tokens=0)),
    Case("max_tokens-string-beside-max_completion_tokens", CHAT, chat(max_completion_tokens=2, max_tokens="abc")),
    Case("chat-logprobs-int", CHAT, chat(logprobs=5)),
    Case("chat-top_logprobs-without-logprobs", CHAT, chat(top_logprobs=3)),
    Case("chat-top_logprobs-50", CHAT, chat(logprobs=True, top_logprobs=50)),
    Case("completions-logprobs-100", COMPLETIONS, completion(logprobs=100)),
    Case("completions-logprobs-bool", COMPLETIONS, completion(logprobs=True)),
    Case("stream_options-include_usage-string", CHAT, chat(stream=True, stream_options={"include_usage": "yes"})),
    # Shared fields, on both endpoints.
    *(
        Case(f"{name}-{case_id}", path, make(**{key: value}), 404 if case_id == "model-unknown" else 400)
        for case_id, key, value in SHARED
        for name, (path, make) in ENDPOINTS.items()
    ),
    # HTTP.
    Case("body-over-8-MiB-chat", CHAT, raw(OVER_8_MIB), 413),
    Case("body-over-8-MiB-completions", COMPLETIONS, raw(OVER_8_MIB), 413),
    Case("GET-chat", CHAT, status=405, method="GET"),
    Case("GET-completions", COMPLETIONS, status=405, method="GET"),
    Case("PUT-chat", CHAT, chat(), 405, method="PUT"),
    Case("POST-models", "/v1/models", status=405),
    Case("DELETE-health", "/health", status=405, method="DELETE"),
    Case("GET-flush_cache", "/flush_cache", status=405, method="GET"),
    Case("POST-unknown-route", "/v1/chat/complete", chat(), 404),
    Case("GET-unknown-route", "/v2/models", status=404, method="GET"),
]


async def send(http: aiohttp.ClientSession, case: Case, model: str) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **case.headers}
    async with http.request(case.method, case.path, data=case.body(model), headers=headers) as reply:
        return reply.status, await reply.read()


def check(case: Case, status: int, data: bytes) -> None:
    shown = data[:300].decode(errors="replace")
    assert status == case.status, f"{case.id}: expected {case.status}, got {status}: {shown}"
    try:
        error = orjson.loads(data)["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise AssertionError(f"{case.id}: not an OpenAI error body: {shown}") from None
    assert isinstance(error.get("message"), str) and error["message"], f"{case.id}: {shown}"
    assert isinstance(error.get("type"), str), f"{case.id}: {shown}"


def test_the_table_is_sound() -> None:
    assert len(CASES) >= 45 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
async def test_bad_input_gets_an_openai_error(smol_server, case: Case) -> None:
    async with aiohttp.ClientSession(smol_server.base_url, timeout=TIMEOUT) as http:
        check(case, *await send(http, case, smol_server.model))


async def test_all_at_once_then_the_server_still_answers(smol_server) -> None:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(smol_server.base_url, timeout=TIMEOUT, connector=connector) as http:
        replies = await asyncio.gather(*(send(http, c, smol_server.model) for c in CASES), return_exceptions=True)
        async with http.get("/health") as reply:
            assert reply.status == 200, await reply.text()
        question = {
            "model": smol_server.model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 16,
        }
        async with http.post(CHAT, json=question) as reply:
            assert reply.status == 200, await reply.text()
            assert "Paris" in (await reply.json())["choices"][0]["message"]["content"]
    assert smol_server.proc.poll() is None
    wrong = {
        c.id: r if isinstance(r, BaseException) else (r[0], r[1][:200])
        for c, r in zip(CASES, replies)
        if isinstance(r, BaseException) or not 400 <= r[0] < 500
    }
    assert not wrong, f"{len(wrong)} of {len(CASES)} bad requests got no 4xx together: {wrong}"


async def test_integers_past_64_bits_are_named_as_such(smol_server) -> None:
    """orjson reads an integer literal past 64 bits as a float; the error names the size, not the type."""
    async with aiohttp.ClientSession(smol_server.base_url, timeout=TIMEOUT) as http:
        for name in ("seed", "max_tokens", "n", "top_k"):
            body = b'{"model": "%s", "prompt": "hi", "%s": %d}' % (smol_server.model.encode(), name.encode(), 2**70)
            async with http.post(COMPLETIONS, data=body, headers={"Content-Type": "application/json"}) as reply:
                error = (await reply.json())["error"]
                assert (reply.status, error["param"]) == (400, name), error
                assert "64 bits" in error["message"], error


async def test_a_request_id_that_is_not_utf8_is_replaced(smol_server) -> None:
    """Header bytes that are not UTF-8 reach the app as surrogates, which no log line or JSON body can
    carry: the request is served under an id of the server's own."""
    body = orjson.dumps({"model": smol_server.model, "prompt": "hi", "max_tokens": 2})
    reader, writer = await asyncio.open_connection("127.0.0.1", smol_server.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Request-Id: \xff\xfe\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    reply = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, answer = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), reply[:300]
    assert orjson.loads(answer)["id"].encode() in head  # the id it chose, echoed in X-Request-Id


# Every POST route, with a body it would take as JSON.
POSTS: dict[str, tuple[str, Body]] = {
    "chat": (CHAT, chat(max_tokens=2)),
    "completions": (COMPLETIONS, completion(max_tokens=2)),
    "flush_cache": ("/flush_cache", raw(b"{}")),
}


def sent_as(kind: str, body: bytes) -> dict[str, Any]:
    """aiohttp's arguments that POST `body` the way a web page may, cross-site, without a CORS preflight."""
    if kind == "text/plain":
        return {"data": body, "headers": {"Content-Type": "text/plain;charset=UTF-8"}}
    if kind == "form":
        return {"data": body, "headers": {"Content-Type": "application/x-www-form-urlencoded"}}
    if kind == "multipart":
        return {"data": aiohttp.FormData({"body": body.decode()}, default_to_multipart=True)}
    assert kind == "none"
    return {"data": body, "skip_auto_headers": ["Content-Type"]}  # else aiohttp says application/octet-stream


@pytest.mark.parametrize("kind", ["text/plain", "form", "multipart", "none"])
@pytest.mark.parametrize("route", list(POSTS))
async def test_a_post_not_sent_as_json_gets_415(smol_server, route: str, kind: str) -> None:
    path, make = POSTS[route]
    body = make(smol_server.model)
    async with aiohttp.ClientSession(smol_server.base_url, timeout=TIMEOUT) as http:
        async with http.post(path, **sent_as(kind, body)) as reply:
            status, data = reply.status, await reply.read()
        check(Case(f"{route}-{kind}", path, status=415), status, data)
        error = orjson.loads(data)["error"]
        assert error["type"] == "invalid_request_error" and {"param", "code"} <= error.keys(), error
        assert "application/json" in error["message"], error
        for content_type in ("application/json; charset=utf-8", "Application/JSON"):  # the same request, as JSON
            async with http.post(path, data=body, headers={"Content-Type": content_type}) as reply:
                assert reply.status == 200, (content_type, await reply.text())


async def test_a_body_that_stalls_gets_408_and_its_connection_closed(smol_server) -> None:
    """A client that sends its headers and part of its body, then nothing: the server answers 408 with
    OpenAI's error body once --body-timeout has passed and closes the connection (it was keep-alive)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", smol_server.port)
    started = time.monotonic()
    try:
        writer.write(
            b'POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model": "'
        )
        await writer.drain()
        try:
            reply = await asyncio.wait_for(reader.read(), BODY_TIMEOUT_S + 5)  # read() returns once the server closes
        except TimeoutError:
            pytest.fail(f"no answer and no close {BODY_TIMEOUT_S + 5} s after a body stalled")
    finally:
        writer.close()
    took = time.monotonic() - started
    head, _, answer = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:300]
    error = orjson.loads(answer)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "timeout" and error["message"], error
    assert BODY_TIMEOUT_S - 0.5 < took < BODY_TIMEOUT_S + 5, took
    async with aiohttp.ClientSession(smol_server.base_url, timeout=TIMEOUT) as http:
        async with http.post(COMPLETIONS, json={"model": smol_server.model, "prompt": "hi", "max_tokens": 2}) as reply:
            assert reply.status == 200, await reply.text()
        async with http.get("/health") as reply:
            assert reply.status == 200, await reply.text()


async def test_a_request_without_model_is_for_the_served_model(smol_server) -> None:
    async with aiohttp.ClientSession(smol_server.base_url, timeout=TIMEOUT) as http:
        async with http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}) as reply:
            answer = await reply.json()
    assert reply.status == 200 and answer["model"] == smol_server.model, answer
