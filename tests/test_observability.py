"""Seeing inside a real server: request ids, the trace rebuilt from every actor's JSON logs,
Prometheus /metrics summed across processes and checked against the load harness, the stats
line, and console logs."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.request
import uuid

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve import parse_args, run_benchmark
from runtime.obs.metrics import TTFT_BUCKETS
from tests.conftest import ROOT, log_events, ringllm, wait_for

PIPELINE_ORDER = [
    ("api", "received"),
    ("tokenizer", "tokenized"),
    ("scheduler", "queued"),
    ("scheduler", "scheduled"),
    ("scheduler", "prefill_done"),
    ("api", "first_token"),
    ("scheduler", "finished"),
    ("api", "finished"),
]


async def stream_chat(base_url: str, model: str, headers: dict[str, str]) -> tuple[str, dict]:
    """The X-Request-Id the server answered with, and the body's id."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 6,
        "stream": True,
        "ignore_eos": True,
    }  # sampled at temperature 1: without it, an early <|im_end|> ends the request short
    async with aiohttp.ClientSession(base_url) as http, http.post("/v1/chat/completions", json=body, headers=headers) as reply:
        assert reply.status == 200
        chunks = [orjson.loads(line[5:]) for line in (await reply.read()).split(b"\n\n") if line.startswith(b"data: {")]
        return reply.headers["X-Request-Id"], chunks[0]


def trace(log, rid: str) -> dict:
    def finished() -> dict | None:
        result = ringllm("trace", rid, "--log", str(log), "--json", check=False)
        if (
            result.returncode == 0
            and (traced := orjson.loads(result.stdout))
            and sum(e["event"] == "finished" for e in traced["events"]) == 2
        ):
            return traced
        return None

    return wait_for(finished, 10, f"the trace of {rid} to be complete")


@pytest.mark.slow
def test_a_request_is_traced_across_every_actor_in_order(smol_server):
    wanted = f"obs-{uuid.uuid4().hex[:8]}"
    echoed, first_chunk = asyncio.run(stream_chat(smol_server.base_url, smol_server.model, {"X-Request-Id": wanted}))
    assert echoed == wanted and first_chunk["id"] == f"chatcmpl-{wanted}"
    traced = trace(smol_server.log, wanted)
    events = traced["events"]
    kinds = lambda e: ("api" if e["actor"].startswith("api") else e["actor"], e["event"])  # noqa: E731
    seen = {kinds(e): e for e in events}
    assert set(PIPELINE_ORDER) <= set(seen), sorted(seen)
    times = [seen[key]["t"] for key in PIPELINE_ORDER]
    assert times == sorted(times), "timestamps must follow the pipeline across processes"
    assert len({seen[key]["pid"] for key in PIPELINE_ORDER}) == 3  # api worker, tokenizer, scheduler
    assert all(e["epoch"] >= 1 and e["rid"] == wanted for e in events)
    assert set(traced["stages"]) == {"tokenize", "queue", "prefill", "decode", "detokenize", "ttft", "e2e"}
    assert all(seconds >= 0 for seconds in traced["stages"].values())
    assert traced["stages"]["e2e"] >= traced["stages"]["ttft"] > 0
    assert seen["api", "finished"]["completion_tokens"] == seen["scheduler", "finished"]["output_tokens"] == 6

    text = ringllm("trace", wanted, "--log", str(smol_server.log)).stdout
    assert f"request {wanted}: {len(events)} events" in text and "stages: tokenize" in text


@pytest.mark.slow
def test_request_ids_are_made_unique_and_default_to_the_body_id(smol_server):
    """Each api worker keeps the ids it has seen; with two workers, two of three requests that
    reuse an id meet in one of them."""
    wanted = f"dup-{uuid.uuid4().hex[:8]}"
    echoed = [asyncio.run(stream_chat(smol_server.base_url, smol_server.model, {"X-Request-Id": wanted})) for _ in range(3)]
    assert all(body["id"] == f"chatcmpl-{rid}" for rid, body in echoed)
    assert echoed[0][0] == wanted
    renamed = [rid for rid, _ in echoed if rid != wanted]
    assert renamed and all(rid.startswith(f"{wanted}-") for rid in renamed)
    assert trace(smol_server.log, renamed[0])["events"][0]["event"] == "received"
    anonymous, body = asyncio.run(stream_chat(smol_server.base_url, smol_server.model, {}))
    assert anonymous == body["id"] and anonymous.startswith("chatcmpl-")
    assert ringllm("trace", "no-such-request", "--log", str(smol_server.log), check=False).returncode == 1


def scrape(base_url: str) -> dict:
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as reply:
        return {f.name: f for f in text_string_to_metric_families(reply.read().decode())}


