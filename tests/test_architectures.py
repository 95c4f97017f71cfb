"""What a checkpoint's config.json makes of the model: an architecture outside the registry is refused with the
list of those served, a sliding window that every layer uses caps the context where ringllm is exact, and rope
variants are served as transformers runs them or refused by name."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.config import ModelConfig
from runtime.models.registry import MODELS
from tests.test_parity import CHUNK_BUDGET, LOGPROB_TOLERANCE, NEW_TOKENS, divergence, greedy_matches
from tests.tiny_models import SHAPE, build


def raw_config(config_class: Any, architecture: str, **extra: Any) -> dict[str, Any]:
    """A tiny model's config.json as transformers' config class writes it."""
    return {**config_class(**SHAPE, **extra).to_dict(), "architectures": [architecture]}


def test_an_unknown_architecture_is_refused_with_the_supported_list(tiny_model, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((tiny_model("llama") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["FalconH9ForCausalLM"]}))
    with pytest.raises(ValueError, match="FalconH9ForCausalLM is not supported") as refused:
        LLM(folder)
    assert all(name in str(refused.value) for name in MODELS if name.endswith("ForCausalLM"))


def test_a_sliding_window_caps_the_context_and_an_unused_one_does_not():
    """Mistral-7B-v0.1 attends to its last `sliding_window` tokens in every layer: until
    windows are served, the context stops at the window. Qwen2's config names a window it does not use."""
    from transformers import MistralConfig, Qwen2Config

    def load(config_class: Any, architecture: str, **extra: Any) -> ModelConfig:
        return ModelConfig.from_dict(raw_config(config_class, architecture, **extra))

    full = SHAPE["max_position_embeddings"]
    assert load(MistralConfig, "MistralForCausalLM", sliding_window=64).max_position == 64
    assert load(MistralConfig, "MistralForCausalLM", sliding_window=None).max_position == full
    assert load(Qwen2Config, "Qwen2ForCausalLM", sliding_window=64, use_sliding_window=False).max_position == full


def test_partial_rotary_is_refused_by_name():
    """Phi-4-mini rotates part of each head: refused at load, where a wrong rope would give fluent, wrong text."""
    from transformers import Phi3Config

    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_dict({**raw_config(Phi3Config, "Phi3ForCausalLM"), "rope_parameters": rope})


@pytest.fixture(scope="module")
def longrope_phi3(tmp_path_factory):
    """Phi-3 with LongRoPE (as Phi-3-mini-128k): short factors below 64 positions, long ones from there, and the
    attention factor of a context 8 times the pretraining length."""
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [1.5 + 0.5 * i for i in range(8)],
    }
    return build("phi3", tmp_path_factory.mktemp("phi3-longrope"), original_max_position_embeddings=64, rope_parameters=rope)


def longrope_reference(model_dir, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy ids [prompt, NEW_TOKENS] and log-softmax [step, prompt, vocab] by its model's forward
    over a KV cache, a token a step: each forward ropes its own rows, with the long factors from the pretraining
    length on. (Its `generate` instead drops the cache where a sequence first passes that length and recomputes
    it all with the long factors; ringllm, as vLLM and SGLang, keeps the KV it has.)"""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, cache, steps, drawn = torch.tensor(prompts), DynamicCache(), [], []
    positions = torch.arange(ids.shape[1])[None].expand(len(prompts), -1)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits[:, -1].float()
            steps.append(torch.log_softmax(logits, dim=-1))
            ids = logits.argmax(-1, keepdim=True)
            drawn.append(ids)
            positions = positions[:, -1:] + 1
    return torch.cat(drawn, dim=1), torch.stack(steps)


@pytest.mark.parametrize(("page_size", "mixed_chunk"), [(1, False), (16, True)])
def test_longrope_switches_to_its_long_factors_where_transformers_does(longrope_phi3, page_size, mixed_chunk):
    """Prompts of 30 tokens decode 48 more, across the pretraining length (64): the greedy ids of transformers'
    model stepped over its KV cache, and its log-probabilities within 1e-3, over chunked prefill."""
    prompts = [[(7 * i + 13 * n) % 500 + 3 for i in range(30)] for n in range(4)]
    ids, logprobs = longrope_reference(longrope_phi3, prompts)
    llm = LLM(longrope_phi3, dtype="float32", page_size=page_size, max_prefill_tokens=CHUNK_BUDGET, mixed_chunk=mixed_chunk)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    for i, output in enumerate(llm.generate(prompts, params)):
        theirs = ids[i].tolist()
        for position, top in enumerate(output.logprobs[: divergence(output.token_ids, theirs) + 1]):
            for token, logprob in top.items():
                assert abs(logprob - logprobs[position, i, token].item()) < LOGPROB_TOLERANCE, (i, position, token)
        greedy_matches(output.token_ids, theirs, logprobs[:, i])
