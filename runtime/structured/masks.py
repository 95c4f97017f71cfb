"""The engine's side of structured output: a grammar matcher per constrained slot, fed the slot's
tokens as they are read back, and the batched mask of what each one allows next, applied to the
logits before the draw. A slot opened again (a preemption, a new epoch) replays its tokens into a
fresh matcher, so a constrained request survives both. Steps without a constrained slot never
reach this module. On CPU xgrammar and the tokenizer load on the first constrained slot; on CUDA
at start-up (warm_up), as there they would hold every running request for seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from runtime.models.source import load_tokenizer
from runtime.sampling_params import SamplingParams
from runtime.structured.grammars import build_grammar

log = structlog.get_logger()
CACHE_BYTES = 256 << 20  # compiled grammars kept for reuse (xgrammar's cache, by grammar)


@dataclass
class _Slot:
    matcher: Any  # xgrammar.GrammarMatcher
    fed: int = 0  # output tokens accepted so far


class GrammarMasks:
    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_dir, self.vocab_size, self.eos_token_ids = model_dir, vocab_size, eos_token_ids
        self._compiler: Any = None
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher: fills many rows' masks on a thread pool
        self._slots: dict[int, _Slot] = {}
        self._errors: dict[int, str] = {}  # slot -> why its grammar failed, until the engine takes it
        self._bitmask: torch.Tensor | None = None

    def _load_compiler(self, tokenizer: Any) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1), cache_limit_bytes=CACHE_BYTES)

    def _compile(self, guide: tuple[str, str]) -> Any:
        """The guide's grammar compiled against the vocabulary; the tokenizer actor built (and so
        bounded) the same grammar before the request was scheduled, and both builds are cached."""
        import xgrammar as xgr

        if self._compiler is None:
            self._load_compiler(load_tokenizer(self.model_dir, required=True))
            assert self._compiler is not None
        return self._compiler.compile_grammar(xgr.Grammar.deserialize_json(build_grammar(*guide)))

    def warm_up(self, device: torch.device) -> None:
        """What a first constrained slot would build between steps: the vocabulary's grammar compiler
        (seconds for a large vocabulary) and the mask kernel (Triton's, built at its first run)."""
        if (tokenizer := load_tokenizer(self.model_dir)) is None:  # token ids only: nothing can be constrained
            return
        self._load_compiler(tokenizer)
        self._apply_masks(torch.zeros(1, self.vocab_size, device=device), self._bitmask_rows(1, device), [0])

    def open(self, slot: int, params: SamplingParams) -> None:
        """A slot whose draws the grammar constrains; its tokens so far are fed at the next mask."""
        import xgrammar as xgr

        stops = sorted({*self.eos_token_ids, *params.stop_token_ids})
        assert params.guide is not None  # only a guided slot is opened
        self._slots[slot] = _Slot(xgr.GrammarMatcher(self._compile(params.guide), override_stop_tokens=stops))

    def close(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def clear(self) -> None:
        self._slots.clear()
        self._errors.clear()

    def constrains(self, slots: np.ndarray) -> bool:
        """Does a grammar hold any of these slots? Free (no list is built) while no slot is constrained."""
        return bool(self._slots) and any(slot in self._slots for slot in slots.tolist())

    def apply(self, logits: torch.Tensor, slots: list[int], outputs: list[list[int]]) -> None:
        """Masks row i of `logits` to what slot slots[i]'s grammar allows after outputs[i] (every
        token the slot has drawn, read back). A grammar that allows no token there fails its slot
        (take_errors) and leaves its row as it is: the request ends with the error, not with that draw."""
        import xgrammar as xgr

        live = [(i, slot, state) for i, (slot, output) in enumerate(zip(slots, outputs)) if (state := self._feed(slot, output)) is not None]
        if live:
            rows = [i for i, _, _ in live]
            bitmask = self._bitmask_rows(len(slots), logits.device)
            self._batch = self._batch or xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([state.matcher for _, _, state in live], bitmask, rows)
            allows = bitmask[rows].ne(0).any(dim=1).tolist()
            for (_, slot, state), some in zip(live, allows):
                if not some:
                    self._fail(slot, state)
            if rows := [i for (i, _, _), some in zip(live, allows) if some]:
                self._apply_masks(logits, bitmask, rows)

    def take_errors(self) -> dict[int, str]:
        """The slots whose grammars failed since the last call, and why (for their clients)."""
        errors, self._errors = self._errors, {}
        return errors

    def _fail(self, slot: int, state: _Slot) -> None:
        log.warning("grammar_dead_end", slot=slot, at=state.fed)
        del self._slots[slot]
        self._errors[slot] = (
            f"the output constraint allows no token after {state.fed} generated tokens (a rule that can never end, "
            "or text the model's vocabulary cannot spell)"
        )

    def _bitmask_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        """The host bitmask's first `rows` rows, grown as needed; pinned on CUDA, so its copy is asynchronous
        (the next fill waits for this step's draws anyway)."""
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < rows:
            bitmask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
            self._bitmask = bitmask.pin_memory() if device.type == "cuda" else bitmask
        return self._bitmask[:rows]

    def _apply_masks(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        import xgrammar as xgr

        indices: list[int] | torch.Tensor = rows
        if logits.is_cuda:  # from pinned memory: xgrammar's copy of a list is pageable, and waits for the device's queue
            indices = torch.tensor(rows, dtype=torch.int32, pin_memory=True).to(logits.device, non_blocking=True)
        bitmask = bitmask.to(logits.device, non_blocking=True)
        # xgrammar annotates indices as a list, and takes a device tensor of them as well
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=indices)  # pyright: ignore[reportArgumentType]

    def _feed(self, slot: int, output: list[int]) -> _Slot | None:
        """The slot's matcher after its new tokens; None if the slot is not constrained, or no longer:
        its grammar is done, or refused a token (which fails the slot)."""
        if (state := self._slots.get(slot)) is None:
            return None
        for token in output[state.fed :]:
            if state.matcher.is_terminated():
                break
            if not state.matcher.accept_token(token):
                self._fail(slot, state)
                return None
            state.fed += 1
        if state.matcher.is_terminated():
            del self._slots[slot]
            return None
        return state
