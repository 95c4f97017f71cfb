"""The step protocol between scheduler and engine: per step, only deltas travel.

The engine keeps per-slot state (page table, length, last sampled token, sampling parameters);
the scheduler sends new slots, appended pages, prefill chunks, decode slots and freed slots,
and the engine answers with the token sampled for each slot that finished its input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.sampling import SamplingParams


@dataclass(frozen=True)
class NewSlot:
    slot: int
    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]  # tokens generated before a preemption; penalties and positions count them
    cached: int  # leading tokens whose KV the slot's first pages already hold (prefix cache)


@dataclass(frozen=True)
class Chunk:
    slot: int
    token_ids: list[int]  # fed at the slot's current length onwards
    sample: bool  # the chunk ends the sequence's known tokens: sample the next one


@dataclass
class StepPlan:
    freed: list[int] = field(default_factory=list)  # applied first: a freed slot may be reused below
    new_slots: list[NewSlot] = field(default_factory=list)
    pages: list[tuple[int, list[int]]] = field(default_factory=list)  # appended to the slot's page table
    chunks: list[Chunk] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)  # slots fed their own last sampled token

    def __bool__(self) -> bool:
        return bool(self.chunks or self.decodes)


@dataclass(frozen=True)
class Sampled:
    slot: int
    token: int
    logprobs: dict[int, float] | None
