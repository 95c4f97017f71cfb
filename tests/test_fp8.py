"""FP8 on CPU. Block-quantized FP8 checkpoints (the Qwen3-*-FP8 format), dequantized at load, give
the greedy tokens of transformers running the same dequantized weights, for Qwen3 and Llama shapes
whose dimensions are not multiples of the 128 block; also split over two ranks. --quantization fp8
gives the tokens of transformers running per-row FP8-rounded projections. A quantized weight
without its scales, and a quantization method ringllm does not run, are refused. An FP8 KV cache
gives the tokens of transformers whose keys and values are rounded to float8 (served: tests/test_moe.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import LLM, SamplingParams
from runtime.config import ModelConfig
from tests.test_parity import compare
from tests.tiny_models import build

BLOCK = 128
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# Phi-3's fused q/k/v and gate/up are dequantized whole, then split; Mixtral's experts keep their own names
SHAPES = {arch: dict(hidden_size=96, intermediate_size=200) for arch in ("qwen3", "llama", "phi3", "mixtral", "deepseek_v3")}
QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, per-128x128-block scale_inv, the weight they dequantize to), partial blocks at the edges."""
    rows, cols = weight.shape
    blocks = (-(-rows // BLOCK), -(-cols // BLOCK))
    padded = torch.zeros(blocks[0] * BLOCK, blocks[1] * BLOCK)
    padded[:rows, :cols] = weight
    tiles = padded.view(blocks[0], BLOCK, blocks[1], BLOCK)
    scale_inv = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    spread = scale_inv[:, None, :, None]
    fp8 = (tiles / spread).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    dequantized = (fp8.float() * spread).view_as(padded)[:rows, :cols]
    return fp8.view_as(padded)[:rows, :cols].contiguous(), scale_inv, dequantized.contiguous()


def quantize_checkpoint(source: Path, fp8_dir: Path, dequantized_dir: Path) -> None:
    """`source`'s projections as an FP8 checkpoint, and as the plain fp32 weights that checkpoint means."""
    quantized, plain = {}, {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight", "_mqa.weight")):  # the last: MLA's latent
            fp8, scale_inv, tensor = quantize(tensor)
            quantized[name], quantized[name.removesuffix("weight") + "weight_scale_inv"] = fp8, scale_inv
        else:
            quantized[name] = tensor
        plain[name] = tensor
    config = json.loads((source / "config.json").read_text())
    for folder, weights, extra in ((fp8_dir, quantized, {"quantization_config": QUANTIZATION}), (dequantized_dir, plain, {})):
        folder.mkdir()
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    found = {}
    for arch, shape in SHAPES.items():
        root = tmp_path_factory.mktemp(f"fp8-{arch}")
        quantize_checkpoint(build(arch, root / "source", **shape), root / "fp8", root / "dequantized")
        found[arch] = root / "fp8", root / "dequantized"
    return found


@pytest.mark.parametrize(("page_size", "mixed_chunk"), [(1, False), (16, True)])
@pytest.mark.parametrize("arch", list(SHAPES))
def test_fp8_checkpoint_gives_the_tokens_of_its_dequantized_weights(checkpoints, arch, page_size, mixed_chunk):
    fp8_dir, dequantized_dir = checkpoints[arch]
    assert ModelConfig.load(fp8_dir).fp8 is not None
    near_ties = compare(fp8_dir, page_size, mixed_chunk, passes=2, reference_dir=dequantized_dir)
    print(f"FP8 {arch} page {page_size}: near-ties {near_ties}")


@pytest.mark.slow
def test_fp8_checkpoint_split_over_two_ranks(checkpoints):
    fp8_dir, _ = checkpoints["qwen3"]
    prompts = [[(7 * i + j) % 500 + 3 for i in range(30)] for j in range(3)]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    one = [o.token_ids for o in LLM(fp8_dir, dtype="float32").generate(prompts, greedy)]
    two = LLM(fp8_dir, dtype="float32", tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in two.generate(prompts, greedy)] == one
    finally:
        two.close()


def test_quantization_fp8_gives_the_tokens_of_per_row_fp8_weights(tiny_model, tmp_path):
    """--quantization fp8 on a float checkpoint: transformers running the projections rounded through
    FP8 with one scale per row (max |w| / 448), rounded here by the test's own arithmetic."""
    source = tiny_model("qwen3")
    weights = load_file(source / "model.safetensors")
    for name, weight in weights.items():
        if name.endswith("proj.weight"):
            scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
            weights[name] = (weight / scale).to(torch.float8_e4m3fn).float() * scale
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    near_ties = compare(source, 16, True, reference_dir=tmp_path, quantization="fp8")
    print(f"--quantization fp8: near-ties {near_ties}")


def test_an_fp8_weight_without_scales_is_refused(checkpoints, tmp_path):
    fp8_dir, _ = checkpoints["llama"]
    weights = load_file(fp8_dir / "model.safetensors")
    del weights["model.layers.0.mlp.up_proj.weight_scale_inv"]
    (tmp_path / "config.json").write_text((fp8_dir / "config.json").read_text())
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight .*FP8 without block scales"):
        LLM(tmp_path, dtype="float32")


@pytest.mark.parametrize(
    ("quantization", "message"),
    [({"quant_method": "awq"}, "'awq' is not supported"), ({**QUANTIZATION, "activation_scheme": "static"}, "static activation")],
)
def test_an_unsupported_quantization_is_refused(checkpoints, tmp_path, quantization, message):
    config = json.loads((checkpoints["llama"][0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError, match=message):
        ModelConfig.load(tmp_path)


@pytest.mark.parametrize(("page_size", "mixed_chunk"), [(1, False), (16, True)])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fp8_kv_cache_gives_the_tokens_of_transformers_over_fp8_rounded_kv(tiny_model, arch, page_size, mixed_chunk):
    """The pool stores float8_e4m3fn and attention reads it back: the tokens of transformers whose
    keys and values are rounded to float8 (tests/test_parity.py::fp8_kv_sdpa), the second pass from
    the prefix cache."""
    near_ties = compare(tiny_model(arch), page_size, mixed_chunk, passes=2, kv_cache_dtype="fp8_e4m3")
    print(f"FP8 KV {arch} page {page_size}: near-ties {near_ties}")


def test_fp8_kv_cache_holds_more_tokens_in_the_same_bytes_and_applies_checkpoint_scales(tiny_model, tmp_path):
    """k_scale / v_scale of 0.3 and 0.7 (not powers of two: they change what rounds where) on layer 1:
    the tokens of transformers storing layer 1's keys and values divided by them."""
    plain = LLM(tiny_model("qwen3"), dtype="float32")
    for item in tiny_model("qwen3").iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.1.self_attn.k_scale"] = torch.tensor(0.3)
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor(0.7)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    fp8 = LLM(tmp_path, dtype="float32", kv_cache_dtype="fp8")
    assert fp8.engine.num_pages == 4 * plain.engine.num_pages  # float32 -> float8 pages, the same bytes
    assert fp8.engine.pool.kv[0].dtype == torch.float8_e4m3fn
    assert [value for pair in fp8.engine.pool.scales for value in pair] == pytest.approx([1.0, 1.0, 0.3, 0.7])
    near_ties = compare(tmp_path, 16, True, kv_cache_dtype="fp8")
    print(f"FP8 KV with checkpoint scales: near-ties {near_ties}")


def test_an_unknown_kv_cache_dtype_is_refused():
    from runtime.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")
