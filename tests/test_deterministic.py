"""Deterministic inference: a request's logprobs are bitwise the same alone, in a batch of two dozen
(decodes riding with prompt chunks), and over a cached prefix. On CPU (fp32) and, where there is
one, a Hopper GPU (bf16, CUDA graphs and eager steps both)."""

from __future__ import annotations

import random

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.kernels.cpu import build as cpu_kernels
from tests.tiny_models import build

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not cpu_kernels.available(), reason="needs ringllm's CPU kernels"))
CUDA = pytest.param(
    "cuda",
    marks=pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU"),
)


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_a_request_is_bitwise_the_same_alone_batched_and_cached(device, tiny_model, tmp_path):
    options = dict(device=device, dtype="bfloat16", page_size=16, num_pages=512) if device == "cuda" else dict(dtype="float32")
    model_dir = build("qwen3", tmp_path, head_dim=128) if device == "cuda" else tiny_model("qwen3")
    llm = LLM(model_dir, deterministic=True, max_prefill_tokens=64, mixed_chunk=True, **options)
    rng = random.Random(0)
    prompt = [rng.randrange(500) for _ in range(40)]
    others = [[rng.randrange(500) for _ in range(rng.randint(3, 90))] for _ in range(23)]
    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, logprobs=1, ignore_eos=True)
    for params in (greedy, seeded):
        llm.flush_cache()
        alone = llm.generate([prompt], params)[0]
        llm.flush_cache()
        batched = llm.generate(others[:9] + [prompt] + others[9:], [greedy] * 9 + [params] + [seeded] * 14)[9]
        llm.flush_cache()
        llm.generate([prompt[:20]], SamplingParams(max_tokens=1))
        cached = llm.generate([prompt], params)[0]
        assert cached.cached_tokens == 16
        assert (batched.token_ids, batched.logprobs) == (alone.token_ids, alone.logprobs)
        assert (cached.token_ids, cached.logprobs) == (alone.token_ids, alone.logprobs)


@pytest.mark.parametrize("option", [dict(quantization="fp8"), dict(kv_cache_dtype="fp8_e4m3"), dict(tensor_parallel_size=2)])
def test_deterministic_inference_refuses_what_mixes_rows(option):
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(deterministic=True, **option)


def test_deterministic_inference_refuses_a_sparse_model(tiny_model):
    with pytest.raises(ValueError, match="dense"):
        LLM(tiny_model("qwen3_moe"), deterministic=True)
