"""Shadow mode through real servers: a shadow whose sampling default differs (--override-generation-config)
diverges in exactly the requests that left that field to the server, and matches the rest, streamed or not,
seeded by the client or by the api worker; a shadow that cannot start leaves the live server serving; stopping
the live server stops its shadow, and nothing of either is left behind."""

from __future__ import annotations

import signal
import urllib.request
from pathlib import Path

import orjson
import psutil
import pytest

from actors.pipeline import ServeConfig
from runtime.kernels.cpu import build as cpu_kernels
from tests.conftest import Server, launch, log_events, wait_for
from transport.segment import list_segments, server_prefix

OVERRIDE = '{"temperature": 0.5}'


def shadow_counts(server: Server) -> dict[str, float]:
    """ringllm:shadow_requests_total by outcome, from /metrics."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    prefix = 'ringllm:shadow_requests_total{outcome="'
    return {line[len(prefix) :].partition('"')[0]: float(line.rpartition(" ")[2]) for line in lines if line.startswith(prefix)}


def send(server: Server, i: int, body: dict) -> None:
    """Request `shadow-i`, read to its end (a stream's every event)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    headers = {"Content-Type": "application/json", "X-Request-Id": f"shadow-{i}"}
    request = urllib.request.Request(server.base_url + path, data=orjson.dumps(body), headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200 and reply.read()


def bodies() -> list[tuple[dict, bool]]:
    """12 bodies, completions and chats, streamed and whole by turns, each with whether it leaves `temperature` to
    the server: greedy, sampled at its own temperature unseeded (the api worker's seed goes to the shadow too), and
    the server's temperature seeded and unseeded."""
    out = []
    for i in range(12):
        body: dict = {"prompt": f"Story {i}: once upon a time"} if i % 2 else {"messages": [{"role": "user", "content": f"Hello {i}"}]}
        body |= {"max_tokens": 12, "ignore_eos": True, "stream": i % 4 < 2}
        body |= [{"temperature": 0}, {"temperature": 0.8}, {"seed": i}, {}][i % 4 if i < 8 else (i + 2) % 4]
        out.append((body, "temperature" not in body))
    return out


def test_shadow_flags_may_not_set_where_it_listens_or_its_keys(tmp_path: Path) -> None:
    for flags in ("--port 9000", "--host=0.0.0.0", "--api-k secret", "--shadow-engine x", "--dtype 'unclosed"):
        with pytest.raises(ValueError, match="shadow_engine"):
            ServeConfig(model_dir=str(tmp_path), served_model_name="m", shadow_engine=flags)
    with pytest.raises(ValueError, match="shadow_fraction"):
        ServeConfig(model_dir=str(tmp_path), served_model_name="m", shadow_fraction=1.5)


@pytest.mark.slow
@pytest.mark.skipif(not cpu_kernels.available(), reason="deterministic inference on CPU needs ringllm's CPU kernels")
def test_a_shadow_diverges_where_a_default_changed_and_stops_with_its_server(tiny_smol: Path, tmp_path: Path) -> None:
    flags = f"--override-generation-config '{OVERRIDE}'"
    args = ("--enable-deterministic-inference", "--shadow-engine", flags, "--shadow-fraction", "1")
    server = launch(tiny_smol, tmp_path / "serve.log", *args)
    try:
        assert server.get("/server_info")["shadow"]["flags"] == flags
        wait_for(lambda: server.get("/server_info")["shadow"]["state"] == "ready", 180, "the shadow to be ready")
        shadow = wait_for(lambda: server.get("/server_info")["shadow"]["config"] and server.get("/server_info")["shadow"], 30, "its config")
        assert shadow["config"]["engine"]["override_generation_config"] == [["temperature", 0.5]]
        assert shadow["config"]["shadow_engine"] is None and shadow["config"]["host"] == "127.0.0.1"
        port = int(shadow["url"].rpartition(":")[2])
        pid = next(e["pid"] for e in log_events(server.log, "shadow_starting"))

        sent = bodies()
        for i, (body, _) in enumerate(sent):  # one at a time: no mirror is skipped for want of room
            send(server, i, body)
            wait_for(lambda i=i: sum(shadow_counts(server).values()) == i + 1, 60, f"request {i}'s mirror")
        left_out = {f"shadow-{i}" for i, (_, server_default) in enumerate(sent) if server_default}
        assert shadow_counts(server) == {"match": 12 - len(left_out), "diverged": len(left_out), "failed": 0, "skipped": 0}
        divergences = log_events(server.log, "shadow_divergence")
        assert {e["rid"] for e in divergences} == left_out and all(e["kind"] == "tokens" for e in divergences)
        assert all(e["live_tokens"] == e["shadow_tokens"] == 12 and e["live_token"] != e["shadow_token"] for e in divergences)
    finally:
        server.stop(signal.SIGTERM)
    assert not psutil.pid_exists(pid) and not list_segments(server_prefix(str(port)))


@pytest.mark.slow
def test_a_shadow_that_cannot_start_leaves_the_live_server_serving(tiny_smol: Path, tmp_path: Path) -> None:
    server = launch(tiny_smol, tmp_path / "serve.log", "--shadow-engine", "--max-running-requests none", "--shadow-fraction", "1")
    try:
        wait_for(lambda: server.get("/server_info")["shadow"]["state"] == "failed", 60, "the shadow to fail")
        (failed,) = log_events(server.log, "shadow_failed")
        assert failed["exitcode"] == 2 and "invalid int value" in failed["output"]
        send(server, 0, {"prompt": "hello", "max_tokens": 4})
        assert shadow_counts(server) == {"match": 0, "diverged": 0, "failed": 0, "skipped": 1}
    finally:
        server.stop(signal.SIGTERM)
