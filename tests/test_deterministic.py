"""Deterministic inference: a request's logprobs are bitwise the same alone, in a batch of two dozen
(decodes riding with prompt chunks), and over a cached prefix. On CPU (fp32) and, where there is
one, a Hopper GPU (bf16, CUDA graphs and eager steps both); and through a real server, whose
/server_info says so, with the openai client."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.engine.sampling import _filtered_rows, log_softmax_rows
from runtime.kernels.cpu import build as cpu_kernels
from runtime.models.batch_invariant import BLOCK_ROWS, BatchInvariantLinear
from tests.conftest import launch, with_tokenizer
from tests.tiny_models import build

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not cpu_kernels.available(), reason="needs ringllm's CPU kernels"))
CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU"),
    ],
)


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_a_request_is_bitwise_the_same_alone_batched_and_cached(device, tiny_model, tmp_path):
    options = dict(device=device, dtype="bfloat16", page_size=16, num_pages=512) if device == "cuda" else {}  # CPU: fp32
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


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_a_row_is_bitwise_the_same_in_any_block_and_batch(device):
    """The projections and the sampler's row-wise reductions (log-softmax; the top-k/p/min-p filters' softmax,
    sums and cumulative sums), at Qwen3's vocabulary: torch splits a reduction by how many rows it has."""
    generator = torch.Generator(device).manual_seed(0)
    rows = BLOCK_ROWS[device] + 5
    x = torch.randn(rows, 1024, generator=generator, device=device)
    linear = BatchInvariantLinear(torch.nn.Linear(1024, 3072, device=device), BLOCK_ROWS[device])
    logits = torch.randn(rows, 151936, generator=generator, device=device) * 4
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=50 * i, min_p=0.01 * (i % 3)) for i in range(rows)]
    whole = (linear(x), log_softmax_rows(logits, BLOCK_ROWS[device]), _filtered_rows(logits, params, BLOCK_ROWS[device]))
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(1)).tolist()
    shuffled = (linear(x[order]), log_softmax_rows(logits[order], BLOCK_ROWS[device]))
    shuffled += (_filtered_rows(logits[order], [params[i] for i in order], BLOCK_ROWS[device]),)
    for i in (0, 3, rows - 1):
        alone = (linear(x[i : i + 1]), log_softmax_rows(logits[i : i + 1], BLOCK_ROWS[device]))
        alone += (_filtered_rows(logits[i : i + 1], [params[i]], BLOCK_ROWS[device]),)
        for batched, moved, one in zip(whole, shuffled, alone):
            assert torch.equal(batched[i], one[0]) and torch.equal(moved[order.index(i)], one[0])


@pytest.mark.parametrize("option", [dict(quantization="fp8"), dict(kv_cache_dtype="fp8_e4m3"), dict(tensor_parallel_size=2)])
def test_deterministic_inference_refuses_what_mixes_rows(option):
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(deterministic=True, **option)


def test_deterministic_inference_refuses_a_sparse_model(tiny_model):
    with pytest.raises(ValueError, match="dense"):
        LLM(tiny_model("qwen3_moe"), deterministic=True)


@pytest.mark.slow
def test_a_served_request_is_bitwise_the_same_alone_and_among_fifteen_others(tiny_model, smollm2, tmp_path):
    model = with_tokenizer(tiny_model("llama"), smollm2, tmp_path / "model")
    server = launch(model, tmp_path / "serve.log", "--enable-deterministic-inference")
    try:
        assert server.get("/server_info")["deterministic"] is True
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        rng = random.Random(1)
        prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 60))] for _ in range(16)]

        def complete(prompt: list[int]) -> tuple[str, list[float]]:
            extra = {"ignore_eos": True, "seed": 5}
            choice = client.completions.create(
                model=server.model, prompt=prompt, max_tokens=10, temperature=0.9, logprobs=2, extra_body=extra
            )
            return choice.choices[0].text, choice.choices[0].logprobs.token_logprobs

        alone = complete(prompts[0])
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(complete, prompts))
        assert together[0] == alone
    finally:
        server.stop()
