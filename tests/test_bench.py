"""`ringllm bench offline` end to end on CPU, in both modes, on a tiny random model with SmolLM2's vocabulary."""

from __future__ import annotations

import subprocess
import sys

import orjson
import psutil
import pytest

from benchmarks.offline import workload
from tests.conftest import ROOT, ringllm, wait_for
from transport.segment import list_segments, server_prefix

pytestmark = pytest.mark.slow  # whole benchmark runs, each with a server of its own

SMALL = ("--requests", "6", "--input-len", "5", "40", "--output-len", "4", "12", "--device", "cpu")


def test_bench_offline_runs_through_the_pipeline_and_in_process(tiny_smol, tmp_path):
    """Each record holds the configuration that ran: the server's /server_info, or the LLM's config; a flag
    the client passes on (--enable-deterministic-inference) shows there, and so does what the engine resolved."""
    out = tmp_path / "offline.json"
    for mode in ((), ("--in-process", "--rounds", "1")):
        flags = (*SMALL, "--enable-deterministic-inference", *mode, "--out", str(out))
        result = ringllm("bench", "offline", "--model", str(tiny_smol), *flags, timeout=300)
        assert "output tok/s" in result.stdout
    runs = orjson.loads(out.read_bytes())["runs"]
    assert [(r["mode"], r["workload"]) for r in runs] == [("pipeline", "offline"), ("in-process", "offline")]
    for run in runs:
        assert run["tok_per_s"] > 0 and run["command"].startswith("ringllm bench offline")
        assert {"model", "date", "commit", "versions"} <= set(run) and run["startup_s"] > 0
        assert run["deterministic"] is True and run["dtype"] == "float32" and run["max_prefill_tokens"] == 512
    assert runs[0]["serve"]["api_workers"] == 2 and runs[0]["serve"]["warm_spares"] is False and "serve" not in runs[1]
    pipeline, in_process = runs
    assert len(pipeline["timed_runs"]) == 2 and pipeline["tok_per_s"] == max(pipeline["timed_runs"])  # each on a flushed cache
    assert "timed_runs" not in in_process  # --rounds 1: one timed run
    prompts, lengths = workload(6, (5, 40), (4, 12))
    assert {(r["prompt_tokens"], r["output_tokens"]) for r in runs} == {(sum(map(len, prompts)), sum(lengths))}


def test_a_killed_benchmark_leaves_no_server_behind(tiny_smol, tmp_path):
    """SIGKILL gives the benchmark no chance to stop its server; the kernel's parent-death signal
    must, and the server must then remove its segments as on any clean stop."""
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "actors.cli",
            "bench",
            "offline",
            "--model",
            str(tiny_smol),
            *SMALL,
            "--out",
            str(tmp_path / "offline.json"),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        served = wait_for(
            lambda: next((p for p in psutil.Process(bench.pid).children() if "serve" in p.cmdline()), None), 60, "the benchmark's server"
        )
        port = next(arg.removeprefix("--port=") for arg in served.cmdline() if arg.startswith("--port="))  # ServeConfig.to_cli_args
        wait_for(lambda: list_segments(server_prefix(port)), 120, "the server's segments")
    finally:
        bench.kill()
        bench.wait()
    wait_for(lambda: not served.is_running(), 60, "the server to stop with its benchmark")
    assert not list_segments(server_prefix(port))


def test_offline_workload_is_mini_sglangs_sample():
    """mini-sglang's benchmark/offline/bench.py, replayed with Qwen3's vocabulary size of 151,643 (Python's
    random, seed 0), asks for 148,643 output tokens over 140,756 prompt tokens; so must this workload,
    or its figures do not compare with mini-sglang's."""
    prompts, lengths = workload(256)
    assert (len(prompts), sum(lengths), sum(map(len, prompts))) == (256, 148_643, 140_756)
    assert all(100 <= len(p) <= 1024 and max(p) < 10_000 for p in prompts)


def test_floors_count_the_weights_each_step_reads():
    """Qwen3-30B-A3B: 48 sparse layers of 128 experts (3 x 2048 x 768 each) are ~58 GB in bf16; one row
    reads its top 8 experts a layer, a full batch nearly all; the workload's floor stays under its
    full-batch figure, as its batch shrinks while requests end."""
    import argparse

    from benchmarks.floors import Shape, offline_floor
    from runtime.config import ModelConfig

    cfg = ModelConfig.load(ROOT / "benchmarks" / "models" / "qwen3-30b-a3b")
    shape = Shape.of(cfg)
    assert shape.sparse_layers == 48 and shape.expert * shape.experts * shape.sparse_layers * 2 == pytest.approx(57.98e9, rel=1e-3)
    assert shape.active_experts(1) == pytest.approx(8) and shape.active_experts(1024) == pytest.approx(128, rel=1e-6)
    rates = argparse.Namespace(bandwidth=4.4, tflops=700, weight_bytes=2.0, kv_bytes=2.0, requests=256)
    seconds, rate = offline_floor(shape, cfg, rates)
    one_step = shape.step_s([1100] * 256, rates)  # every expert and 256 x 1,100 tokens of KV
    assert one_step > 58e9 / 4.4e12 and 256 / one_step > rate > 0


def test_bench_lora_serves_the_base_and_the_adapters_and_records_both(tiny_smol, tmp_path):
    """benchmarks.lora on CPU, small: three layouts, each record with its server's config (the adapters there
    under LoRA), every request answered, the ratios to the base said."""
    from benchmarks import lora

    out = tmp_path / "lora.json"
    flags = ["--requests", "4", "--concurrency", "2", "--prompt-tokens", "16", "--output-tokens", "4", "--single-tokens", "4"]
    record = lora.main(["--model", str(tiny_smol), "--adapters", "2", "--rank", "4", *flags, "--out", str(out), "--", "--no-warm-spares"])
    assert orjson.loads(out.read_bytes()) == orjson.loads(orjson.dumps(record))
    base, plain, spread = record["layouts"]
    assert [layout["layout"] for layout in record["layouts"]] == ["base", "lora, base requests", "lora, spread"]
    assert base["config"]["engine"]["enable_lora"] is False
    for layout in (plain, spread):
        assert [entry.split("=")[0] for entry in layout["config"]["engine"]["lora_paths"]] == ["adapter0", "adapter1"]
        assert layout["ratio"]["tokens_per_s"] > 0
    assert all(layout["tokens_per_s"] > 0 and layout["one_request_tokens_per_s"] > 0 for layout in record["layouts"])
