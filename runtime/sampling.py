"""The sampler: greedy, temperature, top-k, top-p, min-p, penalties and log-probabilities.

Each random draw uses a generator seeded from (request seed, position), never a shared stream,
so a request samples the same tokens alone, inside any batch, and after a replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15


@dataclass
class SampleRow:
    """What the sampler needs of one sequence at this step."""

    params: SamplingParams
    seed: int
    position: int  # how many tokens precede the one being sampled
    prompt_ids: list[int]
    output_ids: list[int]


def _apply_penalties(logits: torch.Tensor, row: SampleRow) -> None:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long, device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if row.output_ids and (p.frequency_penalty or p.presence_penalty):
        out = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out, minlength=logits.numel()).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _filter(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Zero what top-k, top-p and min-p exclude; the most likely token always survives."""
    if p.min_p > 0:
        probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
    if p.top_k > 0 or p.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
        if p.top_k > 0:
            drop[p.top_k :] = True
        if p.top_p < 1:
            drop |= (sorted_probs.cumsum(0) - sorted_probs) > p.top_p
        drop[0] = False
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def _draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """Exponential race: argmax(p / E) with E ~ Exp(1) picks i with probability p_i."""
    generator = torch.Generator(device=probs.device).manual_seed((seed * _MIX + position) & (2**63 - 1))
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[dict[int, float] | None]]:
    """Next token per row, and top-N log-probabilities of the model's own distribution when asked."""
    logits = logits.float()
    logprobs: list[dict[int, float] | None] = [None] * len(rows)
    if any(row.params.logprobs is not None for row in rows):
        all_logprobs = torch.log_softmax(logits, dim=-1)
    if all(row.params.greedy and not row.params.penalized for row in rows):  # the fast path
        tokens = logits.argmax(dim=-1).tolist()
    else:
        logits = logits.clone()
        tokens = []
        for i, row in enumerate(rows):
            if row.params.penalized:
                _apply_penalties(logits[i], row)
            if row.params.greedy:
                tokens.append(int(logits[i].argmax()))
            else:
                probs = _filter(torch.softmax(logits[i] / row.params.temperature, dim=-1), row.params)
                tokens.append(_draw(probs, row.seed, row.position))
    for i, row in enumerate(rows):
        if row.params.logprobs is not None:
            top = all_logprobs[i].topk(row.params.logprobs)
            entry = dict(zip(top.indices.tolist(), top.values.tolist()))
            entry.setdefault(tokens[i], float(all_logprobs[i, tokens[i]]))
            logprobs[i] = entry
    return tokens, logprobs
