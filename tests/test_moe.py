"""Qwen3-MoE beyond the in-process parity (tests/test_parity.py): served through every process, with
the routing counts an operator reads in /server_info and /metrics; a checkpoint that lacks an
expert's tensor is refused by name. The server also runs an FP8 KV cache (one server for both)."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from safetensors.torch import load_file, save_file

from runtime import LLM
from runtime.config import DEFAULT_KV_TOKENS, ModelConfig
from tests.conftest import launch, wait_for, with_tokenizer
from tests.test_parity import FP8_KV_TOLERANCE, greedy_matches, prompts_for
from tests.test_parity import reference as parity_reference
from tests.test_serving import complete_ids

MIXED = "qwen3_moe_mixed"  # 6 experts, top 3; layer 1 sparse, layers 0, 2 and 3 dense


def test_the_router_layout_comes_from_config_json(tiny_model):
    moe = ModelConfig.load(tiny_model(MIXED)).moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (6, 3, False)
    assert [moe.is_sparse(layer) for layer in range(4)] == [False, True, False, False]


@pytest.mark.slow
def test_serving_gives_transformers_tokens_and_reports_expert_load(tiny_model, smollm2, tmp_path):
    """Over an FP8 KV cache, the tokens of transformers whose keys and values are rounded to float8,
    both times (the second from the prefix cache); /server_info shows the pool's dtype and tokens."""
    served = with_tokenizer(tiny_model(MIXED), smollm2, tmp_path / "model")
    flags = ("--page-size", "16", "--max-prefill-tokens", "24", "--stats-interval", "0.3", "--kv-cache-dtype", "fp8_e4m3")
    server = launch(served, tmp_path / "serve.log", *flags)
    try:
        info = server.get("/server_info")
        assert info["kv_cache_dtype"] == "fp8_e4m3" and info["kv_tokens"] == 4 * DEFAULT_KV_TOKENS  # fp32 -> float8: the same bytes
        prompts = [list(p) for p in prompts_for(tiny_model(MIXED))]
        reference = parity_reference(tiny_model(MIXED), fp8_kv=True)
        for _ in range(2):
            ids = asyncio.run(complete_ids(server.base_url, server.model, prompts))
            near_ties = sum(greedy_matches(ours, ref, logprobs, FP8_KV_TOLERANCE) for ours, (ref, logprobs) in zip(ids, reference))
            print(f"{MIXED} over HTTP, FP8 KV: near-ties {near_ties}")
        assert server.get("/server_info")["scheduler"]["cached_pages"] > 0
        reports = wait_for(lambda: server.get("/server_info").get("moe"), 10, "an expert-load report")
        (report,) = reports
        assert report["replica"] == 0 and report["layers"] == [1]
        (counts,) = report["tokens_per_expert"]
        assert len(counts) == 6 and sum(counts) > 0 and sum(counts) % 3 == 0  # every token took exactly 3 experts
        assert report["imbalance"][0] == pytest.approx(max(counts) / (sum(counts) / 6), abs=1e-3) and report["imbalance"][0] >= 1
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as reply:
            exposition = reply.read().decode()
        assert 'ringllm:moe_expert_load_imbalance{layer="1",replica="0"}' in exposition
    finally:
        assert server.stop() < 5


def test_a_checkpoint_without_an_expert_is_refused(tiny_model, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for item in tiny_model(MIXED).iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.experts.4.up_proj.weight"]
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.4\.up_proj\.weight"):
        LLM(folder, dtype="float32")
