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
    kv_rows: Tensor  # [T, 2]: where each new token's K and V go (see kv_rows)
    meta: AttentionMeta
    between_layers: Callable[[], bool] | None = None  # after each layer of an eager step: True abandons it
    before_layer: Callable[[int], None] | None = None  # before each layer of an eager step (KV tiers' copies)


def kv_rows(pages: np.ndarray, offsets: np.ndarray, page_size: int) -> np.ndarray:
    """[..., 2]: the K and V rows of tokens at (page, offset) in a layer viewed as KVPool.rows."""
    k = pages * (2 * page_size) + offsets
    return np.stack([k, k + page_size], axis=-1)
