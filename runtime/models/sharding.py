"""Megatron-style tensor parallelism for the dense family: which slice of each checkpoint tensor a
rank holds. q/k/v and gate/up split by output rows (column-parallel), o_proj and down_proj by input
columns (row-parallel, an all-reduce after each), the embedding and LM head by vocabulary rows.
KV heads fewer than the ranks are replicated: rank r holds head r·kv_heads // ranks."""

from __future__ import annotations

import torch

from runtime.config import ModelConfig
from runtime.distributed import TensorParallel


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows) of the vocabulary on this rank: equal shards, the last padded past the vocabulary."""
    rows = -(-vocab_size // tp.size)
    return tp.rank * rows, rows


def shard_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of the checkpoint tensor `name` (a Hugging Face name)."""
    if tp.size == 1:
        return tensor
    part, kind = name.split(".")[-2:]
    dim = cfg.head_dim
    if part in ("q_proj", "o_proj"):
        if part == "o_proj" and kind == "bias":  # added once, after the all-reduce's sum
            return tensor if tp.rank == 0 else torch.zeros_like(tensor)
        start, count = tp.split(cfg.num_heads)
        return tensor.narrow(0 if part == "q_proj" else 1, start * dim, count * dim)
    if part in ("k_proj", "v_proj"):
        start, count = tp.split(cfg.num_kv_heads)
        return tensor.narrow(0, start * dim, count * dim)
    if part in ("gate_proj", "up_proj", "down_proj"):
        start, count = tp.split(cfg.intermediate_size)
        return tensor.narrow(0 if part != "down_proj" else 1, start, count)
    if part in ("embed_tokens", "lm_head"):
        start, rows = vocab_shard(cfg.vocab_size, tp)
        kept = tensor[start : start + rows]
        if len(kept) == rows:
            return kept
        return torch.cat([kept, kept.new_zeros(rows - len(kept), *kept.shape[1:])])
    return tensor
