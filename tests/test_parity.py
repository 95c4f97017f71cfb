"""Token-for-token parity with transformers: greedy ids equal `generate(do_sample=False)`, and
top-5 log-probabilities within 1e-3 of transformers' log-softmax, for every architecture (the MoE and
sliding-window ones also from the prefix cache), at page sizes 1 and 16, with a chunk budget that
splits the longer prompts across steps.

The one divergence allowed is a true near-tie: where the ids first differ, transformers' two best
log-probabilities lie within 1e-4 (vLLM's check_logprobs_close makes the same allowance)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch

from runtime import LLM, SamplingParams
from tests.tiny_models import ARCHITECTURES, MOE_ARCHITECTURES, WINDOWED_ARCHITECTURES

NEW_TOKENS = 48
CHUNK_BUDGET = 24  # smaller than most prompts: multi-chunk prefill, alone or inside mixed steps
NEAR_TIE = 1e-4
LOGPROB_TOLERANCE = 1e-3
# an FP8 KV cache rounds to 3 mantissa bits: where fp32 noise puts a value on the other side of a rounding
# boundary than transformers' does, that element moves by ~6%, and log-probabilities by up to ~2e-3
FP8_KV_TOLERANCE = 1e-2
QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish, German and Italian, one per line, with no other text.",
    "What is 12 times 13?",
    "Summarise the plot of Romeo and Juliet for a ten-year-old reader in a short paragraph of plain words.",
]


@cache
def prompts_for(model_dir: Path) -> tuple[tuple[int, ...], ...]:
    tokenizer_files = list(model_dir.glob("tokenizer*"))
    if tokenizer_files:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return tuple(
            tuple(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
            )
            for q in QUESTIONS
        )
    generator = torch.Generator().manual_seed(1)
    return tuple(tuple(torch.randint(0, 512, (n,), generator=generator).tolist()) for n in (3, 17, 40, 64, 5, 29, 90, 11))


def fp8_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention over keys and values stored as float8_e4m3fn, each divided by its
    layer's scale (`module.kv_scales`, from the checkpoint's k_scale / v_scale; 1 without) and
    multiplied back, as an FP8 KV cache stores them: the reference for kv_cache_dtype="fp8_e4m3"."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scales = getattr(module, "kv_scales", (1.0, 1.0))
    rounded = [(x / s).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn).to(x.dtype) * s for x, s in zip((key, value), scales)]
    return sdpa_attention_forward(module, query, *rounded, attention_mask, **kwargs)


@cache
def reference(model_dir: Path, fp8_kv: bool = False) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy ids and per-step log-softmax for each prompt, all in one left-padded batch:
    the same ids as one prompt at a time, in far less time, and log-probabilities well inside LOGPROB_TOLERANCE."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    # SDPA has no soft cap on the scores and no sinks: transformers runs Gemma 2 and GPT-OSS eager
    config = json.loads((model_dir / "config.json").read_text())
    attention = "eager" if config.get("attn_logit_softcapping") or config["architectures"][0] == "GptOssForCausalLM" else "sdpa"
    if fp8_kv:
        AttentionInterface.register("fp8_kv_sdpa", fp8_kv_sdpa)
        AttentionMaskInterface.register("fp8_kv_sdpa", sdpa_mask)  # SDPA's masks, as for "sdpa"
        attention = "fp8_kv_sdpa"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention).eval()
    if fp8_kv:
        from safetensors.torch import load_file

        weights = load_file(model_dir / "model.safetensors")
        for index, layer in enumerate(model.model.layers):
            k, v = (weights.get(f"model.layers.{index}.self_attn.{kind}_scale") for kind in "kv")
            layer.self_attn.kv_scales = (1.0 if k is None else float(k), 1.0 if v is None else float(v))
    model.generation_config.eos_token_id = None  # generate all 48 tokens, like ignore_eos
    prompts = prompts_for(model_dir)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    result = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logprobs = torch.log_softmax(torch.stack(result.logits).float(), dim=-1)  # [step, prompt, vocab]
    out = [(result.sequences[i, width:].tolist(), logprobs[:, i]) for i in range(len(prompts))]
    assert all(len(ids) == NEW_TOKENS for ids, _ in out)
    return out


def divergence(ours: list[int], theirs: list[int]) -> int:
    """The first position where the ids differ (the full length if none does)."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))


def greedy_matches(ours: list[int], theirs: list[int], ref_logprobs: torch.Tensor, near_tie: float = NEAR_TIE) -> int:
    """Assert the greedy ids agree up to a true near-tie; returns 1 if they part at one, else 0."""
    assert len(ours) == len(theirs) == NEW_TOKENS
    at = divergence(ours, theirs)
    if at == len(ours):
        return 0
    best_two = ref_logprobs[at].topk(2).values
    assert best_two[0] - best_two[1] < near_tie, f"greedy ids diverge at position {at} with no near-tie"
    return 1  # past a tie the two continuations are different texts


