"""A step's shape as attention backends, models and CUDA graphs see it. It sits above engine/, attention/
and models/, which all read it, so none of them imports another for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch import Tensor


@dataclass
class AttentionMeta:
    qo_indptr: np.ndarray  # [B + 1]: sequence i's new tokens are rows qo_indptr[i]:qo_indptr[i+1]
    kv_indptr: np.ndarray  # [B + 1]: its pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices: np.ndarray
    kv_lens: np.ndarray  # [B]: positions attended, the new tokens included
    # the sliding-window layers' plan, over the window pool: each sequence's pages from the first its first new
    # token's window reaches, its kv_lens counted from there (a model with windows only)
    window: AttentionMeta | None = None

    @property
    def decode_only(self) -> bool:
        return len(self.kv_lens) == self.qo_indptr[-1]

    def last_page_lens(self, page_size: int) -> np.ndarray:
        return (self.kv_lens - 1) % page_size + 1


class StepAbandoned(Exception):
    """An eager step stopped between two layers because its `between_layers` said nobody waits for it
    any more; the engine must be reset before its next step."""


@dataclass
class ForwardBatch:
    input_ids: Tensor
    positions: Tensor
    kv_rows: Tensor  # [T, 2]: where each new token's K and V go (see kv_rows); [T, 4] with windows, the window pool's after
    meta: AttentionMeta
    between_layers: Callable[[], bool] | None = None  # after each layer of an eager step: True abandons it
    before_layer: Callable[[int], None] | None = None  # before each layer of an eager step (KV tiers' copies)


def rows_of(kv_rows: Tensor, windowed: bool) -> Tensor:
    """A layer's K and V rows of a step's [T, 2] or [T, 4] kv_rows: the window pool's for a sliding-window layer."""
    return kv_rows[:, 2:] if windowed else kv_rows[:, :2]


def kv_rows(pages: np.ndarray, offsets: np.ndarray, page_size: int) -> np.ndarray:
    """[..., 2]: the K and V rows of tokens at (page, offset) in a layer viewed as KVPool.rows."""
    k = pages * (2 * page_size) + offsets
    return np.stack([k, k + page_size], axis=-1)


def paged_meta(table: np.ndarray, kv_lens: np.ndarray, qo_indptr: np.ndarray, page_size: int) -> AttentionMeta:
    """The plan of sequences whose pages are `table`'s rows [B, width], attending to their first kv_lens positions."""
    seq_pages = -(-kv_lens // page_size)
    kv_indptr = np.zeros(len(kv_lens) + 1, dtype=np.int64)
    np.cumsum(seq_pages, out=kv_indptr[1:])
    kv_indices = table[np.arange(table.shape[1])[None, :] < seq_pages[:, None]]
    return AttentionMeta(qo_indptr.astype(np.int32), kv_indptr.astype(np.int32), kv_indices.astype(np.int32), kv_lens.astype(np.int32))
