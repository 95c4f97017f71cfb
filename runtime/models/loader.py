"""Weights into the model: safetensors from a Hugging Face folder, or random ones for benchmarks."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors import safe_open
from torch import nn

from runtime.config import Fp8Config, ModelConfig
from runtime.distributed import SINGLE, TensorParallel
from runtime.models.cpu_linears import prepack_linears
from runtime.models.decoder import STACKED, DecoderForCausalLM
from runtime.models.fp8 import SCALE_SUFFIX, dequantize_blockwise, quantize_per_channel, scale_name, use_fp8_linears
from runtime.models.layers import select_fused_ops
from runtime.models.moe import EXPERT_PARTS, Experts
from runtime.models.mxfp4 import MXFP4_BLOCKS, MXFP4_SCALES, dequantize_mxfp4
from runtime.models.registry import MODELS
from runtime.models.sharding import read_shard

log = structlog.get_logger()
# recomputed; or the tied embedding's copy; an FP8 KV cache's scales (runtime.models.fp8.kv_scales reads them)
IGNORED = ("rotary_emb.inv_freq", "lm_head.weight", "self_attn.k_scale", "self_attn.v_scale")
EXPERT_WEIGHT = re.compile(rf"(.+\.experts)\.(\d+)\.({'|'.join(EXPERT_PARTS)})\.weight$")


def build_model(
    cfg: ModelConfig,
    model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    dummy: bool,
    fused_ops: str | None = None,
    tp: TensorParallel = SINGLE,
    quantization: str | None = None,
    adapt: Callable[[nn.Module], None] | None = None,
) -> DecoderForCausalLM:
    """The model on `device`, holding this rank's shard of every weight; with quantization "fp8", a
    checkpoint that is not FP8 already has its projections rounded through per-row FP8 (each rank its
    shard's rows). `adapt`: called with the model once its weights are in, before any projection is
    replaced (LoRA's wrappers, runtime.models.lora)."""
    if cfg.architecture not in MODELS:
        raise ValueError(f"architecture {cfg.architecture} is not supported; supported: {sorted(MODELS)}")
    ops_name, ops = select_fused_ops(device, dtype, fused_ops)
    log.info("fused_ops", ops=ops_name, rope_kv_write="triton" if ops.rope_kv_write else None)
    with torch.device("meta"):  # no time spent initialising weights that are overwritten next
        model = MODELS[cfg.architecture](cfg, ops, tp)
    model.fused_ops = ops_name
    model.to(dtype)  # on meta, so that memory is taken once in the model's dtype, not first in float32
    # to_empty's empty_like on meta tensors runs torch's reference ops, which import sympy into every engine process
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    for buffer in model.buffers():  # counters; to_empty left them unset
        buffer.zero_()
    model.requires_grad_(False)
    model.tie_weights()
    if dummy:
        _random_weights(model)
    else:
        _load_safetensors(model, model_dir, lambda name, source: read_shard(name, source, cfg, tp), cfg.fp8)
    if adapt is not None:
        adapt(model)
    if device.type == "cuda" and (cfg.fp8 is not None or quantization == "fp8"):  # one byte a weight, FP8 GEMMs
        log.info("fp8_linears", projections=use_fp8_linears(model, cfg.fp8.weight_block if cfg.fp8 else None))
        torch.cuda.empty_cache()  # the bf16 weights' memory goes back to the device, for the KV pool
    elif quantization == "fp8" and cfg.fp8 is None:
        log.info("fp8_weights", projections=quantize_per_channel(model))
    model.make_rope_cache(device, dtype)
    if device.type == "cpu":
        log.info("cpu_linears", kind=prepack_linears(model, dtype))
    return model.eval()


def _load_safetensors(model: DecoderForCausalLM, model_dir: Path, shard: Callable[[str, Any], torch.Tensor], fp8: Fp8Config | None) -> None:
    """Each tensor through `shard` (name, safetensors slice) -> what this rank keeps of it. An FP8
    checkpoint's quantized weights are dequantized whole with their block scales, then sharded. A draft
    head's checkpoint may be a pytorch_model.bin instead."""
    params = dict(model.named_parameters())  # tied weights appear once
    shared = set(model.shared_with_target)
    shards: dict[str, tuple[int, ...]] = {
        f"{prefix}.{kind}": module.shard_sizes  # pyright: ignore[reportAssignmentType]  # set by the layers (decoder.py)
        for prefix, module in model.named_modules()
        if hasattr(module, "shard_sizes")
        for kind in ("weight", "bias")
        if f"{prefix}.{kind}" in params
    }
    experts = {prefix: module for prefix, module in model.named_modules() if isinstance(module, Experts)}

    def destination(name: str) -> tuple[str, torch.Tensor] | None:
        """Where a checkpoint tensor goes: its parameter, or its rows of a stacked one."""
        if name in params:
            return name, params[name]
        if (expert := EXPERT_WEIGHT.match(name)) and expert[1] in experts:
            return name, experts[expert[1]].slot(int(expert[2]), expert[3])
        for part, (stacked, index) in STACKED.items():
            target = name.replace(f".{part}.", f".{stacked}.")
            if target != name and target in shards:
                sizes = shards[target]
                return f"{target}#{index}", params[target].narrow(0, sum(sizes[:index]), sizes[index])
        return None

    missing = {f"{name}#{i}" for name, sizes in shards.items() for i in range(len(sizes))}
    # experts a checkpoint holds one by one (not stacked as the model holds them): each expert's parts are needed
    apart = {prefix: module for prefix, module in experts.items() if not module.stacked}
    stacked_experts = {f"{prefix}.{kind}" for prefix in apart for kind in ("gate_up_proj", "down_proj")}
    optional = set(model.optional_weights)
    missing |= set(params) - set(shards) - stacked_experts - shared - optional
    loaded: set[str] = set()
    for prefix, module in apart.items():
        missing |= {f"{prefix}.{e}.{part}.weight" for e in range(module.num_experts) for part in EXPERT_PARTS}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files and model.shared_with_target:  # a draft head: maybe a pytorch_model.bin, whole or in shards
        files = sorted(model_dir.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    unknown = []
    with torch.no_grad(), contextlib.ExitStack() as stack:
        handles = [_BinFile(file) if file.suffix == ".bin" else stack.enter_context(safe_open(str(file), framework="pt")) for file in files]
        # a quantized weight's block scales, wherever they sit (another file of the checkpoint may hold them)
        suffix = MXFP4_SCALES if model.config.mxfp4 else SCALE_SUFFIX if fp8 is not None else None
        scales = {name: f for f in handles for name in f.keys() if name.endswith(suffix)} if suffix else {}

        def read(name: str, f: Any) -> Any:
            if name.endswith(MXFP4_BLOCKS):  # GPT-OSS's experts: e2m1 values and their power-of-two scales, as bf16 would hold them
                scale = name.removesuffix(MXFP4_BLOCKS) + MXFP4_SCALES
                return dequantize_mxfp4(f.get_tensor(name), scales[scale].get_tensor(scale)).transpose(1, 2)
            source = f.get_slice(name)
            if source.get_dtype() != "F8_E4M3":
                return source
            if fp8 is None or scale_name(name) not in scales:
                raise ValueError(f"{name} in {model_dir} is FP8 without block scales (config.json's quantization_config)")
            return dequantize_blockwise(f.get_tensor(name), scales[scale_name(name)].get_tensor(scale_name(name)), fp8.weight_block)

        for f in handles:
            for stored in f.keys():
                if stored in scales:  # read with its weight (read), under the checkpoint's own name
                    continue
                if (name := model.checkpoint_name(stored.removesuffix(MXFP4_BLOCKS))) is None or name in shared:
                    continue
                for part, source in _unfused(name, read(stored, f), model.config):
                    if (found := destination(part)) is not None:
                        key, target = found
                        target.copy_(model.checkpoint_tensor(part, shard(part, source)))
                        missing.discard(key)
                        loaded.add(key)
                    elif not part.endswith(IGNORED):
                        unknown.append(part)
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {sorted(missing)[:5]}")
    for name in optional - loaded:
        params[name].zero_()
    if unknown:  # a tensor the model has no place for would be silently lost: a wrong model
        raise ValueError(f"{model_dir} has weights this model does not use: {sorted(unknown)[:5]}")
    log.info("weights_loaded", model_dir=str(model_dir), files=len(files))


def _unfused(name: str, source: Any, cfg: ModelConfig) -> list[tuple[str, Any]]:
    """A checkpoint tensor as the parts other checkpoints name: Phi-3's fuse q, k and v (`qkv_proj`), and gate
    and up (`gate_up_proj`), each into one; they are split by rows, so that every rank takes its shard of each."""
    prefix, fused, kind = name.rsplit(".", 2) if name.count(".") >= 2 else (name, "", "")
    if fused == "qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    elif fused == "gate_up_proj" and ".experts" not in prefix:
        sizes = {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
    else:
        return [(name, source)]
    whole, start, parts = source[:], 0, []
    for part, rows in sizes.items():
        parts.append((f"{prefix}.{part}.{kind}", whole[start : start + rows]))
        start += rows
    return parts


def _random_weights(model: nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias") or not param.is_floating_point():  # an index table (an EAGLE-3 head's d2t): no offsets
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=torch.Generator(device=param.device).manual_seed(len(name)))


class _BinFile:
    """A pytorch_model.bin, read whole, in the calls made here of a safetensors handle (EAGLE heads ship so)."""

    def __init__(self, path: Path) -> None:
        self.tensors: dict[str, torch.Tensor] = torch.load(path, map_location="cpu", weights_only=True)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_slice(self, name: str) -> _BinSlice:
        return _BinSlice(self.tensors[name])

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class _BinSlice:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def get_dtype(self) -> str:
        return str(self.tensor.dtype)

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index]
