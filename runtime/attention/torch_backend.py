"""The reference backend: SDPA per sequence for prefill, one batched SDPA per layer for decode,
and ringllm's paged decode kernel in place on fp32 CPUs that build it. Sliding windows are masks; a
soft cap on the scores and attention sinks (which SDPA lacks) run SDPA's math written out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.attention.backend import AttentionSpec
from runtime.attention.pool import KVPool
from runtime.batch import AttentionMeta, ForwardBatch
from runtime.kernels.cpu import build as cpu_kernels


def attend(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, spec: AttentionSpec, causal: bool = False, sinks: Tensor | None = None
) -> Tensor:
    """softmax(q·kᵀ · scale)·v over [..., heads, rows, dim] (keys' heads may be fewer: GQA); `mask`: True or 0 where
    a row sees a key, False or -inf where not; `sinks`: each of q's heads' sink logit, shaped as q's heads [..., 1, 1]."""
    if spec.softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=spec.scale, enable_gqa=True)
    if keys.shape[-3] != q.shape[-3]:
        keys, values = (x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3) for x in (keys, values))
    scores = q @ keys.transpose(-1, -2) * spec.scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        return scores.softmax(-1) @ values
    with_sinks = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    return with_sinks.softmax(-1)[..., :-1] @ values


def visible(q_len: int, kv_len: int, window: int, device: torch.device) -> Tensor | None:
    """[q_len, kv_len]: which keys each of a sequence's last q_len rows sees, None where every row sees every key."""
    if q_len == 1 and not 0 < window < kv_len:
        return None
    rows = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    keys = torch.arange(kv_len, device=device)[None, :]
    return (keys <= rows) & (keys > rows - window) if window else keys <= rows


