"""Megatron-style tensor parallelism for the dense family: which slice of each checkpoint tensor a
rank holds. q/k/v and gate/up split by output rows (column-parallel), o_proj and down_proj by input
columns (row-parallel, an all-reduce after each), the embedding and LM head by vocabulary rows;
each expert like a dense MLP, its router whole.
KV heads fewer than the ranks are replicated: rank r holds head r·kv_heads // ranks."""

from __future__ import annotations

from typing import Any

import torch

from runtime.config import ModelConfig
from runtime.distributed import TensorParallel


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows) of the vocabulary on this rank: equal shards, the last padded past the vocabulary."""
    rows = -(-vocab_size // tp.size)
    return tp.rank * rows, rows


def read_shard(name: str, source: Any, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of the checkpoint tensor `name` (a Hugging Face name), reading only that part
    of `source` (a safetensors slice, or anything indexed alike)."""
    if tp.size == 1:
        return source[:]
    part, kind = name.split(".")[-2:]
    dim = cfg.head_dim
    if part == "o_proj" and kind == "bias":  # added once, after the all-reduce's sum
        return source[:] if tp.rank == 0 else torch.zeros_like(source[:])
    if part in ("q_proj", "o_proj"):
        start, count = tp.split(cfg.num_heads)
        return _rows(source, start * dim, count * dim) if part == "q_proj" else _columns(source, start * dim, count * dim)
    if part in ("k_proj", "v_proj"):
        start, count = tp.split(cfg.num_kv_heads)
        return _rows(source, start * dim, count * dim)
    if part in ("gate_proj", "up_proj", "down_proj"):  # a dense MLP's, or one expert's
        start, count = tp.split(cfg.moe.intermediate_size if cfg.moe is not None and ".experts." in name else cfg.intermediate_size)
        return _rows(source, start, count) if part != "down_proj" else _columns(source, start, count)
    if part in ("embed_tokens", "lm_head"):
        start, rows = vocab_shard(cfg.vocab_size, tp)
        kept = _rows(source, start, max(0, min(rows, cfg.vocab_size - start)))
        return kept if len(kept) == rows else torch.cat([kept, kept.new_zeros(rows - len(kept), *kept.shape[1:])])
    return source[:]


def _rows(source: Any, start: int, count: int) -> torch.Tensor:
    return source[start : start + count]


def _columns(source: Any, start: int, count: int) -> torch.Tensor:
    return source[:, start : start + count]