@pytest.mark.slow
def test_metrics_agree_with_the_load_harness(smol_server):
    args = parse_args(
        [
            "--base-url",
            smol_server.base_url,
            "--num-prompts",
            "12",
            "--request-rate",
            "6",
            "--random-input-len",
            "96",
            "--random-output-len",
            "8",
            "--ignore-eos",
            "--disable-tqdm",
        ]
    )
    result = asyncio.run(run_benchmark(args))
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["server_completed"] == result["completed"]
    assert result["server_requests_per_replica"] == [12] and 0 <= result["server_prefix_hit_rate"] < 1
    assert result["server_output_tokens"] == result["total_output_tokens"] == 12 * 8
    assert abs(result["server_mean_ttft_ms"] - result["mean_ttft_ms"]) <= 0.10 * result["mean_ttft_ms"]

    families = scrape(smol_server.base_url)
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "ringllm:ring_occupancy",
        "ringllm:step_duration_seconds",
        "ringllm:batch_size",
    ):
        assert name in families, name
    buckets = [s.labels["le"] for s in families["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert buckets == [repr(float(b)) for b in TTFT_BUCKETS] + ["+Inf"]
    edges = {s.labels["edge"] for s in families["ringllm:ring_occupancy"].samples}
    assert {"api0->tokenizer", "api1->tokenizer", "scheduler->engine", "detokenizer->api1"} <= edges
    steps = {s.name: s.value for s in families["ringllm:step_duration_seconds"].samples}
    assert steps["ringllm:step_duration_seconds_count"] > 0 and steps["ringllm:step_duration_seconds_sum"] > 0

    def stats_line() -> dict | None:  # the periodic line after this traffic (every 10 s)
        lines = log_events(smol_server.log, "stats")
        return next((line for line in reversed(lines) if line["gen_tok_s"] > 0), None)

    stats = wait_for(stats_line, 15, "a stats line")
    assert {"prompt_tok_s", "running", "waiting", "kv_usage", "prefix_hit_rate"} <= set(stats)


def _logged(code: str, log_format: str) -> subprocess.CompletedProcess:
    """Run `code` after configure_logging('probe') in a fresh interpreter, logging in `log_format`."""
    setup = "from runtime.obs.logs import configure_logging; import structlog; configure_logging('probe')\n"
    env = {**os.environ, "RINGLLM_LOG_FORMAT": log_format}
    return subprocess.run([sys.executable, "-c", setup + code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)


def test_json_log_lines_take_fields_with_integer_keys():
    """engine_ready logs padded_to as {rows: graph rows}: orjson refuses int keys unless told."""
    out = _logged("structlog.get_logger().info('hello', padded_to={1: 8})", "json")
    assert out.returncode == 0 and orjson.loads(out.stderr.strip().splitlines()[-1])["padded_to"] == {"1": 8}, out.stderr


def test_json_log_lines_carry_the_traceback_of_log_exception():
    """A handler's failure logs with log.exception: the JSON line must hold where it failed, not just exc_info=true,
    and not the frames' locals (kilobytes a line)."""
    fail = "def fail(held):\n    {}['missing-key']\n"
    out = _logged(fail + "try:\n    fail('x' * 5000)\nexcept KeyError:\n    structlog.get_logger().exception('handler_failed')", "json")
    line = orjson.loads(out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0 and "missing-key" in orjson.dumps(line["exception"]).decode(), out.stderr
    assert "xxxxx" not in out.stderr


def test_console_log_format():
    out = _logged("structlog.get_logger().info('hello', rid='r1')", "console").stderr
    assert "hello" in out and "rid=r1" in out and "actor=probe" in out and not out.lstrip().startswith("{")


@pytest.mark.slow
def test_every_actor_freezes_its_start_up_heap(smol_server):
    """Each actor reports how many objects it moved out of the collector's reach once set up: with
    torch or transformers imported, far more than a bare interpreter's."""
    ready = log_events(smol_server.log, "ready")
    frozen = {line["actor"]: line["gc_frozen"] for line in ready}
    assert {"tokenizer", "scheduler", "engine", "detokenizer", "api0", "api1"} <= set(frozen), frozen
    assert min(frozen.values()) > 20_000, frozen


def test_long_collections_are_logged():
    code = (
        "import gc; from runtime.obs.logs import configure_logging; from runtime.obs.gc_pauses import log_long_pauses; "
        "configure_logging('probe'); log_long_pauses(0.0); gc.collect()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "RINGLLM_LOG_FORMAT": "json"}
    )
    pauses = [orjson.loads(line) for line in out.stderr.splitlines() if '"gc_pause"' in line]
    assert out.returncode == 0 and pauses and pauses[-1]["generation"] == 2 and pauses[-1]["ms"] >= 0, out.stderr
