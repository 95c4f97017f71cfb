"""Gemma 2 and Gemma 3 (text): the decoder with a norm after attention and after the MLP as well as before each,
a GeGLU MLP (tanh-approximated GELU), embeddings scaled by sqrt(hidden), and norms that scale by 1 + weight
(the weight is stored so and loaded as 1 + weight). Their attention (sliding windows on most layers, Gemma 3's
rope of its own on those, the query_pre_attn_scalar scale, Gemma 2's soft caps) is the config's
(runtime.config, runtime.attention.backend.AttentionSpec)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime.config import ModelConfig
from runtime.distributed import TensorParallel
from runtime.models.decoder import MLP, DecoderForCausalLM, DecoderLayer
from runtime.models.layers import FusedOps, OneRowFusion, RMSNorm, norm_then_linear

# a multimodal checkpoint's text model, as older and newer transformers name it; its vision tower goes unused
TEXT_MODEL = (("language_model.model.", "model."), ("model.language_model.", "model."), ("language_model.lm_head.", "lm_head."))
VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class GemmaDecoderLayer(DecoderLayer):
    one_row_fusable = False  # GeGLU, and norms between the projections

    def __init__(self, cfg: ModelConfig, layer: int, ops: FusedOps, tp: TensorParallel) -> None:
        super().__init__(cfg, layer, ops, tp)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.ops = ops

    def forward_with(
        self, h: torch.Tensor, residual: torch.Tensor | None, attend: Callable[[torch.Tensor], torch.Tensor], fused: OneRowFusion
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each sublayer's output is normed before it joins the residual stream (the next norm's add)."""
        attn, mlp = self.self_attn, self.mlp
        assert isinstance(mlp, MLP)  # Gemma's are dense
        qkv, residual = norm_then_linear(h, residual, self.input_layernorm, attn.qkv_proj)
        h = self.post_attention_layernorm(self.tp.all_reduce(attn.o_proj(attend(qkv))))
        gate_up, residual = norm_then_linear(h, residual, self.pre_feedforward_layernorm, mlp.gate_up_proj)
        out = self.tp.all_reduce(mlp.down_proj(self.ops.gelu_tanh_and_mul(gate_up)))
        return self.post_feedforward_layernorm(out), residual


class GemmaForCausalLM(DecoderForCausalLM):
    layer_class = GemmaDecoderLayer

    def make_rope_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        super().make_rope_cache(device, dtype)
        self.embed_scale = float(torch.tensor(self.config.hidden_size**0.5, dtype=dtype))  # as transformers rounds it

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(VISION):
            return None
        for old, new in TEXT_MODEL:
            if name.startswith(old):
                return new + name.removeprefix(old)
        return name

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor + 1 if name.endswith("norm.weight") else tensor
