"""Clients that try to hurt the others, against one server with small limits: sockets that never
finish their headers, streams never read, a request that would take every place, prefix-cache
probes under other salts, and a web page's name sent as Host (DNS rebinding). The full-size load
runs are `benchmarks/hardened_edges.py`."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import aiohttp
import orjson
import pytest

from tests.conftest import Server, launch, wait_for

pytestmark = pytest.mark.slow  # two servers under hostile clients
HEADER_TIMEOUT_S = 1.0
CLIENT_CONNECTIONS = 20
PLACES = 64  # running + queued
RUNNING = 56  # the greedy client's request and twenty others at once
SHARE = PLACES // 2  # one client's, with one api worker
MOST_IN_ONE = 32  # completions in one request
KEYS = ("--api-key", "sk-victim", "--api-key", "sk-attacker")
SECRET = "Alice Smith's account number is 7731 and her PIN is 0042. " * 3


@pytest.fixture(scope="module")
def guarded(tiny_smol: Path, tmp_path_factory) -> Iterator[Server]:
    server = launch(
        tiny_smol,
        tmp_path_factory.mktemp("guarded") / "serve.log",
        *("--header-timeout", str(HEADER_TIMEOUT_S), "--max-client-connections", str(CLIENT_CONNECTIONS)),
        *("--max-stream-backlog", "64", "--max-request-sequences", str(MOST_IN_ONE)),
        *("--max-running-requests", str(RUNNING), "--max-queued-requests", str(PLACES - RUNNING), "--allowed-host", "my.example"),
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tenants(tiny_smol: Path, tmp_path_factory) -> Iterator[Server]:
    server = launch(tiny_smol, tmp_path_factory.mktemp("tenants") / "serve.log", *KEYS, "--cache-salt-by-key")
    yield server
    server.stop()


def _connect(server: Server, source: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5, source_address=(source, 0))
    return sock


def _slowloris(server: Server, source: str) -> socket.socket:
    sock = _connect(server, source)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
    return sock


def _completion(server: Server, key: str | None = None, **body) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        server.base_url + "/v1/completions",
        data=orjson.dumps({"model": server.model, "max_tokens": 2, **body}),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, orjson.loads(reply.read())
    except urllib.error.HTTPError as reply:
        return reply.code, orjson.loads(reply.read())


def test_sockets_that_never_finish_their_headers_are_capped_per_address_and_closed(guarded: Server) -> None:
    held = [_slowloris(guarded, "127.0.0.2") for _ in range(CLIENT_CONNECTIONS)]
    try:
        refused = _slowloris(guarded, "127.0.0.2")  # one more from the same address: a 503 at once, then closed
        refused.settimeout(5)
        answer = refused.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"--max-client-connections" in answer
        assert refused.recv(4096) == b""
        status, body = _completion(guarded, prompt="Hello")  # another address is served meanwhile
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        started = time.monotonic()
        for sock in held:  # the server closes each one that has not sent its headers by then
            sock.settimeout(HEADER_TIMEOUT_S + 5)
            assert sock.recv(4096) == b""
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 2
    finally:
        for sock in held:
            sock.close()


def _metric(server: Server, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    text = reply.partition(b"\r\n\r\n")[2].decode()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == name for s in f.samples if s.name.endswith("_total"))


def test_a_stream_whose_client_never_reads_is_cut_off_and_its_request_freed(guarded: Server) -> None:
    before = _metric(guarded, "ringllm:slow_client_aborts")
    body = orjson.dumps(
        {"model": guarded.model, "prompt": "Tell", "n": MOST_IN_ONE, "logprobs": 20, "max_tokens": 400, "ignore_eos": True, "stream": True}
    )
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window stays small
    sock.connect(("127.0.0.1", guarded.port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)  # and never read a byte
    try:
        wait_for(lambda: _metric(guarded, "ringllm:slow_client_aborts") > before, 60, "the unread stream to be cut off")
        wait_for(lambda: guarded.get("/server_info")["scheduler"]["running"] == 0, 10, "its choices to be freed")
        status, answer = _completion(guarded, prompt="Hello")
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
    finally:
        sock.close()


async def test_one_client_gets_its_share_and_twenty_others_are_served(guarded: Server) -> None:
    status, body = _completion(guarded, prompt=["a"] * 20, n=64)
    assert status == 400 and f"at most {MOST_IN_ONE}" in body["error"]["message"]
    long = {"model": guarded.model, "prompt": "Go", "n": MOST_IN_ONE, "max_tokens": 200, "ignore_eos": True}

    async def post(http: aiohttp.ClientSession, body: dict) -> int:
        async with http.post("/v1/completions", json=body) as reply:
            await reply.read()
            return reply.status

    greedy = aiohttp.ClientSession(guarded.base_url, connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0)))
    async with greedy:
        first = asyncio.create_task(post(greedy, long))
        await asyncio.to_thread(wait_for, lambda: guarded.get("/server_info")["scheduler"]["running"] > 0, 30, "the first to run")
        assert await post(greedy, long) == 503  # over its share while the server is half full
        others = []
        for i in range(20):
            http = aiohttp.ClientSession(guarded.base_url, connector=aiohttp.TCPConnector(local_addr=(f"127.0.1.{i + 1}", 0)))
            others.append((http, asyncio.create_task(post(http, {"model": guarded.model, "prompt": f"Hi {i}", "max_tokens": 2}))))
        try:
            assert [await task for _, task in others] == [200] * 20
        finally:
            for http, _ in others:
                await http.close()
        first.cancel()


def _cached(server: Server, prompt: str, salt: str | None, key: str | None = None) -> int:
    status, body = _completion(server, key, prompt=prompt, **({"cache_salt": salt} if salt else {}))
    assert status == 200, body
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cached_tokens_tell_no_salt_what_another_cached(guarded: Server) -> None:
    cached = partial(_cached, guarded)

    cached(SECRET + "Again: 7731", "victim")
    guesses = {pin: cached(SECRET + f"Again: {pin}", f"attacker-{pin}") for pin in ("1111", "7731", "9999")}
    assert set(guesses.values()) == {0}, guesses  # the right guess looks like the wrong ones
    assert cached(SECRET + "Again: 7731", None) == 0  # nor does the shared namespace see it
    assert cached(SECRET + "Again: 7731", "victim") > 0  # under its own salt, the cache works as before
    status, body = _completion(guarded, prompt="Hi", cache_salt="")
    assert status == 400 and body["error"]["param"] == "cache_salt"


def test_salted_by_key_no_tenant_sees_another_tenants_prefixes(tenants: Server) -> None:
    cached = partial(_cached, tenants)
    cached(SECRET + "Again: 7731", None, "sk-victim")
    guesses = {pin: cached(SECRET + f"Again: {pin}", None, "sk-attacker") for pin in ("1111", "7731", "9999")}
    assert guesses["1111"] == 0 and guesses["7731"] == guesses["9999"]  # later guesses hit the attacker's own first one alone
    assert cached(SECRET + "Again: 7731", "victim's own", "sk-attacker") == 0  # nor does naming a salt reach the victim's
    assert cached(SECRET + "Again: 7731", None, "sk-victim") > 0  # a tenant's own cache works as before
    with socket.create_connection(("127.0.0.1", tenants.port)) as sock:  # with a key, any Host: the key guards it
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: attacker.example\r\nAuthorization: Bearer sk-victim\r\nConnection: close\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("attacker.example", 403),
        ("attacker.example:80", 403),
        ("localhost:8000", 200),
        ("127.0.0.1", 200),
        ("[::1]:8000", 200),
        ("my.example", 200),
    ],
)
def test_without_a_key_only_local_and_allowed_host_names_are_served(guarded: Server, host: str, status: int) -> None:
    with socket.create_connection(("127.0.0.1", guarded.port)) as sock:
        sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        reply = sock.recv(65536)
    assert reply.startswith(f"HTTP/1.1 {status}".encode()), reply[:200]
    if status == 403:
        assert b"--allowed-host" in reply
