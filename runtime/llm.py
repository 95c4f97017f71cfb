"""The in-process offline API: scheduler and engine tied together with no processes. Under tensor
parallelism the caller's process is rank 0 and the other ranks are processes of their own, which
rank 0 hands each step plan to (torch.distributed's broadcast). Under prefill-decode disaggregation
(--pd) a prefill engine and a decode engine run side by side in the caller's process, under one
scheduler (runtime.scheduler.disaggregated)."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import shutil
import tempfile
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from runtime.config import EngineConfig, ModelConfig, speculative_fields
from runtime.distributed import SINGLE, TensorParallel, check_parallel, rank_device
from runtime.engine.engine import Engine, PendingStep
from runtime.models.lora import Adapters
from runtime.models.source import load_tokenizer, resolve_model_dir
from runtime.obs.gc_pauses import freeze_startup_heap
from runtime.sampling_params import SamplingParams
from runtime.scheduler.disaggregated import ROLES, Disaggregated
from runtime.scheduler.scheduler import Request, Scheduler
from runtime.step import PromptLogprob, Sampled, StepPlan
from transport.lifetime import on_parent_death


@dataclass(frozen=True)
class GenerationOutput:
    token_ids: list[int]
    text: str | None  # None when the model folder has no tokenizer
    finish_reason: str
    logprobs: list[dict[int, float]] | None
    prompt_tokens: int
    cached_tokens: int
    # with SamplingParams.prompt_logprobs: per prompt position after the first, (log-probability, rank, top pairs)
    prompt_logprobs: list[PromptLogprob] | None = None


def _serve_rank(model_dir: Path, config: EngineConfig, rank: int, rendezvous: str) -> None:
    """A rank other than 0 of an in-process LLM: every plan rank 0 broadcasts, until None."""
    on_parent_death()
    device = rank_device(config.device, rank)
    engine = Engine(model_dir, config, TensorParallel.join(rank, config, rendezvous, device), device)
    unread: deque[PendingStep] = deque()
    assert config.steps_in_flight is not None  # EngineConfig fills in the device's default
    while (plan := engine.tp.broadcast(None)) is not None:
        unread.append(engine.launch(plan))
        if len(unread) >= config.steps_in_flight:
            unread.popleft().result()
    os._exit(0)  # tearing down a communicator that CUDA graphs captured can hang; the process ends anyway


class _Ranks:
    """Ranks 1..N-1 of an in-process LLM, and the rendezvous they met rank 0 at."""

    def __init__(self, model_dir: Path, config: EngineConfig) -> None:
        self.folder = tempfile.mkdtemp(prefix="ringllm-tp-")
        self.rendezvous = f"{self.folder}/rendezvous"
        spawn = mp.get_context("spawn")
        self.procs = [
            spawn.Process(target=_serve_rank, args=(model_dir, config, rank, self.rendezvous), daemon=True)
            for rank in range(1, config.tensor_parallel_size)
        ]
        for proc in self.procs:
            proc.start()

    @staticmethod
    def stop(tp: TensorParallel, procs: list, folder: str) -> None:
        """Rank 0 keeps its side of the group until the next LLM's join replaces it (TensorParallel.join)."""
        try:
            tp.broadcast(None)
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
            shutil.rmtree(folder, ignore_errors=True)


class Side(NamedTuple):
    """An engine and how the scheduler plans for it and takes its results."""

    engine: Engine
    schedule: Callable[[], StepPlan]
    update: Callable[[int, list[Sampled]], object]


