"""Weights into the model: safetensors from a Hugging Face folder, or random weights of the
config's shape for benchmarks."""

from __future__ import annotations

from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from torch import nn

from runtime.config import ModelConfig
from runtime.layers import select_fused_ops
from runtime.models import MODELS

log = structlog.get_logger()


def build_model(cfg: ModelConfig, model_dir: Path, dtype: torch.dtype, device: torch.device, dummy: bool) -> nn.Module:
    if cfg.architecture not in MODELS:
        raise ValueError(f"architecture {cfg.architecture} is not supported; supported: {sorted(MODELS)}")
    ops_name, ops = select_fused_ops(device, dtype)
    log.info("fused_ops", ops=ops_name)
    with torch.device("meta"):  # no time spent initialising weights that are overwritten next
        model = MODELS[cfg.architecture](cfg, ops)
    model.fused_ops = ops_name
    model.to_empty(device=device)
    model.to(dtype)
    model.tie_weights()
    if dummy:
        _random_weights(model)
    else:
        _load_safetensors(model, model_dir)
    return model.eval()


def _load_safetensors(model: nn.Module, model_dir: Path) -> None:
    params = dict(model.named_parameters())  # tied weights appear once
    missing = set(params)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in params:
                        params[name].copy_(f.get_tensor(name))
                        missing.discard(name)
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {sorted(missing)[:5]}")
    log.info("weights_loaded", model_dir=str(model_dir), files=len(files))


def _random_weights(model: nn.Module) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=torch.Generator(device=param.device).manual_seed(len(name)))
