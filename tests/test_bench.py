"""`ringllm bench offline` end to end on CPU, in both modes, on random weights of SmolLM2's shape."""

from __future__ import annotations

import orjson

from tests.conftest import ringllm

SMALL = ("--requests", "6", "--input-len", "5", "40", "--output-len", "4", "12", "--device", "cpu")


def test_bench_offline_runs_through_the_pipeline_and_in_process(smollm2, tmp_path):
    out = tmp_path / "offline.json"
    for mode in ((), ("--in-process",)):
        result = ringllm("bench", "offline", "--model", str(smollm2), *SMALL, *mode, "--out", str(out), timeout=300)
        assert "output tok/s" in result.stdout
    runs = orjson.loads(out.read_bytes())["runs"]
    assert [(r["mode"], r["workload"]) for r in runs] == [("pipeline", "offline"), ("in-process", "offline")]
    for run in runs:
        assert run["tok_per_s"] > 0 and run["command"].startswith("ringllm bench offline")
        assert {"model", "date", "versions"} <= set(run)
