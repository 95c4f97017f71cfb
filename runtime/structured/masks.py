"""The engine's side of structured output: a grammar matcher per constrained slot, fed the slot's
tokens as they are read back, and the batched mask of what each one allows next, applied to the
logits before the draw. A slot opened again (a preemption, a new epoch) replays its tokens into a
fresh matcher, so a constrained request survives both. Steps without a constrained slot never
reach this module. The vocabulary (runtime.structured.vocabulary) loads with the first grammar, on
the compile thread; on CUDA at start-up (warm_up), with the mask kernel.

Compiling a grammar against the vocabulary can take seconds, and never runs between steps: the
scheduler keeps a constrained request out of the batch (runtime.scheduler.scheduler.Request.compiling)
and asks its engines to compile ahead (`prepare`); the engine compiles on a worker thread and says
when the grammar is ready (`take_prepared`), and only then does the request join the batch. A compile
that runs past --grammar-compile-timeout refuses its request with a 400 instead.

- Two halves, two places: xgrammar's build of the grammar from a schema gives the GIL up only every few
  milliseconds, so it runs in a process of the engine's own (runtime.structured.builder) and comes back
  as text; its compile against the vocabulary releases the GIL throughout, and what it makes cannot
  cross a process cheaply (a 1 MB grammar's compiled form is 127 MB as JSON, and takes longer to read
  back than to compile), so it runs on the thread.
- The thread runs at a lower priority (runtime.structured.grammars.lower_priority), and the threads
  and the builder process it starts inherit it: on a CPU engine a step's own threads come first, and a compile takes
  what they leave (a step of 16 streams took 1.3x as long beside it, 3-4x beside a compile at the
  same priority; the compile took ~3x as long).
- One compile at a time, in the order asked; a request for a grammar already compiled or compiling
  waits for that one. The bound counts from when the compile started, not the queue before it: the
  400 says the grammar is too costly, never that the server is busy.
- A compile cannot be stopped: one past its bound runs to its end and its grammar is kept, so a later
  identical request is served from the cache, and one that comes while it still compiles is refused
  at once. Compiled grammars are kept by constraint (CACHE_BYTES), beside xgrammar's own cache by
  grammar.
- Where nothing waited for the compile, `open` compiles, or waits for the compile in flight, between
  steps, as before: a new engine reopening running requests over a kept KV pool, a tensor-parallel
  rank whose own compile trails rank 0's (only rank 0 answers, so every rank admits the same requests
  in the same step), the offline LLM, a grammar evicted from the cache.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from runtime.sampling_params import SamplingParams
from runtime.structured.builder import Builder
from runtime.structured.grammars import build_grammar, lower_priority
from runtime.structured.vocabulary import tokenizer_info

log = structlog.get_logger()
CACHE_BYTES = 256 << 20  # compiled grammars kept for reuse: xgrammar's cache by grammar, and ours by constraint
Guide = tuple[str, str]  # runtime.sampling_params.SamplingParams.guide: (kind, spec)


@dataclass
class _Slot:
    matcher: Any  # xgrammar.GrammarMatcher
    fed: int = 0  # output tokens accepted so far


@dataclass
class _Compile:
    """One constraint's compile on the worker thread; `started`: when the worker took it up."""

    started: float | None = None
    future: Future[Any] = field(init=False)