def compare(model_dir: Path, page_size: int, mixed_chunk: bool, passes: int = 1, reference_dir: Path | None = None, **options) -> int:
    """Run ringllm (LLM `options` added) on the whole batch and check it against transformers (on
    `reference_dir`, where the weights transformers should run are another folder's); returns
    near-ties. Each pass after the first reads the prompts back from the prefix cache."""
    fp8_kv = options.get("kv_cache_dtype", "auto") != "auto"
    tolerance, near_tie = (FP8_KV_TOLERANCE, FP8_KV_TOLERANCE) if fp8_kv else (LOGPROB_TOLERANCE, NEAR_TIE)
    llm = LLM(
        model_dir,
        dtype="float32",
        page_size=page_size,
        max_prefill_tokens=CHUNK_BUDGET,
        num_pages=8192 // page_size,
        mixed_chunk=mixed_chunk,
        **options,
    )
    prompts = [list(p) for p in prompts_for(model_dir)]
    near_ties = 0
    for attempt in range(passes):
        outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5))
        assert attempt == 0 or all(o.cached_tokens >= len(p) - page_size for o, p in zip(outputs, prompts) if len(p) > page_size)
        for output, (ref_ids, ref_logprobs) in zip(outputs, reference(reference_dir or model_dir, fp8_kv)):
            assert len(output.token_ids) == NEW_TOKENS and output.finish_reason == "length"
            for position, top in enumerate(output.logprobs[: divergence(output.token_ids, ref_ids) + 1]):
                for token, logprob in top.items():
                    assert abs(logprob - ref_logprobs[position, token].item()) < tolerance, (position, token)
            near_ties += greedy_matches(output.token_ids, ref_ids, ref_logprobs, near_tie)
    llm.flush_cache()
    for allocator in (llm.scheduler.allocator, *([llm.scheduler.windows.allocator] if llm.scheduler.windows else [])):
        assert allocator.num_free == allocator.num_pages
    return near_ties


@pytest.mark.parametrize(("page_size", "mixed_chunk"), [(1, False), (16, True)])  # both step policies
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_model_parity(tiny_model, arch, page_size, mixed_chunk):
    near_ties = compare(tiny_model(arch), page_size, mixed_chunk)
    print(f"{arch} page {page_size}: near-ties {near_ties}")


@pytest.mark.parametrize(("page_size", "mixed_chunk"), [(1, False), (16, True)])
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_moe_parity_through_the_prefix_cache(tiny_model, arch, page_size, mixed_chunk):
    """Qwen3-MoE: the router's top-k (renormalised or not), dense layers among sparse ones; the second
    pass of the same prompts runs from the prefix cache."""
    near_ties = compare(tiny_model(arch), page_size, mixed_chunk, passes=2)
    print(f"{arch} page {page_size}: near-ties {near_ties}")


@pytest.mark.parametrize(("page_size", "mixed_chunk"), [(1, False), (16, True)])
@pytest.mark.parametrize("arch", WINDOWED_ARCHITECTURES)
def test_sliding_window_parity_through_the_prefix_cache(tiny_model, arch, page_size, mixed_chunk):
    """Gemma 3 (windows on two layers of three, their own rope, q/k norms, query_pre_attn_scalar), Gemma 2 (every
    other layer, soft caps on the scores and the logits) and Mistral-7B-v0.1's layout (every layer): windows of 16,
    shorter than most prompts; the second pass of the same prompts runs from the prefix cache."""
    near_ties = compare(tiny_model(arch), page_size, mixed_chunk, passes=2)
    print(f"{arch} page {page_size}: near-ties {near_ties}")


@pytest.mark.slow
@pytest.mark.parametrize(("page_size", "mixed_chunk"), [(1, False), (16, True)])
def test_smollm2_parity(smollm2, page_size, mixed_chunk):
    near_ties = compare(smollm2, page_size, mixed_chunk)
    print(f"SmolLM2 page {page_size}: near-ties {near_ties}")
    assert near_ties == 0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # biases and a tied lm_head; q/k norms
def test_parity_on_torch_ops_alone(tiny_model, arch, monkeypatch):
    """The path of machines where ringllm's CPU kernels do not build (runtime.kernels.cpu.build)."""
    from runtime.kernels.cpu import build as cpu_kernels

    monkeypatch.setenv("RINGLLM_CPU_KERNELS", "0")
    cpu_kernels.available.cache_clear()
    try:
        assert not cpu_kernels.available()  # so the op set is torch's, the linears oneDNN's, decode attention SDPA
        compare(tiny_model(arch), 16, True)
    finally:
        cpu_kernels.available.cache_clear()
