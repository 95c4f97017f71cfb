"""Prefill-decode disaggregation's planning: one scheduler for two engines, each with its own KV pool.

A request prefills on the prefill engine, whose pool holds the prefix cache, and draws its first token there.
It is then handed over: the decode side admits it with pages of its own pool, and the plan that admits it
carries the copy of its prompt's KV from the prefill engine's pool (StepPlan.imports), which the decode engine
runs before that step's forward; the request decodes there to its end. The prefill side holds the pages until
the step that copied them has answered, then gives them to its prefix cache, as at a request's end."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.sampling_params import SamplingParams
from runtime.scheduler.scheduler import Request, Scheduler
from runtime.step import Sampled, StepPlan

ROLES = ("prefill", "decode")


class Disaggregated:
    def __init__(self, prefill: Scheduler, decode: Scheduler) -> None:
        if not prefill.prefill_only or decode.cache is not None:
            raise ValueError("a disaggregated pair is a prefill-only scheduler and a decode one without a prefix cache")
        self.sides = {"prefill": prefill, "decode": decode}
        self.prefill, self.decode = prefill, decode

    def add(self, rid: int, prompt_ids: list[int], params: SamplingParams, generated: Sequence[int] = (), pin: bool = False) -> Request:
        return self.prefill.add(rid, prompt_ids, params, generated, pin)

    def has_work(self) -> bool:
        return self.prefill.has_work() or self.decode.has_work()

    def schedule(self, role: str) -> StepPlan:
        return self.sides[role].schedule()

    def update(self, role: str, step: int, results: list[Sampled]) -> list[Request]:
        """A step's results on one side; a request that has drawn its first token on the prefill side (and goes on)
        moves to the decode side, and the prefill side lets go of what the decode side has copied."""
        advanced = self.sides[role].update(step, results)
        if role == "prefill":
            for request in advanced:
                if request.finish_reason is None and request.slot is not None and request.decoding:
                    pages = request.pages
                    self.decode.receive(self.prefill.hand_over(request), pages)
        self.release_copied()
        return advanced

    def release_copied(self) -> None:
        """The prefill side lets go of what the decode side has copied, or will not copy (Scheduler.reopen)."""
        copied, self.decode.imported = self.decode.imported, []
        for rid in copied:
            self.prefill.release(rid)

    def flush_cache(self) -> int:
        return self.prefill.flush_cache()

    def abort(self, rid: int) -> Request | None:
        """A copy planned already lets go of the prefill side's pages once its step has answered; one not planned
        yet, now."""
        if self.decode.incoming.pop(rid, None) is not None:
            self.prefill.release(rid)
        return self.prefill.abort(rid) or self.decode.abort(rid)
