"""`python -m benchmarks.vs_hf --quick` end to end: a real server, then real transformers, on the
default model; the figures must compare like with like (no speed asserted: that is the benchmark's)."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # a benchmark through the session's SmolLM2 server and transformers


def test_vs_hf_quick_compares_equal_work_on_both_sides(smol_server, tmp_path):
    out = tmp_path / "vs-hf.json"
    command = [sys.executable, "-m", "benchmarks.vs_hf", "--quick", "--out", str(out)]
    command += ["--base-url", smol_server.base_url, "--served-model", smol_server.model]  # the shared server: no start-up of its own
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-5000:]
    figures = orjson.loads(out.read_bytes())
    assert {"speedup", "ringllm_tok_per_s", "hf_tok_per_s", "model", "command"} <= set(figures)
    assert figures["ringllm_tok_per_s"] > 0 and figures["hf_tok_per_s"] > 0
    assert figures["speedup"] == round(figures["ringllm_tok_per_s"] / figures["hf_tok_per_s"], 2)
    workload = figures["workload"]
    asked = len(workload["user_prompt_tokens"]) * workload["requests_per_size"] * workload["max_tokens"]
    for side in ("ringllm", "hf"):
        assert figures[side]["generated_tokens"] == [asked] * workload["repeats"]
    for size in workload["user_prompt_tokens"]:  # the same prompts, tokenized alike
        assert figures["ringllm"]["per_size"][size]["mean_prompt_tokens"] == figures["hf"]["per_size"][size]["mean_prompt_tokens"]
