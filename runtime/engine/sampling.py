"""The batched sampler. A draw is argmax(logit / T + g), g a Gumbel draw hashed from (request seed,
position, token id), so a request samples the same tokens alone, in any batch and after a replay."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from runtime.models.batch_invariant import in_blocks
from runtime.sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15
_M32 = 0xFFFFFFFF


@dataclass
class SampleRow:
    params: SamplingParams
    seed: int
    position: int  # how many tokens precede the one being sampled
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass
class Sample:
    """One step's draws, on the device."""

    tokens: torch.Tensor
    logprob_rows: list[int]
    top_ids: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    chosen: torch.Tensor | None = None  # the drawn token's log-probability


def row_keys(seeds: list[int], positions: list[int]) -> np.ndarray:
    """[B, 2] 32-bit keys from splitmix64(seed * MIX + position)."""
    with np.errstate(over="ignore"):
        x = np.array([s % 2**64 for s in seeds], dtype=np.uint64) * np.uint64(_MIX) + np.array(positions, dtype=np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return np.stack([x & np.uint64(_M32), x >> np.uint64(32)], axis=1).astype(np.int64)


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """x *= c mod 2**32, in place, for x in [0, 2**32), without overflowing int64."""
    low = x * (c & 0xFFFF)
    return x.mul_(c >> 16).bitwise_and_(0xFFFF).bitwise_left_shift_(16).add_(low).bitwise_and_(_M32)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    _mul32_(x.bitwise_xor_(x >> 16), 0x7FEB352D)
    _mul32_(x.bitwise_xor_(x >> 15), 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] Gumbel draws, the Triton kernel's noise in torch; in place, as the hash is the costly part.
    The uniform takes 23 of the hash's bits: (x + 0.5) / 2**23 is exact in fp32 and below 1, where 24
    bits round the largest to 1.0, whose noise is +inf (a token drawn whatever its logit, even -inf)."""
    h = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :] ^ keys[:, :1]
    _mix32_(_mix32_(h).bitwise_xor_(keys[:, 1:]))
    return (h >> 9).float().add_(0.5).mul_(2.0**-23).log_().neg_().log_().neg_()


def _torch_gumbel_argmax(scores: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    tokens = scores.argmax(dim=-1)
    hot = torch.nonzero(temperatures > 0).flatten()
    if len(hot):
        noisy = scores[hot] * (1.0 / temperatures[hot])[:, None] + gumbel_noise(keys[hot], scores.shape[1])
        tokens[hot] = noisy.argmax(dim=-1)
    return tokens


@dataclass(frozen=True)
class Feedback:
    """Where draws also go: last_tokens[slots[i]], which the next decode feeds, and host[i] (pinned)."""

    last_tokens: torch.Tensor
    slots: torch.Tensor
    host: torch.Tensor

    def send(self, tokens: torch.Tensor) -> None:
        self.last_tokens[self.slots] = tokens
        self.host.copy_(tokens, non_blocking=True)


def _gumbel_argmax_kernel():
    try:
        from runtime.kernels.triton.sampling import gumbel_argmax
    except ImportError:
        return None
    return gumbel_argmax


_KERNEL = _gumbel_argmax_kernel() if torch.cuda.is_available() else None


def gumbel_argmax(
    scores: torch.Tensor, temperatures: torch.Tensor | None, keys: torch.Tensor | None, feedback: Feedback | None = None
) -> torch.Tensor:
    """Per row: argmax(score / T + Gumbel) for T > 0, argmax(score) for T == 0 or without temperatures."""
    if scores.is_cuda and _KERNEL is not None:
        return _KERNEL(scores, temperatures, keys, feedback and (feedback.last_tokens, feedback.slots, feedback.host))
    if temperatures is None:
        tokens = scores.argmax(dim=-1)
    else:
        assert keys is not None  # temperatures come with their rows' keys
        tokens = _torch_gumbel_argmax(scores, temperatures, keys)
    if feedback is not None:
        feedback.send(tokens)
    return tokens


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


def log_softmax_rows(logits: torch.Tensor, block_rows: int | None = None) -> torch.Tensor:
    """Row-wise log-softmax; with `block_rows` (deterministic inference), in blocks of that many rows."""
    if block_rows is None:
        return torch.log_softmax(logits, dim=-1)
    return in_blocks(lambda block: torch.log_softmax(block, dim=-1), logits, block_rows)


def _filtered_rows(logits: torch.Tensor, params: list[SamplingParams], block_rows: int | None) -> torch.Tensor:
    """_filtered_log_probs; with `block_rows`, on blocks of that many rows, as in_blocks (the padding rows
    filtered as the last row is)."""
    if block_rows is None:
        return _filtered_log_probs(logits, params)
    padded = params + [params[-1]] * (-len(params) % block_rows)
    starts = iter(range(0, len(padded), block_rows))
    return in_blocks(lambda block: _filtered_log_probs(block, padded[(at := next(starts)) : at + block_rows]), logits, block_rows)


def _filtered_log_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Log-probabilities at temperature, -inf where top-k, then top-p, then min-p exclude (as Hugging Face)."""
    device = logits.device
    column = lambda values: torch.tensor(values, device=device, dtype=torch.float32)[:, None]  # noqa: E731
    sorted_probs, order = torch.softmax(logits / column([p.temperature for p in params]), dim=-1).sort(dim=-1, descending=True)
    rank = torch.arange(sorted_probs.shape[1], device=device)[None, :]
    kept = sorted_probs * (rank < column([p.top_k if p.top_k > 0 else sorted_probs.shape[1] for p in params]))
    renormalised = kept / kept.sum(-1, keepdim=True)
    kept = kept.masked_fill((renormalised.cumsum(-1) - renormalised) > column([p.top_p for p in params]), 0.0)
    kept = kept.masked_fill(kept < column([p.min_p for p in params]) * kept[:, :1], 0.0)
    kept[:, 0] = sorted_probs[:, 0]
    return torch.zeros_like(kept).scatter_(1, order, kept).log()


def sample(
    logits: torch.Tensor,
    rows: list[SampleRow],
    feedback: Feedback | None = None,
    constrain: Callable[[torch.Tensor], None] | None = None,
    block_rows: int | None = None,
) -> Sample:
    """Next token per row, and top-N log-probabilities (the model's, before penalties, biases and
    grammars) when asked; `constrain` masks the rows' logits in place (grammars) after the penalties
    and biases and before the filters. Rewritten logits go to fp32 first. `block_rows` (deterministic
    inference): the row-wise reductions run on blocks of that many rows (runtime.models.batch_invariant)."""
    device = logits.device
    logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    filtered = [i for i, row in enumerate(rows) if not row.params.greedy and row.params.filters]
    rewritten = constrain is not None or any(row.params.penalized or row.params.logit_bias for row in rows)
    if logprob_rows or filtered or rewritten or not (logits.is_cuda and _KERNEL):
        logits = logits.float()
    if logprob_rows:
        raw_logprobs = log_softmax_rows(logits[logprob_rows], block_rows)
    for i, row in enumerate(rows):  # in place: the logits are this step's own
        if row.params.penalized:
            _apply_penalties(logits[i], row)
        if row.params.logit_bias:
            ids, biases = zip(*row.params.logit_bias)
            logits[i, list(ids)] += torch.tensor(biases, device=device)
    if constrain is not None:
        constrain(logits)
    temperatures = [0.0 if row.params.greedy else row.params.temperature for row in rows]
    if filtered:
        logits[filtered] = _filtered_rows(logits[filtered], [rows[i].params for i in filtered], block_rows)
        for i in filtered:
            temperatures[i] = 1.0
    if not any(temperatures):
        tokens = gumbel_argmax(logits, None, None, feedback)
    else:
        keys = torch.from_numpy(row_keys([row.seed for row in rows], [row.position for row in rows])).to(device, non_blocking=True)
        temperatures = torch.tensor(temperatures, dtype=torch.float32).to(device, non_blocking=True)
        tokens = gumbel_argmax(logits, temperatures, keys, feedback)
    result = Sample(tokens, logprob_rows)
    if logprob_rows:
        top = raw_logprobs.topk(max(rows[i].params.logprobs or 0 for i in logprob_rows), dim=-1)  # never None in these rows
        result.top_ids, result.top_values = top.indices, top.values
        result.chosen = raw_logprobs.gather(1, tokens[logprob_rows][:, None])[:, 0]
    return result


PROMPT_LOGPROB_BLOCK = 1024  # rows whose full-vocabulary log-probabilities exist at once


@dataclass
class PromptLogprobs:
    """Log-probabilities of prompt tokens given the tokens before them (the model's, before any
    penalty), their ranks, and the top N ids and values at each of those positions."""

    logprob: torch.Tensor  # [n]
    rank: torch.Tensor  # [n]: 1 + the number of tokens more likely than the prompt's
    top_ids: torch.Tensor  # [n, N]
    top_values: torch.Tensor  # [n, N]

    @classmethod
    def of(
        cls,
        logits_of: Callable[[torch.Tensor], torch.Tensor],
        hidden: torch.Tensor,
        targets: torch.Tensor,
        top: int,
        block_rows: int | None = None,
    ) -> PromptLogprobs:
        """From the hidden states of the rows before `targets`, a block of rows at a time (`block_rows`: as sample)."""
        parts = []
        for at in range(0, len(targets), PROMPT_LOGPROB_BLOCK):
            logprobs = log_softmax_rows(logits_of(hidden[at : at + PROMPT_LOGPROB_BLOCK]).float(), block_rows)
            chosen = logprobs.gather(1, targets[at : at + PROMPT_LOGPROB_BLOCK, None])
            best = logprobs.topk(top, dim=-1)
            parts.append((chosen[:, 0], (logprobs > chosen).sum(-1) + 1, best.indices, best.values))
        return cls(*(torch.cat(column) for column in zip(*parts)))

    @classmethod
    def joined(cls, parts: list[PromptLogprobs]) -> PromptLogprobs:
        """A prompt's chunks in order, on the host (a non-blocking copy: read it after the step's event)."""
        return cls(*(torch.cat([getattr(p, name) for p in parts]).to("cpu", non_blocking=True) for name in cls.__dataclass_fields__))

    def rows(self) -> list[tuple[float, int, list[tuple[int, float]]]]:
        """Per position: (log-probability, rank, top (id, log-probability) pairs)."""
        return [(lp, rank, list(zip(ids, values))) for lp, rank, ids, values in zip(*(t.tolist() for t in vars(self).values()))]


DRAW_KINDS = (SamplingParams(temperature=0), SamplingParams(), SamplingParams(temperature=0, logprobs=1), SamplingParams(top_k=2))


def warm_up_draws(logits: torch.Tensor, last_tokens: torch.Tensor) -> None:
    """Makes every kind of draw a step makes, so Triton builds its variants at start-up; writes last_tokens[0]."""
    counts = [1]
    if logits.is_cuda and _KERNEL is not None:
        from runtime.kernels.triton.sampling import FEW_ROWS

        counts.append(FEW_ROWS + 1)
    for rows in counts:
        feedback = Feedback(
            last_tokens,
            torch.zeros(rows, dtype=torch.int64, device=logits.device),
            torch.empty(rows, dtype=torch.int64, pin_memory=logits.is_cuda),
        )
        for params in DRAW_KINDS:
            sample(logits.repeat(rows, 1), [SampleRow(params, 0, 0, [], [])] * rows, feedback)


def logprob_dicts(sample: Sample, rows: list[SampleRow], tokens: list[int]) -> list[dict[int, float] | None]:
    """Host-side: each row's top-N log-probabilities, with the drawn token's always present."""
    out: list[dict[int, float] | None] = [None] * len(rows)
    if not sample.logprob_rows:
        return out
    assert sample.top_ids is not None and sample.top_values is not None and sample.chosen is not None  # set with logprob_rows
    ids, values, chosen = sample.top_ids.tolist(), sample.top_values.tolist(), sample.chosen.tolist()
    for j, i in enumerate(sample.logprob_rows):
        n = rows[i].params.logprobs
        entry = dict(zip(ids[j][:n], values[j][:n]))
        entry.setdefault(tokens[i], chosen[j])
        out[i] = entry
    return out
