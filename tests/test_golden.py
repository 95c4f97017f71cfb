"""Golden traces through the real `ringllm golden` command line against real deterministic servers: a trace
recorded from a server replays on it without a divergence, and on a server whose sampling default differs
(--override-generation-config) it diverges in exactly the requests that left that field to the server."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from benchmarks.golden import Divergence, compare
from runtime.kernels.cpu import build as cpu_kernels
from tests.conftest import launch, ringllm, wait_for

OVERRIDE = '{"temperature": 0.5}'


def bodies() -> list[dict]:
    """50 bodies, completions and chats by turns: greedy, seeded at a temperature of their own, and seeded at the
    server's temperature (every third from the third on, which leave it out)."""
    out = []
    for i in range(50):
        body: dict = {"prompt": f"Story {i}: once upon a time"} if i % 2 else {"messages": [{"role": "user", "content": f"Hello {i}"}]}
        body |= {"max_tokens": 12, "ignore_eos": True}
        if i % 3 == 0:
            body["temperature"] = 0
        elif i % 3 == 1:
            body |= {"temperature": 0.8, "seed": i}
        else:
            body["seed"] = i
        out.append(body)
    return out


def test_compare_names_each_choices_first_divergence() -> None:
    """Tokens first (where a stream ends counts), then logprobs past the tolerance, then the finish reason."""

    def choice(ids: list[int], logprobs: list[float], finish: str = "length") -> dict:
        return {"token_ids": ids, "logprobs": logprobs, "finish_reason": finish}

    was = choice([1, 2, 3], [-1.0, -2.0, -3.0])
    assert compare(4, [was], [was], 0.0) == []
    assert compare(4, [was], [choice([1, 5, 3], [-1.0, -2.5, -3.0])], 0.0) == [Divergence(4, 0, "tokens", 1, 2, 5, -0.5)]
    assert compare(4, [was], [choice([1, 2], [-1.0, -2.0], "stop")], 0.0) == [Divergence(4, 0, "tokens", 2, 3, None, None)]
    drift = choice([1, 2, 3], [-1.0, -2.0001, -3.01])
    assert compare(4, [was], [drift], 1e-3) == [Divergence(4, 0, "logprobs", 2, 3, 3, pytest.approx(0.01))]
    assert compare(4, [was], [drift], 0.1) == []
    assert [d.kind for d in compare(4, [was, was], [was, choice([1, 2, 3], [-1.0, -2.0, -3.0], "stop")], 0.0)] == ["finish"]
    assert [d.kind for d in compare(4, [was], [was, was], 0.0)] == ["choices"]


@pytest.mark.slow
@pytest.mark.skipif(not cpu_kernels.available(), reason="deterministic inference on CPU needs ringllm's CPU kernels")
def test_a_trace_replays_exactly_and_diverges_where_a_default_changed(tiny_smol: Path, tmp_path: Path) -> None:
    served = launch(tiny_smol, tmp_path / "a.log", "--enable-deterministic-inference", ready=False)
    changed = launch(
        tiny_smol, tmp_path / "b.log", "--enable-deterministic-inference", "--override-generation-config", OVERRIDE, ready=False
    )
    try:
        for server in (served, changed):
            wait_for(lambda s=server: s.proc.poll() is not None or b'"topology_ready"' in s.log.read_bytes(), 180, "the servers")
            assert server.proc.poll() is None, server.log.read_text()[-3000:]
        sent = bodies()
        prompts, golden = tmp_path / "bodies.jsonl", tmp_path / "golden.jsonl"
        prompts.write_bytes(b"".join(orjson.dumps(body) + b"\n" for body in sent))

        recorded = ringllm("golden", "record", "--url", served.base_url, "--prompts", str(prompts), "--out", str(golden))
        assert "warning" not in recorded.stderr
        lines = [orjson.loads(line) for line in golden.read_bytes().splitlines()]
        assert [line["endpoint"] for line in lines] == ["/v1/chat/completions", "/v1/completions"] * 25
        assert all(len(c["token_ids"]) == len(c["logprobs"]) == 12 for line in lines for c in line["choices"])
        assert lines[0]["server_config"]["engine"]["deterministic"] is True

        same = ringllm("golden", "check", str(golden), "--url", served.base_url, check=False)
        assert (same.returncode, same.stdout.splitlines()[-1]) == (0, "50 requests, 0 divergent"), same.stdout + same.stderr

        other = ringllm("golden", "check", str(golden), "--url", changed.base_url, "--json", check=False)
        report = orjson.loads(other.stdout)
        assert other.returncode == 1 and report["requests"] == 50
        assert {d["request"] for d in report["divergences"]} == {i for i, body in enumerate(sent) if "temperature" not in body}
        assert report["divergent"] == len(report["divergences"]) == 16
        assert all(d["kind"] == "tokens" for d in report["divergences"])
        assert "engine.override_generation_config" in report["config_differences"]
    finally:
        served.stop()
        changed.stop()
