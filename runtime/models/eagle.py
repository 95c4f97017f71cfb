"""EAGLE draft heads: a decoder layer that guesses the target's next token from the target's hidden state (its
feature) at a position and the embedding of the token after it (runtime.engine.engine.EagleDraft runs them).
Each head keeps the hidden state it hands on as the feature of its next row (`next_features`).

EAGLE (1 and 2): `fc` over [embedding, feature] (2h -> h, with bias), then the layer, whose input norm is left
out; the output goes to the target's lm_head as it is. The feature is the target's last hidden state, normed.
EAGLE-3: the target's feature is three of its layers' hidden states side by side (3h), which `fc` fuses (no
bias); the layer's attention reads [norm(embedding), norm(feature)] (2h); the output, normed, feeds the head's
own lm_head over a smaller draft vocabulary whose ids `d2t` maps to the target's.
Checkpoints load under their published names (EAGLE: `fc.*`, `layers.0.*`, in safetensors or
pytorch_model.bin; EAGLE-3: `midlayer.*`, `fc.*`, `norm.*`, `lm_head.*`, `d2t`); the embedding, and EAGLE's
lm_head, are the target's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.attention.backend import AttentionBackend
from runtime.batch import ForwardBatch
from runtime.config import ModelConfig
from runtime.distributed import TensorParallel
from runtime.models.decoder import Attention, DecoderForCausalLM, DecoderLayer
from runtime.models.layers import NO_FUSION, FusedOps, RMSNorm


class _NoNorm(nn.Module):
    """EAGLE's layer 0 reads its input unnormed; RMSNorm's signature, adding the residual where given."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return x
        summed = x + residual
        return summed, summed


class EagleHead(DecoderForCausalLM):
    shared_with_target = ("model.embed_tokens.weight", "lm_head.weight")

    def __init__(self, cfg: ModelConfig, ops: FusedOps, tp: TensorParallel) -> None:
        super().__init__(cfg, ops, tp)
        del self.model.norm  # the output goes to the target's lm_head unnormed
        self.model.layers[0].input_layernorm = _NoNorm()
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.features: torch.Tensor | None = None  # the rows' features, set before each forward (None: zeros)
        self.next_features = torch.empty(0)

    def checkpoint_name(self, name: str) -> str | None:
        return name if name.startswith(("fc.", "lm_head.")) else f"model.{name}"

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        embeds = self.model.embed_tokens(batch.input_ids)
        features = embeds.new_zeros(embeds.shape) if self.features is None else self.features
        h, residual = self.fc(torch.cat([embeds, features], dim=-1)), None
        rope = (batch.positions, self.rope_tables(batch.positions, self.rope_cache))
        for layer in self.model.layers:
            h, residual = layer(h, residual, rope, batch, backend)
        self.next_features = h if residual is None else h + residual
        return self.next_features


class Eagle3Layer(DecoderLayer):
    """A decoder layer whose attention reads [norm(embedding), norm(feature)]; the residual is the feature."""

    def __init__(self, cfg: ModelConfig, ops: FusedOps, tp: TensorParallel) -> None:
        super().__init__(cfg, 0, ops, tp)
        attn = self.self_attn
        assert isinstance(attn, Attention)  # a draft head's attention is plain
        attn.qkv_proj = nn.Linear(2 * cfg.hidden_size, attn.q_size + 2 * attn.kv_size, bias=cfg.attention_bias)
        attn.qkv_proj.shard_sizes = (attn.q_size, attn.kv_size, attn.kv_size)  # pyright: ignore[reportArgumentType]  # see Attention
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward_pair(
        self, embeds: torch.Tensor, features: torch.Tensor, rope: tuple[torch.Tensor, Any], batch: ForwardBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's output, not yet added to the residual; the residual)."""
        attn = self.self_attn
        pair = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)  # pyright: ignore[reportArgumentType]  # one tensor without a residual
        h = attn.o_proj(attn.attend(attn.qkv_proj(pair), rope, batch, backend))
        return self.mlp.forward_normed(h, features, self.post_attention_layernorm, NO_FUSION)  # pyright: ignore[reportCallIssue]  # an MLP: heads are dense


class Eagle3Head(DecoderForCausalLM):
    shared_with_target = ("model.embed_tokens.weight",)
    optional_weights = ("d2t",)  # a head over the whole vocabulary has none

    def __init__(self, cfg: ModelConfig, ops: FusedOps, tp: TensorParallel) -> None:
        super().__init__(cfg, ops, tp)
        self.model.layers = nn.ModuleList([Eagle3Layer(cfg, ops, tp)])
        draft_vocab = cfg.draft_vocab_size or cfg.vocab_size
        self.lm_head = nn.Linear(cfg.hidden_size, draft_vocab, bias=False)
        self.fc = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
        # a draft id's offset to its target id; a parameter so that the loader fills it
        self.d2t = nn.Parameter(torch.zeros(draft_vocab, dtype=torch.int64), requires_grad=False)
        self.features: torch.Tensor | None = None
        self.next_features = torch.empty(0)

    def tie_weights(self) -> None:
        """The head's lm_head is its own (over the draft vocabulary)."""

    def checkpoint_name(self, name: str) -> str | None:
        if name == "t2d":  # the inverse of d2t, as a mask over the target's vocabulary
            return None
        if name.startswith("midlayer."):
            return "model.layers.0." + name.removeprefix("midlayer.")
        return name if name.startswith(("fc.", "lm_head.", "d2t")) else f"model.{name}"

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        embeds = self.model.embed_tokens(batch.input_ids)
        features = embeds.new_zeros(embeds.shape) if self.features is None else self.features
        if features.shape[-1] != embeds.shape[-1]:  # the target's three layers: fused first
            features = self.fc(features)
        rope = (batch.positions, self.rope_tables(batch.positions, self.rope_cache))
        layer: Eagle3Layer = self.model.layers[0]  # pyright: ignore[reportAssignmentType]
        h, residual = layer.forward_pair(embeds, features, rope, batch, backend)
        normed, self.next_features = self.model.norm(h, residual)  # pyright: ignore[reportGeneralTypeIssues]  # with a residual: a pair
        return normed

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Over the target's vocabulary: the draft vocabulary's at their target ids, -inf elsewhere."""
        draft = self.lm_head(hidden)
        full = draft.new_full((hidden.shape[0], self.config.vocab_size), float("-inf"))
        full[:, torch.arange(draft.shape[1], device=draft.device) + self.d2t] = draft
        return full


def aux_layers(head: ModelConfig, target_layers: int) -> tuple[int, ...]:
    """EAGLE-3: the target layers whose input (the hidden state after the layer before) the head reads:
    the head's config's, else SGLang's default (2, L/2, L-3)."""
    if head.eagle_aux_layers is not None:
        return tuple(layer + 1 for layer in head.eagle_aux_layers)
    return (2, target_layers // 2, target_layers - 3)
