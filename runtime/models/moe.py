"""Qwen3-MoE's sparse block (Mixtral's and GPT-OSS's alike): a router picks top_k of num_experts gated MLPs
for each token and weighs their outputs by its softmax. GPT-OSS adds biases to the router and the experts and
gates with a clamped SwiGLU; its checkpoints stack each layer's experts as transformers does (Experts.stacked).
The experts' weights are stacked, [experts, rows, cols]. Tokens are grouped by expert and each active expert
runs one GEMM pair over its tokens; on CUDA, the fused kernels of runtime.kernels.triton.fused_moe do it without
a host sync. Under tensor parallelism each rank holds every expert's slice of the intermediate dimension and
the whole router; the decoder layer's all-reduce sums the ranks' partial outputs."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import ModelConfig
from runtime.distributed import TensorParallel
from runtime.models.layers import FusedOps, OneRowFusion, RMSNorm, norm_then_linear

EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")  # a checkpoint's experts.{e}.{part}.weight


def route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in the logits' dtype, expert ids [T, top_k]): Hugging Face's softmax in
    fp32, then top-k, renormalised over the chosen when asked."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def route_groups(
    logits: torch.Tensor, correction: torch.Tensor, top_k: int, groups: tuple[int, int], renormalise: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing, as transformers runs it: sigmoid scores; with the correction bias added, each of the n_group
    groups is rated by its best two, the topk_group best groups kept, and the top_k experts chosen among them; each is
    weighted by its score (renormalised over the chosen when asked) times `scale`."""
    n_group, topk_group = groups
    scores = logits.float().sigmoid()
    choice = scores + correction.float()
    rated = choice.unflatten(-1, (n_group, -1)).topk(2, dim=-1).values.sum(-1)
    kept = torch.zeros_like(rated, dtype=torch.bool).scatter_(1, rated.topk(topk_group, dim=-1).indices, True)
    ids = choice.masked_fill(~kept.repeat_interleave(choice.shape[-1] // n_group, dim=1), float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * scale).to(logits.dtype), ids


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gate over [gate | up] rows: (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g), g = min(gate, limit)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)


class Experts(nn.Module):
    """num_experts gated MLPs: gate_up_proj [E, 2·I, H] (gate rows first) and down_proj [E, H, I], as transformers
    stacks Qwen3-MoE's, with biases beside them where `biases` (GPT-OSS). A `stacked` checkpoint holds these
    tensors whole (GPT-OSS's, converted as they load); others hold each expert's projections apart."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, biases: bool = False) -> None:
        super().__init__()
        self.num_experts, self.intermediate, self.stacked = num_experts, intermediate, biases
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate)) if biases else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if biases else None

    def slot(self, expert: int, part: str) -> torch.Tensor:
        """Where the checkpoint's experts.{expert}.{part}.weight goes (this rank's shard of it)."""
        if part == "down_proj":
            return self.down_proj[expert]
        return self.gate_up_proj[expert].narrow(0, 0 if part == "gate_proj" else self.intermediate, self.intermediate)

    def grouped(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ over each token's experts of weight · expert(x), tokens routed to each expert). The
        token-expert pairs are sorted by expert, so each active expert runs on its rows at once."""
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        tokens = order // ids.shape[1]
        rows = x[tokens]
        out = torch.empty_like(rows)
        start = 0
        biases = self.gate_up_proj_bias, self.down_proj_bias
        for expert, count in enumerate(counts.tolist()):
            if count:
                end = start + count
                gate_up_bias, down_bias = (None if b is None else b[expert] for b in biases)
                gate_up = F.linear(rows[start:end], self.gate_up_proj[expert], gate_up_bias)
                out[start:end] = F.linear(silu_and_mul(gate_up), self.down_proj[expert], down_bias)
                start = end
        out *= weights.flatten()[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, out), counts


class SparseMoe(nn.Module):
    """A sparse layer's MLP: the router (`gate`, as checkpoints name it) and the experts. Counts the
    tokens each expert took since `take_load` was last called."""

    load: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, cfg: ModelConfig, ops: FusedOps, tp: TensorParallel) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.top_k, self.renormalise, self.ops, self.moe = moe.top_k, moe.norm_topk_prob, ops, moe
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=moe.biases)
        # DeepSeek-V3's correction of the scores that choose experts (its checkpoints' gate.e_score_correction_bias)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts)) if moe.sigmoid_groups is not None else None
        self.shared_experts: nn.Module | None = None  # DeepSeek-V3's dense MLP beside the experts (the decoder layer's)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, tp.split(moe.intermediate_size)[1], moe.biases)
        limit = moe.swiglu_limit
        self.activation = ops.silu_and_mul if limit is None else functools.partial(clamped_swiglu, alpha=moe.swiglu_alpha, limit=limit)
        # the Triton kernels' experts have no biases and gate by SiLU; they route by softmax, or take DeepSeek's routing
        self.fused = ops.fused_moe if not moe.biases and limit is None else None
        self.register_buffer("load", torch.zeros(moe.num_experts, dtype=torch.int32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] normed rows -> this rank's partial output."""
        logits, moe, experts = self.gate(x), self.moe, self.experts
        routed = None
        if (groups := moe.sigmoid_groups) is not None and (correction := self.e_score_correction_bias) is not None:
            routed = route_groups(logits, correction, self.top_k, groups, self.renormalise, moe.routed_scaling_factor)
        if self.fused is not None and x.is_cuda:  # no host sync: CUDA graphs capture it
            gate_up, down = experts.gate_up_proj, experts.down_proj
            out = self.fused(x, logits, gate_up, down, self.top_k, self.renormalise, self.ops.silu_and_mul, self.load, routed)
        else:
            weights, ids = routed or route(logits, self.top_k, self.renormalise)
            out, counts = experts.grouped(x, weights, ids, self.activation)
            self.load += counts
        return out if self.shared_experts is None else out + self.shared_experts(x)

    def forward_normed(
        self, h: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm, fused: OneRowFusion
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's partial output for norm(h + residual), the new residual); the one-row
        fusions (`fused`) are for dense MLPs only."""
        return norm_then_linear(h, residual, norm, self)

    def take_load(self) -> torch.Tensor:
        """Tokens per expert since the last call, and a fresh count."""
        load = self.load.clone()
        self.load.zero_()
        return load