class _Worker:
    """One thread that runs compiles in the order they come. A daemon: a compile cannot be stopped, and no
    process exit should wait for one."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="grammar", daemon=True).start()

    def submit(self, work: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((future, work))
        return future

    def _run(self) -> None:
        lower_priority()
        while True:
            future, work = self._queue.get()
            if not future.set_running_or_notify_cancel():  # cancelled while it waited
                continue
            try:
                future.set_result(work())
            except Exception as exc:
                future.set_exception(exc)


class GrammarMasks:
    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...], compile_timeout: float = 10.0) -> None:
        self.model_dir, self.vocab_size, self.eos_token_ids = model_dir, vocab_size, eos_token_ids
        self.compile_timeout = compile_timeout
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()  # the compiler loads once, on whichever thread needs it first
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher: fills many rows' masks on a thread pool
        self._slots: dict[int, _Slot] = {}
        self._errors: dict[int, str] = {}  # slot -> why its grammar failed, until the engine takes it
        self._bitmask: torch.Tensor | None = None
        self._compiled: OrderedDict[Guide, Any] = OrderedDict()  # xgrammar.CompiledGrammar by constraint, least recent first
        self._compiled_bytes = 0
        self._compiling: dict[Guide, _Compile] = {}
        self._waiting: dict[int, Guide] = {}  # request id -> the constraint it waits for out of the batch
        self._worker: _Worker | None = None
        self._builder = Builder()  # the compile thread's: a process started with the first grammar

    def _loaded_compiler(self, beside_steps: bool) -> Any:
        """xgrammar's compiler for the vocabulary, loaded on first use (runtime.structured.vocabulary); where it
        runs `beside_steps` (on the compile thread), the builder process is started too, and a vocabulary that
        no cache holds is built there."""
        import xgrammar as xgr

        with self._compiler_lock:
            if self._compiler is None:
                build = None
                if beside_steps:
                    build = functools.partial(self._builder.vocabulary, str(self.model_dir), self.vocab_size, list(self.eos_token_ids))
                info = tokenizer_info(self.model_dir, self.vocab_size, self.eos_token_ids, build)
                self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1), cache_limit_bytes=CACHE_BYTES)
        if beside_steps:
            self._builder.start()
        return self._compiler

    def _compile(self, guide: Guide, job: _Compile | None = None) -> Any:
        """The guide's grammar compiled against the vocabulary. For a `job` (on the compile thread), built by
        the builder process, and its bound counts from there, once the compiler and the builder are ready;
        else built here (between steps: a server's request got here only once a job had built, and so bounded,
        the same grammar)."""
        import xgrammar as xgr

        compiler = self._loaded_compiler(beside_steps=job is not None)
        if job is None:
            grammar = build_grammar(*guide)
        else:
            job.started = time.monotonic()
            grammar = self._builder.grammar(*guide)
        return compiler.compile_grammar(xgr.Grammar.deserialize_json(grammar))

    def warm_up(self, device: torch.device) -> None:
        """What the first grammar would wait for: the vocabulary's grammar compiler (seconds for a large
        vocabulary), and the mask kernel, which would build between steps (Triton's, at its first run)."""
        if not any(self.model_dir.glob("tokenizer*")):  # token ids only: nothing can be constrained
            return
        if importlib.util.find_spec("xgrammar") is None:  # an optional extra: the engine serves, a guided request fails
            return
        self._loaded_compiler(beside_steps=False)
        self._apply_masks(torch.zeros(1, self.vocab_size, device=device), self._bitmask_rows(1, device), [0])

    def open(self, slot: int, params: SamplingParams) -> None:
        """A slot whose draws the grammar constrains; its tokens so far are fed at the next mask."""
        import xgrammar as xgr

        stops = sorted({*self.eos_token_ids, *params.stop_token_ids})
        assert params.guide is not None  # only a guided slot is opened
        self._slots[slot] = _Slot(xgr.GrammarMatcher(self._compiled_grammar(params.guide), override_stop_tokens=stops))

    def close(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def clear(self) -> None:
        """A new epoch: no slot, and no request waits (the new scheduler asks again); compiles under way go on."""
        self._slots.clear()
        self._errors.clear()
        self._waiting.clear()
        self._drop_unwanted()

    def stop(self) -> None:
        """Ends the builder process (the engine's exit ends it anyway: its stdin closes, and a kill signals it)."""
        self._builder.close()

    @property
    def waiting(self) -> bool:
        """Does a request wait for its grammar (take_prepared has answers to come)?"""
        return bool(self._waiting)

    def prepare(self, rid: int, guide: Guide) -> None:
        """Request `rid` waits out of the batch for the guide's grammar: compile it on the worker thread,
        unless it is compiled or compiling already. take_prepared says when it is ready."""
        self._waiting[rid] = guide
        if guide not in self._compiled and guide not in self._compiling:
            self._submit(guide)

    def forget(self, rid: int) -> None:
        """Request `rid` waits no more (it was aborted): its compile is not run if nothing else waits for it."""
        if self._waiting.pop(rid, None) is not None:
            self._drop_unwanted()

    def take_prepared(self) -> list[tuple[int, str | None]]:
        """The waiting requests that wait no more: (rid, None) where their grammar is compiled, (rid, why)
        where its compile failed or has run past the bound (for the client's 400)."""
        if not self._waiting:
            return []
        failed = self._collect()
        now, answers = time.monotonic(), []
        for rid, guide in list(self._waiting.items()):
            job = self._compiling.get(guide)
            if guide in self._compiled:
                error = None
            elif guide in failed:
                error = failed[guide]
            elif job is not None and job.started is not None and now - job.started > self.compile_timeout:
                error = f"the grammar took longer than {self.compile_timeout:g} s to compile"
            else:
                if job is None:  # compiled, then evicted before the request was told
                    self._submit(guide)
                continue
            del self._waiting[rid]
            answers.append((rid, error))
            if error is not None:
                log.warning("grammar_refused", rid=rid, kind=guide[0], why=error)
        self._drop_unwanted()
        return answers

    def _submit(self, guide: Guide) -> None:
        if self._worker is None:
            self._worker = _Worker()
        job = _Compile()
        job.future = self._worker.submit(functools.partial(self._compile, guide, job))
        self._compiling[guide] = job

    def _collect(self) -> dict[Guide, str]:
        """Finished compiles: their grammars are kept; returns why each that failed did."""
        failed = {}
        for guide, job in list(self._compiling.items()):
            if not job.future.done():
                continue
            del self._compiling[guide]
            if job.future.cancelled():
                continue
            try:
                self._keep(guide, job.future.result())
            except Exception as exc:  # GuideError, or xgrammar's RuntimeError: this request's fault, not the engine's
                failed[guide] = f"the grammar cannot be compiled: {exc}"
            else:
                assert job.started is not None  # a compile that ran
                log.info("grammar_compiled", kind=guide[0], compile_s=round(time.monotonic() - job.started, 3))
        return failed

    def _drop_unwanted(self) -> None:
        """Queued compiles that no request waits for any more are not run."""
        wanted = set(self._waiting.values())
        for guide, job in list(self._compiling.items()):
            if guide not in wanted and job.future.cancel():
                del self._compiling[guide]

    def _keep(self, guide: Guide, compiled: Any) -> Any:
        if (old := self._compiled.pop(guide, None)) is not None:
            self._compiled_bytes -= old.memory_size_bytes
        self._compiled[guide] = compiled
        self._compiled_bytes += compiled.memory_size_bytes
        while self._compiled_bytes > CACHE_BYTES and len(self._compiled) > 1:
            self._compiled_bytes -= self._compiled.popitem(last=False)[1].memory_size_bytes
        return compiled

    def _compiled_grammar(self, guide: Guide) -> Any:
        """The guide's compiled grammar: kept, else the compile in flight waited for, else compiled now,
        between steps (where nothing waited for it: see the module's docstring)."""
        if (compiled := self._compiled.get(guide)) is not None:
            self._compiled.move_to_end(guide)
            return compiled
        if (job := self._compiling.pop(guide, None)) is not None and not job.future.cancel():
            return self._keep(guide, job.future.result())
        started = time.monotonic()
        compiled = self._keep(guide, self._compile(guide))
        log.info("grammar_compiled_between_steps", kind=guide[0], compile_s=round(time.monotonic() - started, 3))
        return compiled

    def constrains(self, slots: np.ndarray) -> bool:
        """Does a grammar hold any of these slots? Free (no list is built) while no slot is constrained."""
        return bool(self._slots) and any(slot in self._slots for slot in slots.tolist())

    def apply(self, logits: torch.Tensor, slots: list[int], outputs: list[list[int]]) -> None:
        """Masks row i of `logits` to what slot slots[i]'s grammar allows after outputs[i] (every
        token the slot has drawn, read back). A grammar that allows no token there fails its slot
        (take_errors) and leaves its row as it is: the request ends with the error, not with that draw.
        A slot's later rows are a speculative step's, each after one more draft token (_draft_masks)."""
        import xgrammar as xgr

        rows_of: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            rows_of.setdefault(slot, []).append(i)
        live = [(rows[0], slot, state) for slot, rows in rows_of.items() if (state := self._feed(slot, outputs[rows[0]])) is not None]
        if live:
            rows = [i for i, _, _ in live]
            bitmask = self._bitmask_rows(len(slots), logits.device)
            self._batch = self._batch or xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask([state.matcher for _, _, state in live], bitmask, rows)
            allows = bitmask[rows].ne(0).any(dim=1).tolist()
            masked = []
            for (i, slot, state), some in zip(live, allows):
                if not some:
                    self._fail(slot, state)
                    continue
                masked.append(i)
                if len(rows_of[slot]) > 1:
                    masked += self._draft_masks(state, rows_of[slot], outputs, bitmask)
            if masked:
                self._apply_masks(logits, bitmask, masked)

    @staticmethod
    def _draft_masks(state: _Slot, rows: list[int], outputs: list[list[int]], bitmask: torch.Tensor) -> list[int]:
        """The masks of a speculative step's rows after its first: the grammar takes the draft a token a row and
        gives it back after. It stops at a draft token it refuses (the draw before it, masked, cannot be that
        token, so no later row is kept) or that ends it. Returns the rows masked."""
        base, taken, masked = len(outputs[rows[0]]), 0, []
        for i in rows[1:]:
            if state.matcher.is_terminated() or not state.matcher.accept_token(outputs[i][base + taken]):
                break
            taken += 1
            if state.matcher.is_terminated():
                break
            state.matcher.fill_next_token_bitmask(bitmask, i)
            masked.append(i)
        if taken:
            state.matcher.rollback(taken)
        return masked

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