class LLM:
    def __init__(
        self,
        model_path: str | Path | None = None,
        config: EngineConfig | None = None,
        speculative_config: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """`config` as `ringllm serve` builds it (EngineConfig.from_cli_args), or EngineConfig's fields as keyword
        arguments; given both, the keywords change those fields of `config`. `speculative_config`: vLLM's (or the
        speculative fields without their prefix), e.g. {"method": "ngram", "num_speculative_tokens": 4}."""
        options |= speculative_fields(speculative_config or {})
        self.model_dir = resolve_model_dir(None if model_path is None else str(model_path))
        self.config = EngineConfig(**options) if config is None else replace(config, **options)
        check_parallel(ModelConfig.load(self.model_dir), self.config)
        tp, device = SINGLE, rank_device(self.config.device, 0)
        if self.config.tensor_parallel_size > 1:
            ranks = _Ranks(self.model_dir, self.config)
            tp = TensorParallel.join(0, self.config, ranks.rendezvous, device)
            self._finalizer = weakref.finalize(self, _Ranks.stop, tp, ranks.procs, ranks.folder)
        self.engine = Engine(self.model_dir, self.config, tp, device)
        cfg = self.engine.model_config
        tiers = self.engine.tiers
        host_pages, disk = (tiers.num_pages, tiers.disk) if tiers else (0, None)
        self.scheduler: Scheduler | Disaggregated = Scheduler(
            self.config, self.engine.num_pages, cfg.eos_token_ids, cfg.max_position, host_pages, disk, cfg.long_rope_from, cfg.window
        )
        self.engines = [self.engine]  # under --pd, the prefill one and the decode one
        if self.config.pd:
            self._disaggregate()
        self.tokenizer = load_tokenizer(self.model_dir)
        self._rids = itertools.count()
        freeze_startup_heap()

    def _disaggregate(self) -> None:
        """The engine above prefills; a second one decodes, copying from the first's pool. In one process, on CPU:
        two CUDA engines would share the process's current device."""
        if self.engine.device.type != "cpu":
            raise ValueError("in process, prefill-decode disaggregation runs on CPU; on GPUs, serve it (`ringllm serve --pd`)")
        cfg = self.engine.model_config
        decode = Engine(self.model_dir, self.config, SINGLE, self.engine.device)
        decode.peer = self.engine.pool
        prefill = Scheduler(self.config, self.engine.num_pages, cfg.eos_token_ids, cfg.max_position, prefill_only=True)
        decoding = Scheduler(replace(self.config, enable_prefix_cache=False), decode.num_pages, cfg.eos_token_ids, cfg.max_position)
        self.scheduler = Disaggregated(prefill, decoding)
        self.engines.append(decode)

    def _sides(self) -> list[Side]:
        """Each engine, and how the scheduler plans for it and takes its results."""
        pair = self.scheduler
        if isinstance(pair, Scheduler):
            return [Side(self.engine, pair.schedule, pair.update)]
        return [Side(engine, partial(pair.schedule, role), partial(pair.update, role)) for role, engine in zip(ROLES, self.engines)]

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the config's override_generation_config applied, what a request to the
        server that leaves every sampling field out runs with; generate's default."""
        return SamplingParams(**dict(self.config.override_generation_config))

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationOutput]:
        params = params or self.get_default_sampling_params()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling parameters")
        loaded = self.engine.adapters.loaded if self.engine.adapters is not None else {}
        if unknown := sorted({sp.lora for sp in per_prompt if sp.lora is not None and sp.lora not in loaded}):
            raise ValueError(f"no LoRA adapter named {', '.join(unknown)} is loaded; loaded: {sorted(loaded)}")
        requests = [self.scheduler.add(next(self._rids), self._encode(p), sp) for p, sp in zip(prompts, per_prompt)]
        sides = self._sides()
        in_flight: list[deque[tuple[int, PendingStep]]] = [deque() for _ in sides]  # plan later steps while earlier ones run
        depth = self.config.steps_in_flight
        assert depth is not None  # EngineConfig fills in the device's default
        while self.scheduler.has_work() or any(in_flight):
            for side, queue in zip(sides, in_flight):
                plan = side.schedule() if len(queue) < depth else None
                if plan:
                    if side.engine.tp.size > 1:
                        side.engine.tp.broadcast(plan)
                    queue.append((plan.step, side.engine.launch(plan)))
                if queue and (len(queue) == depth or not plan):
                    step, pending = queue.popleft()
                    side.update(step, pending.result())
        return [self._output(r) for r in requests]

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer: pass token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def _output(self, request: Request) -> GenerationOutput:
        assert request.finish_reason is not None  # generate runs every request to its end
        text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True) if self.tokenizer else None
        return GenerationOutput(
            token_ids=list(request.output_ids),
            text=text,
            finish_reason=request.finish_reason,
            logprobs=request.logprobs if request.params.logprobs is not None else None,
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=request.cached_tokens,
            prompt_logprobs=request.prompt_logprobs,
        )

    def flush_cache(self) -> int:
        return self.scheduler.flush_cache()

    def load_lora_adapter(self, name: str, path: str | Path) -> None:
        """Serve the PEFT adapter at `path` as `name` (SamplingParams.lora); a name loaded already takes the new weights,
        and the prefix cache, which may hold KV of the old ones, is flushed."""
        adapters = self._adapters()
        reloaded = name in adapters.loaded
        adapters.load(name, str(path))
        if reloaded:
            self.flush_cache()

    def unload_lora_adapter(self, name: str) -> None:
        self._adapters().unload(name)
        self.flush_cache()  # its prefixes: a later adapter of the same name must not read them

    def _adapters(self) -> Adapters:
        if self.engine.adapters is None:
            raise ValueError("LoRA is off: LLM(..., enable_lora=True) serves adapters")
        if self.config.tensor_parallel_size > 1:
            raise ValueError("in process, adapters load at start under tensor parallelism (lora_paths)")
        return self.engine.adapters

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (also done when the LLM is garbage-collected)."""
        if hasattr(self, "_finalizer"):
            self._finalizer()
