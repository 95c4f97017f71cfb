"""Model drafts for speculative decoding: an Engine of the draft's own fills in a verify chunk's DRAFT_HERE
tokens just before the target's step runs (Engine.launch). STANDALONE drafts with a smaller model of the
target's vocabulary; EAGLE and EAGLE-3 with a head over the target's hidden states (runtime.models.eagle)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from runtime.models.eagle import Eagle3Head, EagleHead, aux_layers
from runtime.step import DRAFT_HERE, Chunk, StepPlan

if TYPE_CHECKING:
    from runtime.engine.engine import Engine, HostStep, PendingStep, SlotState


class DraftModel:
    """STANDALONE drafts: a smaller model of the target's vocabulary, in an Engine of its own that mirrors the
    target's slots and page tables (its own pool under the same page ids). A cached prefix's pages may hold no
    draft KV, so a slot's draft KV is computed from its first token at its first draft, and caught up to the
    target's tokens before each draft after. Its draws take the request's own sampling and seed: a draft model
    that is the target draws what the target will."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def mirror(self, plan: StepPlan) -> None:
        """The plan's freed and new slots and their pages, as the target applied them (no grammar: the draft
        model draws freely, and the target's verify rows carry the grammar's masks; no log-probabilities)."""
        new = [replace(n, cached=0, params=replace(n.params, guide=None, logprobs=None, prompt_logprobs=None)) for n in plan.new_slots]
        self.engine.apply(StepPlan(freed=plan.freed, new_slots=new, pages=plan.pages))

    def draft(self, plan: StepPlan, targets: dict[int, SlotState]) -> StepPlan:
        """The plan with its DRAFT_HERE tokens drawn: a step over each drafted slot's tokens the draft model
        lacks (a long catch-up, as a prompt's first, in prefill-sized steps before it), then a decode step
        for each draft token after the first, read once all are queued."""
        asks = [(i, c) for i, c in enumerate(plan.chunks) if c.drafts and c.token_ids[-1] == DRAFT_HERE]
        if not asks:
            return plan
        budget = self.engine.config.max_prefill_tokens
        assert budget is not None  # EngineConfig fills in the device's default
        ends: list[tuple[Chunk, torch.Tensor | None]] = []
        for _, chunk in asks:
            target, mine = targets[chunk.slot], self.engine.slots[chunk.slot]
            mine.output_ids, mine.sampled = list(target.output_ids), len(target.output_ids)
            tokens, features = self._catch_up(chunk.slot, target)
            for start in range(0, len(tokens) - 1 - (len(tokens) - 1) % budget, budget):
                piece = None if features is None else features[start : start + budget]
                self._launch(StepPlan(chunks=[Chunk(chunk.slot, tokens[start : start + budget], False)]), [piece])
            last = (len(tokens) - 1) // budget * budget
            ends.append((Chunk(chunk.slot, tokens[last:], True), None if features is None else features[last:]))
        steps: list[PendingStep] = []
        group: list[tuple[Chunk, torch.Tensor | None]] = []
        for end in ends:  # the last pieces, in steps of a budget's rows at most
            if group and sum(len(c.token_ids) for c, _ in group) + len(end[0].token_ids) > budget:
                steps.append(self._launch(StepPlan(chunks=[c for c, _ in group]), [f for _, f in group]))
                group = []
            group.append(end)
        steps.append(self._launch(StepPlan(chunks=[c for c, _ in group]), [f for _, f in group]))
        for j in range(1, max(c.drafts for _, c in asks)):
            steps.append(self._launch(StepPlan(decodes=[c.slot for _, c in asks if c.drafts > j])))
        self._drafted([c.slot for _, c in asks])
        drawn: dict[int, list[int]] = {c.slot: [] for _, c in asks}
        for step in steps:
            for sampled in step.result():
                drawn[sampled.slot].append(sampled.token)
        chunks = list(plan.chunks)
        for i, chunk in asks:
            chunks[i] = replace(chunk, token_ids=chunk.token_ids[: -chunk.drafts] + drawn[chunk.slot])
        return replace(plan, chunks=chunks)

    def _catch_up(self, slot: int, target: SlotState) -> tuple[list[int], torch.Tensor | None]:
        """The tokens that bring the slot's draft KV up to the target's, the last drawing the first draft token
        (and a head's features for them)."""
        known = target.prompt_ids + target.output_ids
        return known[int(self.engine.lengths[slot]) :], None

    def _launch(self, plan: StepPlan, features: list[torch.Tensor | None] | None = None) -> PendingStep:
        """Queues a draft step; `features`: a head's, one tensor per chunk."""
        return self.engine.launch(plan)

    def _drafted(self, slots: list[int]) -> None:
        """Every draft step of these slots is queued."""

    def take_features(self, plan: StepPlan, step: HostStep, hidden: torch.Tensor) -> None:
        """The target's step ran its forward over `plan` (hidden: its last hidden states, a row per token)."""

    def kept(self, slot: int, length: int) -> None:
        """The target kept KV for `length` tokens of the slot: the draft KV past it is void."""
        self.engine.lengths[slot] = min(int(self.engine.lengths[slot]), length)

    def reset(self) -> None:
        self.engine.reset()


