"""What a checkpoint's config.json makes of the model: an architecture outside the registry is refused with the
list of those served, sliding windows are laid out per layer as transformers lays them out, and rope variants are
served as transformers runs them or refused by name."""

from __future__ import annotations

import json
import math
import shutil
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
    return {**config_class(**{**SHAPE, **extra}).to_dict(), "architectures": [architecture]}


def test_an_unknown_architecture_is_refused_with_the_supported_list(tiny_model, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((tiny_model("llama") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["FalconH9ForCausalLM"]}))
    with pytest.raises(ValueError, match="FalconH9ForCausalLM is not supported") as refused:
        LLM(folder)
    assert all(name in str(refused.value) for name in MODELS if name.endswith("ForCausalLM"))


def test_sliding_windows_are_laid_out_as_transformers_lays_them_out():
    """Mistral-7B-v0.1 windows every layer; Gemma 3 five layers of each six, Gemma 2 every other one; Qwen2's config
    names a window it does not use unless asked, and then from max_window_layers on; a window as long as the
    context is none."""
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Qwen2Config

    def windows(config_class: Any, architecture: str, **extra: Any) -> tuple[int, ...]:
        config = ModelConfig.from_dict(raw_config(config_class, architecture, **extra))
        assert config.max_position == SHAPE["max_position_embeddings"]  # served whole
        return config.layer_windows

    assert windows(MistralConfig, "MistralForCausalLM", sliding_window=64) == (64, 64)
    assert windows(MistralConfig, "MistralForCausalLM", sliding_window=None) == ()
    assert windows(MistralConfig, "MistralForCausalLM", sliding_window=512) == ()
    assert windows(Gemma3TextConfig, "Gemma3ForCausalLM", sliding_window=64, num_hidden_layers=7) == (64,) * 5 + (0, 64)
    assert windows(Gemma2Config, "Gemma2ForCausalLM", sliding_window=64, num_hidden_layers=3) == (64, 0, 64)
    assert windows(Qwen2Config, "Qwen2ForCausalLM", sliding_window=64, use_sliding_window=False) == ()
    asked = windows(Qwen2Config, "Qwen2ForCausalLM", sliding_window=64, use_sliding_window=True, max_window_layers=1)
    assert asked == (0, 64)
    qwen2 = raw_config(Qwen2Config, "Qwen2ForCausalLM", sliding_window=64)
    del qwen2["use_sliding_window"], qwen2["layer_types"]  # an older config: transformers' Qwen2 leaves its window off
    assert ModelConfig.from_dict(qwen2).layer_windows == ()


def test_generation_config_adds_its_end_of_sequence_ids(tiny_model, tmp_path):
    """Phi-3's chat turns end with <|end|>, which only generation_config.json names: generation stops there too."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 2]}))
    assert ModelConfig.load(folder).eos_token_ids == (2, 7)


def test_longrope_config_is_read_as_transformers_reads_it():
    """Phi-3-mini-128k's older snapshots name LongRoPE "su"; the top-level pretraining length wins over rope_scaling's,
    and the attention factor follows from the context's stretch over it."""
    from transformers import Phi3Config

    raw = {**raw_config(Phi3Config, "Phi3ForCausalLM"), "rope_parameters": None, "original_max_position_embeddings": 64}
    raw["rope_scaling"] = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 32}
    rope = ModelConfig.from_dict(raw).rope
    assert (rope.kind, rope.original_max_position, rope.long_factor) == ("longrope", 64, (2.0,) * 8)
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(512 / 64) / math.log(64)))


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


def longrope_reference(model_dir, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ids and log-softmax [step, vocab] by its model's forward over a KV cache, the prompt in
    one step, then a token a step: each forward ropes its own rows, with the long factors once the sequence passes
    the pretraining length. (Its `generate` instead drops the cache where a sequence first passes it and recomputes
    it all with the long factors; ringllm, as vLLM and SGLang, keeps the KV it has.)"""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, cache, steps, drawn = torch.tensor([prompt]), DynamicCache(), [], []
    positions = torch.arange(len(prompt))[None]
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits[0, -1].float()
            steps.append(torch.log_softmax(logits, dim=-1))
            ids = logits.argmax()[None, None]
            drawn.append(int(ids))
            positions = positions[:, -1:] + 1
    return drawn, torch.stack(steps)


@pytest.mark.parametrize(("page_size", "mixed_chunk"), [(1, False), (16, True)])
def test_longrope_takes_its_long_factors_where_transformers_does(longrope_phi3, page_size, mixed_chunk):
    """Past a pretraining length of 64: prompts of 30 and 40 tokens decode 48 more across it, and one of 100 tokens
    (whose first 40 are the second's) takes the long factors throughout. The greedy ids of transformers' model
    stepped over its KV cache, and its log-probabilities within 1e-3, over chunked prefill, both times: the second
    from the prefix cache, where the long prompt's KV is kept apart from the others'."""
    long = [(7 * i) % 500 + 3 for i in range(100)]
    prompts = [[(7 * i + 13) % 500 + 3 for i in range(30)], long[:40], long]
    references = [longrope_reference(longrope_phi3, prompt) for prompt in prompts]
    llm = LLM(longrope_phi3, dtype="float32", page_size=page_size, max_prefill_tokens=CHUNK_BUDGET, mixed_chunk=mixed_chunk)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    for attempt in range(2):
        outputs = llm.generate(prompts, params)
        assert attempt == 0 or outputs[2].cached_tokens >= 80, [o.cached_tokens for o in outputs]
        for i, (output, (theirs, logprobs)) in enumerate(zip(outputs, references)):
            for position, top in enumerate(output.logprobs[: divergence(output.token_ids, theirs) + 1]):
                for token, logprob in top.items():
                    assert abs(logprob - logprobs[position, token].item()) < LOGPROB_TOLERANCE, (attempt, i, position, token)
            greedy_matches(output.token_ids, theirs, logprobs)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] -> (blocks [..., rows, cols/32, 16], scales [..., rows, cols/32]) as GPT-OSS ships experts: each
    block of 32 scaled by the power of two that brings its largest value to at most 6, each value rounded to e2m1."""
    from runtime.models.mxfp4 import E2M1

    groups = weight.unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2**-100) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(E2M1)).abs().argmin(-1).to(torch.uint8)  # the nearest code
    return (codes[..., 0::2] | codes[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def test_mxfp4_experts_equal_transformers_on_the_dequantized_weights(tmp_path):
    """GPT-OSS's experts as its checkpoints ship them (MXFP4 blocks and scales, transformers' layout transposed):
    ringllm dequantizes them as they load and gives transformers' tokens and log-probabilities, transformers running
    the same blocks dequantized by its own code into a plain checkpoint."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tests.test_parity import compare

    plain = build("gpt_oss", tmp_path / "plain", intermediate_size=64)
    quantized, dequantized = tmp_path / "mxfp4", tmp_path / "dequantized"
    tensors = load_file(plain / "model.safetensors")
    packed, unpacked = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors[name].transpose(1, 2).contiguous())
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        unpacked[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert (unpacked[name] - tensors[name]).abs().max() > 0  # rounding moved the weights: the test sees which it runs
    config = json.loads((plain / "config.json").read_text())
    for folder, weights, extra in ((quantized, packed, {"quantization_config": {"quant_method": "mxfp4"}}), (dequantized, unpacked, {})):
        folder.mkdir()
        save_file(weights, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
    compare(quantized, 16, True, reference_dir=dequantized)
