"""The decoder family: Llama (Llama-3, SmolLM2), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), and
Qwen3-MoE (Qwen3 whose sparse layers' MLP is runtime.models.moe.SparseMoe).
q, k and v share one projection, gate and up another (`STACKED` maps the checkpoint's matrices).
Under tensor parallelism each rank builds its shard (runtime.models.sharding) and sums the
row-parallel projections' partial outputs with one all-reduce each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from runtime.attention.backend import AttentionBackend
from runtime.batch import ForwardBatch, StepAbandoned, rows_of
from runtime.config import ModelConfig
from runtime.distributed import TensorParallel
from runtime.kernels.rope import Rope
from runtime.models.layers import NO_FUSION, FusedOps, OneRowFusion, RMSNorm, norm_then_linear, rope_cos_sin_cache
from runtime.models.mla import MlaAttention
from runtime.models.moe import SparseMoe
from runtime.models.sharding import vocab_shard

# checkpoint name part -> (our parameter name part, shard index)
# checkpoint names -> these modules' names, by architecture: Mixtral's sparse MLP and its experts' projections
CHECKPOINT_RENAMES = {
    "MixtralForCausalLM": ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj.")),
    "GptOssForCausalLM": ((".mlp.router.", ".mlp.gate."),),
    "DeepseekV3ForCausalLM": ((".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"),),
}
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "q_a_proj": ("qkv_proj", 0),  # MLA's projections of the normed rows: q's (low-rank or whole) and the latent's
    "kv_a_proj_with_mqa": ("qkv_proj", 1),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: FusedOps, tp: TensorParallel) -> None:
        super().__init__()
        self.layer, self.head_dim = layer, cfg.head_dim
        self.heads, self.kv_heads = tp.split(cfg.num_heads)[1], tp.split(cfg.num_kv_heads)[1]  # this rank's
        self.q_size, self.kv_size = self.heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # torch types Module.__setattr__'s value as Tensor | Module, though any value may be set
        self.qkv_proj.shard_sizes = (self.q_size, self.kv_size, self.kv_size)  # pyright: ignore[reportArgumentType]
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.output_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
        self.qk_norm, self.ops, self.eps = cfg.qk_norm, ops, cfg.rms_norm_eps
        self.windowed = bool(cfg.layer_windows) and cfg.layer_windows[layer] > 0  # its K and V live in the window pool
        # GPT-OSS: a logit per head that joins each softmax (this rank's heads)
        self.sinks = nn.Parameter(torch.empty(self.heads)) if cfg.attention_sinks else None

    def attend(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, Any], batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """[T, heads · dim] before o_proj; the new K and V reach the pool first. rope: (positions, tables)."""
        positions, rope_tables = rope
        tokens, rows = qkv.shape[0], rows_of(batch.kv_rows, self.windowed)
        qk = qkv[:, : self.q_size + self.kv_size].view(tokens, self.heads + self.kv_heads, self.head_dim)
        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        if self.ops.rope_kv_write is not None and backend.rotates:  # decode attention does the rope pass's work itself
            return backend.forward(self.layer, qkv.view(tokens, -1, self.head_dim), batch, Rope(rope_tables, *norms, self.eps)).reshape(
                tokens, self.q_size
            )
        if self.ops.rope_kv_write is not None:
            self.ops.rope_kv_write(
                qkv,
                positions,
                rope_tables,
                *norms,
                self.eps,
                backend.pool.rows(self.layer),
                rows,
                self.heads,
                self.kv_heads,
                backend.pool.scales[self.layer],
            )
        else:
            if self.qk_norm:  # per-head norms, written back for the in-place rotation
                qk[:, : self.heads], qk[:, self.heads :] = self.q_norm(qk[:, : self.heads]), self.k_norm(qk[:, self.heads :])
            self.ops.rope(positions, qk, self.heads, rope_tables)
            backend.pool.write(self.layer, qkv[:, self.q_size :].view(tokens, 2, self.kv_heads, self.head_dim), rows)
        return backend.forward(self.layer, qk[:, : self.heads], batch, sinks=self.sinks).reshape(tokens, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: FusedOps, tp: TensorParallel, intermediate_size: int | None = None) -> None:
        """`intermediate_size`: where not the config's (DeepSeek-V3's shared experts)."""
        super().__init__()
        intermediate = tp.split(intermediate_size or cfg.intermediate_size)[1]
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * intermediate, bias=False)
        self.gate_up_proj.shard_sizes = (intermediate, intermediate)  # pyright: ignore[reportArgumentType]  # see Attention
        self.down_proj = nn.Linear(intermediate, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial output for normed rows."""
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))

    def forward_normed(
        self, h: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, fused: OneRowFusion
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's partial output for norm(h + residual), the new residual)."""
        gate_up, residual = (fused.gate_up or norm_then_linear)(h, residual, norm, self.gate_up_proj)
        if fused.down is not None:
            return fused.down(gate_up, self.down_proj, None), residual
        return self.down_proj(self.ops.silu_and_mul(gate_up)), residual


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding; the ranks' lookups summed (each id is found on one rank)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        self.first, rows = vocab_shard(cfg.vocab_size, tp)
        super().__init__(rows, cfg.hidden_size)
        self.tp = tp

    def reset_parameters(self) -> None:
        """Nothing: the rows come from the checkpoint or the loader's random weights. (nn.Embedding's normal_
        on the meta device, where the model is built, would import torch._dynamo into every engine process.)"""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.first
        elsewhere = (local < 0) | (local >= self.num_embeddings)
        found = F.embedding(local.masked_fill(elsewhere, 0), self.weight).masked_fill_(elsewhere[:, None], 0)
        return self.tp.all_reduce(found)


class DecoderLayer(nn.Module):
    one_row_fusable = True  # its norm→qkv, norm→gate_up and SiLU→down pairs are what OneRowFusion fuses

    def __init__(self, cfg: ModelConfig, layer: int, ops: FusedOps, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = MlaAttention(cfg, layer, ops, tp) if cfg.mla is not None else Attention(cfg, layer, ops, tp)
        self.mlp = SparseMoe(cfg, ops, tp) if cfg.moe is not None and cfg.moe.is_sparse(layer) else MLP(cfg, ops, tp)
        if isinstance(self.mlp, SparseMoe) and cfg.moe is not None and cfg.moe.shared_intermediate:
            self.mlp.shared_experts = MLP(cfg, ops, tp, cfg.moe.shared_intermediate)
        self.tp = tp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.one_row = NO_FUSION

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, Any], batch: ForwardBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h: the previous layer's output, not yet added to `residual` (None where there is none)."""
        fused = self.one_row if h.shape[0] == 1 else NO_FUSION
        return self.forward_with(h, residual, lambda qkv: self.self_attn.attend(qkv, rope, batch, backend), fused)

    def forward_with(
        self, h: torch.Tensor, residual: torch.Tensor | None, attend: Callable[[torch.Tensor], torch.Tensor], fused: OneRowFusion
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward, with attention as `attend` (qkv -> attended rows): how start-up times a fusion.
        The summed stream adds the residual inside o_proj and down_proj: one rank only (Engine)."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = (fused.qkv or norm_then_linear)(h, residual, self.input_layernorm, attn.qkv_proj)
        attended = attend(qkv)
        if fused.o_proj is not None:  # the summed stream: no residual is handed on
            h = fused.o_proj(attended, attn.o_proj, residual)
            # the summed stream sets every fusion, and only over dense layers, whose mlp is an MLP
            gate_up, _ = fused.gate_up(h, None, self.post_attention_layernorm, mlp.gate_up_proj)  # pyright: ignore[reportOptionalCall, reportArgumentType]
            return fused.down(gate_up, mlp.down_proj, h), None  # pyright: ignore[reportOptionalCall, reportArgumentType]
        h = self.tp.all_reduce(attn.o_proj(attended))
        out, residual = mlp.forward_normed(h, residual, self.post_attention_layernorm, fused)
        return self.tp.all_reduce(out), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: FusedOps, tp: TensorParallel, layer: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg, tp)
        self.layers = nn.ModuleList(layer(cfg, i, ops, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class DecoderForCausalLM(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer
    embed_scale: float | None = None  # the embeddings' factor (Gemma's sqrt(hidden), in the model's dtype)
    fused_ops: str  # the name of the fused ops it runs with, which build_model sets
    shared_with_target: tuple[str, ...] = ()  # a draft head's parameters that are its target's (not in its checkpoint)
    optional_weights: tuple[str, ...] = ()  # a draft head's parameters its checkpoint may leave out (then zeros)
    capture: tuple[int, ...] = ()  # for an EAGLE-3 head: layers whose input (the hidden state so far) forward keeps
    captured: torch.Tensor  # ... side by side, in capture's order (index len(layers): the last layer's output)

    def __init__(self, cfg: ModelConfig, ops: FusedOps, tp: TensorParallel) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = DecoderModel(cfg, ops, tp, self.layer_class)
        self.lm_head = nn.Linear(cfg.hidden_size, self.model.embed_tokens.num_embeddings, bias=False)
        self.rope_cache_fp32, self.rope_tables = ops.rope_cache_fp32, ops.rope_tables

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_rope_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        """The rope tables (and the sliding-window layers' own, where they differ), in the kernels' dtype."""
        cfg = self.config
        caches = [rope_cos_sin_cache(cfg.max_position, cfg.rope_dim, rope) for rope in (cfg.rope, cfg.local_rope) if rope is not None]
        self.rope_caches = [cache.to(device=device, dtype=torch.float32 if self.rope_cache_fp32 else dtype) for cache in caches]
        self.rope_cache = self.rope_caches[0]
        # each layer's table: the second for a windowed layer, where there is one
        self.layer_rope = [int(len(caches) > 1 and bool(cfg.layer_windows) and cfg.layer_windows[i] > 0) for i in range(cfg.num_layers)]

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        h, residual = self.model.embed_tokens(batch.input_ids), None
        if self.embed_scale is not None:
            h = h * self.embed_scale
        ropes = [(batch.positions, self.rope_tables(batch.positions, cache)) for cache in self.rope_caches]
        states: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.model.layers):
            if index in self.capture:
                states[index] = h if residual is None else h + residual
            if batch.before_layer is not None:
                batch.before_layer(index)
            h, residual = layer(h, residual, ropes[self.layer_rope[index]], batch, backend)
            if batch.between_layers is not None and batch.between_layers():
                raise StepAbandoned
        if self.capture:
            states[len(self.model.layers)] = h if residual is None else h + residual
            self.captured = torch.cat([states[index] for index in self.capture], dim=-1)
        return self.model.norm(h) if residual is None else self.model.norm(h, residual)[0]

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into, by its name there (a draft head's differ); None: unused."""
        for old, new in CHECKPOINT_RENAMES.get(self.config.architecture, ()):
            name = name.replace(old, new)
        return name

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as this model holds it (by its parameter's name): as it is."""
        return tensor

    def take_expert_load(self) -> tuple[list[int], torch.Tensor] | None:
        """(the sparse layers, tokens per expert [layers, experts]) since the last call; None when dense."""
        sparse = [(index, layer.mlp) for index, layer in enumerate(self.model.layers) if isinstance(layer.mlp, SparseMoe)]
        if not sparse:
            return None
        return [index for index, _ in sparse], torch.stack([mlp.take_load() for _, mlp in sparse])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """In the model's dtype: the sampler widens only what it must. Every rank gets all of them."""
        logits = (
            self.lm_head(hidden) if self.tp.size == 1 else self.tp.all_gather_columns(self.lm_head(hidden))[:, : self.config.vocab_size]
        )
        if (cap := self.config.final_softcap) is not None:  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        return logits