class EagleDraft(DraftModel):
    """EAGLE and EAGLE-3 drafts. The head's row at position p reads the token at p + 1 and the target's feature
    at p, and hands its own hidden state on as the feature of the row after it; so a draft first catches the
    head up over the target's features it has not read (a prefill's rows, then a verify step's kept rows),
    whose last row draws the first draft token, then decodes on its own features. The features wait on the
    device, per slot, from the target's forward to the slot's next draft. A position whose feature never
    came (a prefix from the radix cache; steps decoded while drafting was off) is skipped where the head's
    KV begins, else read with a zero feature: it costs acceptance, never output. The head runs eager: its
    features are set before each forward."""

    def __init__(self, engine: Engine, target: Engine) -> None:
        super().__init__(engine)
        head, model = engine.model, target.model
        assert isinstance(head, EagleHead | Eagle3Head)  # Engine builds one for EAGLE and EAGLE3
        self.head, self.target_lengths = head, target.lengths
        head.model.embed_tokens = model.model.embed_tokens
        width = model.config.hidden_size
        if isinstance(head, EagleHead):
            head.lm_head = model.lm_head
        else:
            model.capture = aux_layers(head.config, model.config.num_layers)
            if not all(0 <= layer <= model.config.num_layers for layer in model.capture):
                raise ValueError(f"the EAGLE-3 head reads layers {model.capture} of a {model.config.num_layers}-layer target")
            target.prefill_graphs = None  # a graph's replay would not set the layers' hidden states it keeps
            width *= len(model.capture)
        self.features_of = (lambda hidden: model.captured) if isinstance(head, Eagle3Head) else (lambda hidden: hidden)
        self.width, self.dtype, self.device = width, target.dtype, target.device
        self.pending: dict[int, tuple[int, list[torch.Tensor]]] = {}  # slot -> (the first row's position, features [rows, width])
        self._last: dict[int, torch.Tensor] = {}  # slot -> the head's hidden state of its last row, the next row's feature
        self._ends: dict[int, int] = {}  # slot -> how far its head KV holds after the draft: the rest is redone next time

    def mirror(self, plan: StepPlan) -> None:
        super().mirror(plan)
        for slot in [*plan.freed, *(n.slot for n in plan.new_slots)]:
            self.pending.pop(slot, None)

    def take_features(self, plan: StepPlan, step: HostStep, hidden: torch.Tensor) -> None:
        features = self.features_of(hidden)
        for i, chunk in enumerate(plan.chunks):
            first, last = int(step.qo_indptr[i]), int(step.qo_indptr[i + 1])
            position, rows = int(step.positions[first]), features[first:last].clone()  # a graph's output is overwritten
            start, held = self.pending.get(chunk.slot, (position, []))
            if start + sum(len(r) for r in held) == position:
                held.append(rows)
            else:
                start, held = position, [rows]
            self.pending[chunk.slot] = (start, held)

    def _catch_up(self, slot: int, target: SlotState) -> tuple[list[int], torch.Tensor | None]:
        known = target.prompt_ids + target.output_ids
        end = len(known) - 1  # the row at end - 1 reads the last known token and draws the first draft
        start, held = self.pending.pop(slot, (end, []))
        rows = torch.cat(held) if held else torch.empty(0, self.width, dtype=self.dtype, device=self.device)
        begin = min(max(int(self.engine.lengths[slot]), start), end - 1)
        self.engine.lengths[slot] = begin
        features = torch.zeros(end - begin, self.width, dtype=self.dtype, device=self.device)
        low, high = max(begin, start), min(end, start + len(rows))
        if high > low:
            features[low - begin : high - begin] = rows[low - start : high - start]
        # the target's step about to run gives the features from where its chunk starts (a resumed prefill's last
        # chunk carries a draft): the head's rows from there read zeros now and are redone with them next time
        self._ends[slot] = min(end, max(begin, int(self.target_lengths[slot])))
        return known[begin + 1 : end + 1], features

    def _launch(self, plan: StepPlan, features: list[torch.Tensor | None] | None = None) -> PendingStep:
        if plan.chunks:
            assert features is not None and all(f is not None for f in features)  # _catch_up gives a head's
            self.head.features = torch.cat(features)  # pyright: ignore[reportArgumentType]
        else:
            self.head.features = torch.stack([self._last[slot] for slot in plan.decodes])
        step = self.engine.launch(plan)
        out = self.head.next_features
        if plan.chunks:
            ends = np.cumsum([len(c.token_ids) for c in plan.chunks]) - 1
            self._last.update((c.slot, out[int(row)]) for c, row in zip(plan.chunks, ends))
        else:
            self._last.update((slot, out[i]) for i, slot in enumerate(plan.decodes))
        return step

    def _drafted(self, slots: list[int]) -> None:
        for slot in slots:  # the head's KV past the catch-up came from its own guesses: the next catch-up redoes it
            self.engine.lengths[slot] = self._ends.pop(slot)
        self._last = {}

    def kept(self, slot: int, length: int) -> None:
        super().kept(slot, length)
        if slot in self.pending:  # the verify rows past the kept ones saw draft tokens the target did not keep
            start, held = self.pending[slot]
            rows = torch.cat(held)[: max(0, length - start)]
            self.pending[slot] = (start, [rows])

    def reset(self) -> None:
        super().reset()
        self.pending.clear()
