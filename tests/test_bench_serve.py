"""`ringllm bench serve` against a real server (SmolLM2 on CPU): both endpoints, an infinite and a
finite rate, a concurrency cap, shared-prefix and JSONL workloads, a refused request counted as
failed, and the command line's printed block and saved JSON."""

from __future__ import annotations

import asyncio
import re

import numpy as np
import orjson
import pytest

from benchmarks.serve import arrival_times, make_prompts, parse_args, run_benchmark
from runtime.models.source import load_tokenizer
from tests.conftest import ringllm

pytestmark = pytest.mark.slow  # whole benchmark runs against a server

SMALL = ["--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "8", "--ignore-eos", "--disable-tqdm"]
VLLM_KEYS = {
    "date",
    "backend",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "command",
    *(f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p99") for name in ("ttft", "tpot", "itl", "e2el")),
}
PER_REQUEST = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "e2els", "generated_texts", "errors")


def bench(server, *flags: str) -> dict:
    return asyncio.run(run_benchmark(parse_args(["--base-url", server.base_url, *SMALL, *flags])))


def assert_streams(result: dict, count: int, output_len: int) -> None:
    """Every request completed with ignore_eos's exact length, one chunk per token, and times that add up."""
    assert (result["completed"], result["failed"]) == (count, 0), result["errors"]
    assert result["output_lens"] == [output_len] * count and result["total_output_tokens"] == count * output_len
    assert all(len(result[key]) == count for key in PER_REQUEST)
    for ttft, itl, e2el in zip(result["ttfts"], result["itls"], result["e2els"]):
        assert 0 < ttft < e2el and len(itl) == output_len - 1 and ttft + sum(itl) <= e2el
    assert all(text for text in result["generated_texts"]) and not any(result["errors"])
    assert 0 < result["median_itl_ms"] <= result["p99_itl_ms"] and result["mean_tpot_ms"] > 0


def peak_in_flight(result: dict) -> int:
    events = sorted([(s, 1) for s in result["start_times"]] + [(s + e, -1) for s, e in zip(result["start_times"], result["e2els"])])
    return max(np.cumsum([step for _, step in events]))


def test_completions_all_at_once(smol_server):
    result = bench(smol_server)
    assert_streams(result, 8, 8)
    assert result["server_config"]["api_workers"] == 2  # what the server reports it runs
    assert all(abs(n - 32) <= 2 for n in result["input_lens"]), result["input_lens"]  # random text of ~32 tokens
    assert max(result["start_times"]) < 0.5 and result["request_rate"] == "inf" and result["max_concurrency"] is None


def test_chat_at_a_rate_under_a_concurrency_cap(smol_server):
    result = bench(smol_server, "--endpoint", "/v1/chat/completions", "--request-rate", "16", "--max-concurrency", "2")
    assert_streams(result, 8, 8)
    assert all(n > 32 for n in result["input_lens"])  # the server's count, chat template included
    assert peak_in_flight(result) <= 2
    assert max(result["start_times"]) >= 8 / 16 - 0.01  # the last arrival lands at count / rate


def test_shared_prefix(smol_server, smollm2):
    flags = ["--dataset-name", "shared-prefix", "--shared-prefix-len", "64", "--shared-prefix-groups", "2"]
    prompts = make_prompts(parse_args([*SMALL, *flags]), load_tokenizer(smollm2))
    prefixes = [prompts[0].text[:150], prompts[1].text[:150]]  # well inside 64 random tokens of text
    assert prefixes[0] != prefixes[1]
    assert all(p.text.startswith(prefixes[i % 2]) for i, p in enumerate(prompts))
    assert all(abs(p.input_len - 96) <= 3 for p in prompts), [p.input_len for p in prompts]
    assert_streams(bench(smol_server, *flags), 8, 8)


def test_jsonl_with_a_refused_request(smol_server, tmp_path):
    rows = [
        {"prompt": "The capital of France is", "output_len": 3},
        {"prompt": "One, two, three,"},
        {"prompt": "Too long", "output_len": 100_000},
        {"prompt": "Colors: red, green,", "output_len": 5},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows))
    result = bench(smol_server, "--dataset-name", "jsonl", "--dataset-path", str(path))
    assert (result["completed"], result["failed"], result["num_prompts"]) == (3, 1, 4)
    assert result["output_lens"] == [3, 8, 0, 5] and result["total_output_tokens"] == 16
    assert "HTTP 400" in result["errors"][2] and "maximum context length" in result["errors"][2]
    assert [bool(e) for e in result["errors"]] == [False, False, True, False]


def test_command_line_prints_vllms_block_and_saves_vllms_keys(smol_server, tmp_path):
    out = ringllm(
        "bench",
        "serve",
        "--base-url",
        smol_server.base_url,
        *SMALL,
        "--max-concurrency",
        "4",
        "--goodput",
        "ttft:600000",
        "e2el:600000",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        timeout=120,
    ).stdout
    assert "============ Serving Benchmark Result ============\nSuccessful requests:" in out and f"\n{'=' * 50}\n" in out
    for label, value in (
        ("Successful requests", "8"),
        ("Failed requests", "0"),
        ("Maximum request concurrency", "4"),
        ("Total generated tokens", "64"),
    ):
        assert re.search(rf"^{label}:\s+{value}$", out, re.M), label
    for label in (
        "Benchmark duration (s)",
        "Request goodput (req/s)",
        "Output token throughput (tok/s)",
        "Mean TTFT (ms)",
        "P99 TPOT (ms)",
        "Median ITL (ms)",
        "P99 E2EL (ms)",
    ):
        assert re.search(rf"^{re.escape(label)}:\s+\d+\.\d\d$", out, re.M), label
    (saved,) = tmp_path.glob("ringllm-infqps-concurrency4-smollm2-*.json")
    result = orjson.loads(saved.read_bytes())
    assert VLLM_KEYS <= set(result) and result["backend"] == "ringllm" and result["model_id"] == "smollm2"
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # SLOs no request misses
    assert result["command"].startswith("ringllm bench serve --base-url") and "--goodput ttft:600000" in result["command"]
    assert_streams(result, 8, 8)


def test_arrivals_follow_the_rate():
    rng = np.random.default_rng(0)
    assert not arrival_times(5, float("inf"), 1.0, rng).any()
    for burstiness in (1.0, 0.3, 4.0):
        times = arrival_times(2000, 10.0, burstiness, rng)
        gaps = np.diff(times)
        assert times[-1] == pytest.approx(200.0) and (gaps >= 0).all() and gaps.mean() == pytest.approx(0.1, rel=0.01)
        assert gaps.std() / gaps.mean() == pytest.approx(burstiness**-0.5, rel=0.15)  # a gamma's coefficient of variation