class TorchAttention:
    """Gathers whole pages (cheaper than token rows) and runs SDPA: one masked call per layer for decode."""

    rotates = False

    def __init__(self, pool: KVPool, num_heads: int, spec: AttentionSpec, deterministic: bool = False) -> None:
        """`deterministic`: every row, a prompt's too, attends as a decode row (ringllm's paged decode
        kernel over its own prefix), so a row's output is the same whatever shares its step."""
        self.pool = pool
        # ringllm's kernel reads K and V of one width (not MLA's latent)
        self.in_place = pool.device.type == "cpu" and pool.dtype == torch.float32 and not spec.latent and cpu_kernels.available()
        if deterministic and not self.in_place:
            raise ValueError("deterministic inference on the torch backend needs a float32 CPU pool and ringllm's CPU kernels")
        self.deterministic, self.spec = deterministic, spec
        self.windows = tuple({window for window in spec.windows if window})  # the sliding windows its layers use
        self._masks: dict[tuple[int, int], Tensor | None] = {}  # a prefill step's, by (sequence, window)

    def prepare(self, meta: AttentionMeta) -> None:
        """Plans the step over the pool, and over the window pool where the step has a plan there (meta.window;
        else the windowed layers mask the pool's pages)."""
        self._masks.clear()
        if meta.window is None:
            self._plans = dict.fromkeys((False, True), self._plan(meta, (0, *self.windows)))
        else:
            self._plans = {False: self._plan(meta, (0,)), True: self._plan(meta.window, self.windows)}

    def _plan(self, meta: AttentionMeta, windows: tuple[int, ...]) -> _Plan:
        device, ps = self.pool.device, self.pool.page_size
        if not (self.deterministic or meta.decode_only):
            pages = [
                torch.from_numpy(meta.kv_indices[a:b].astype(np.int64)).to(device) for a, b in zip(meta.kv_indptr[:-1], meta.kv_indptr[1:])
            ]
            return _Plan(meta, None, pages)
        # each row attends as a decode row: its sequence's pages, padded with its own last page, up to its own
        # position (row i of a sequence whose step adds q rows to kv tokens sees kv - q + i + 1)
        q_lens = np.diff(meta.qo_indptr)
        seq = np.repeat(np.arange(len(q_lens)), q_lens)
        row_lens = (meta.kv_lens - q_lens - meta.qo_indptr[:-1])[seq] + np.arange(len(seq)) + 1
        counts = np.diff(meta.kv_indptr)[seq]
        width = int(counts.max())
        at = meta.kv_indptr[seq, None] + np.minimum(np.arange(width)[None, :], counts[:, None] - 1)
        pages = torch.from_numpy(meta.kv_indices[at].astype(np.int64)).to(device)
        if self.in_place:
            return _Plan(meta, (pages, torch.from_numpy(row_lens.astype(np.int64))), [])
        # additive, in the pool's dtype (SDPA would convert a boolean mask in every layer); one per window
        keys, masks = np.arange(width * ps)[None, :], {}
        for window in windows:
            hidden = torch.from_numpy((keys >= row_lens[:, None]) | (keys < row_lens[:, None] - window if window else False))
            mask = torch.zeros(hidden.shape, dtype=self.pool.compute_dtype).masked_fill_(hidden, float("-inf"))
            masks[window] = mask.to(device)[:, None, None, :]
        return _Plan(meta, (pages, masks), [])

    def _kv(self, layer: int, pages: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of `pages` ([B, P] or [P]), gathered apart so that each lands contiguous."""
        shape = (*pages.shape[:-1], -1, self.pool.num_kv_heads, self.pool.head_dim)
        if self.spec.latent:  # MLA: the keys are the tokens' whole latents, the values their first part
            latents = self.pool.latents(layer)
            whole = latents.index_select(0, pages.flatten()).view(*pages.shape[:-1], -1, 1, latents.shape[-1])
            return whole, whole[..., : self.spec.latent]
        keys, values = self.pool.gather(layer, pages.flatten())
        return keys.view(shape), values.view(shape)

    def forward(self, layer: int, q: Tensor, batch: ForwardBatch, sinks: Tensor | None = None) -> Tensor:
        kv_heads, spec, window = self.pool.num_kv_heads, self.spec, self.spec.window(layer)
        plan = self._plans[window > 0]
        if plan.decode is not None and self.in_place:
            pages, kv_lens = plan.decode
            return torch.ops.ringllm_cpu.paged_decode_attention(
                q, self.pool.kv[layer], pages, kv_lens, spec.scale, window, spec.softcap or 0.0, sinks
            )
        if plan.decode is not None:
            pages, masks = plan.decode
            keys, values = self._kv(layer, pages)
            # each KV head's query heads as its rows: SDPA then needs no GQA expansion
            grouped = q.view(len(q), kv_heads, -1, q.shape[-1])
            grouped_sinks = None if sinks is None else sinks.view(kv_heads, -1, 1)
            attended = attend(grouped, keys.transpose(1, 2), values.transpose(1, 2), masks[window], spec, sinks=grouped_sinks)
            return attended.reshape(len(q), q.shape[1], -1)
        out, meta = q.new_empty(*q.shape[:2], spec.latent or q.shape[-1]), plan.meta
        head_sinks = None if sinks is None else sinks.view(-1, 1, 1)
        for i, pages in enumerate(plan.pages):
            rows = slice(int(meta.qo_indptr[i]), int(meta.qo_indptr[i + 1]))
            q_len, kv_len = rows.stop - rows.start, int(meta.kv_lens[i])
            keys, values = (x[:kv_len].transpose(0, 1)[None] for x in self._kv(layer, pages))
            # a whole prompt, no window: SDPA's own causal mask
            causal = 1 < q_len == kv_len and not 0 < window < kv_len
            if (i, window) not in self._masks:
                self._masks[i, window] = None if causal else visible(q_len, kv_len, window, q.device)
            # 4-D, batch of one: torch routes 3-D GQA inputs to its slow unfused math kernel
            attended = attend(q[rows].transpose(0, 1)[None], keys, values, self._masks[i, window], spec, causal, head_sinks)
            out[rows] = attended[0].transpose(0, 1)
        return out


@dataclass(frozen=True)
class _Plan:
    """A step's plan over one pool: `decode` where every row attends as a decode row ((pages [rows, width], lengths)
    for ringllm's kernel, else (pages, an additive mask per window)), else each sequence's `pages`."""

    meta: AttentionMeta
    decode: tuple[Tensor, Any] | None
    pages: list[Tensor]
