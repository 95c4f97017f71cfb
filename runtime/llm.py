"""The in-process offline API: scheduler and engine tied together with no processes."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.config import EngineConfig
from runtime.engine.engine import Engine, PendingStep
from runtime.models.source import load_tokenizer, resolve_model_dir
from runtime.obs.gc_pauses import freeze_startup_heap
from runtime.sampling_params import SamplingParams
from runtime.scheduler.scheduler import Request, Scheduler


@dataclass(frozen=True)
class GenerationOutput:
    token_ids: list[int]
    text: str | None  # None when the model folder has no tokenizer
    finish_reason: str
    logprobs: list[dict[int, float]] | None
    prompt_tokens: int
    cached_tokens: int


class LLM:
    def __init__(self, model_path: str | Path | None = None, **options) -> None:
        self.model_dir = resolve_model_dir(None if model_path is None else str(model_path))
        self.config = EngineConfig(**options)
        self.engine = Engine(self.model_dir, self.config)
        cfg = self.engine.model_config
        self.scheduler = Scheduler(self.config, self.engine.num_pages, cfg.eos_token_ids, cfg.max_position)
        self.tokenizer = load_tokenizer(self.model_dir)
        self._rids = itertools.count()
        freeze_startup_heap()

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationOutput]:
        params = params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling parameters")
        requests = [self.scheduler.add(next(self._rids), self._encode(p), sp) for p, sp in zip(prompts, per_prompt)]
        in_flight: deque[tuple[int, PendingStep]] = deque()  # plan later steps while earlier ones run
        depth = self.config.steps_in_flight
        while self.scheduler.has_work() or in_flight:
            plan = self.scheduler.schedule() if len(in_flight) < depth else None
            if plan:
                in_flight.append((plan.step, self.engine.launch(plan)))
            if in_flight and (len(in_flight) == depth or not plan):
                step, pending = in_flight.popleft()
                self.scheduler.update(step, pending.result())
        return [self._output(r) for r in requests]

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer: pass token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def _output(self, request: Request) -> GenerationOutput:
        text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True) if self.tokenizer else None
        return GenerationOutput(
            token_ids=list(request.output_ids),
            text=text,
            finish_reason=request.finish_reason,
            logprobs=request.logprobs if request.params.logprobs is not None else None,
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=request.cached_tokens,
        )

    def flush_cache(self) -> int:
        return self.scheduler.flush_cache()
