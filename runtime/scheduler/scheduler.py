"""The scheduler: request table, admission, continuous batching, chunked prefill, pages, prefix
cache and preemption. Pure Python: it plans steps and never touches a tensor."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from runtime.config import MODEL_DRAFTS, EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.scheduler.ngram import ngram_draft
from runtime.scheduler.pages import PageAllocator
from runtime.scheduler.radix_cache import RadixCache, RadixNode
from runtime.scheduler.tiers import TIER_NAMES, Tiers
from runtime.scheduler.window_pages import WindowPages
from runtime.step import DRAFT_HERE, MAX_PLAN_HISTORY_TOKENS, Chunk, HeldKV, HostEntry, NewSlot, PromptLogprob, Sampled, StepPlan

FINISH_REASONS = ("stop", "length", "abort")  # every finish_reason a request can end with
LONG_ROPE_SALT = "\x00long-rope"  # what a LongRoPE model's long prompt adds to its cache salt (Scheduler.add)
LORA_SALT = "\x00lora:"  # before the adapter's name, what a request with a LoRA adapter adds to its cache salt
# NGRAM found no draft: a lookup needs every token answered, which stalls the device between steps, so the
# request decodes this many steps with the others in flight before it looks again
PLAIN_DECODES_AFTER_A_MISS = 4
CRASHED_TWICE = "it crashed the engine twice, the second time alone in its step: it was ended so that the other requests go on"


@dataclass
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] | None = None  # positions 1.. of the prompt, with the first token
    finish_reason: str | None = None
    error: str | None = None  # why the engine could not go on (then finish_reason is "abort"): its client gets this
    crashed: bool = False  # with `error`: it crashed the engine twice (Scheduler.after_crash), a server error
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    matched: int = 0  # tokens found in the prefix cache at its latest admission
    # dropped on preemption:
    slot: int | None = None
    pages: list[int] = field(default_factory=list)  # the page table: shared prefix pages, then own
    shared_pages: int = 0
    window_from: int = 0  # with sliding windows: it holds the window pages of pages[window_from:]
    prefix: RadixNode | None = None
    computed: int = 0  # leading tokens whose KV is in `pages` once the planned steps have run
    confirmed: int = 0  # leading tokens whose KV is in `pages` already: the steps that wrote it have answered
    decoding: bool = False  # the engine holds the last token (it sampled it)
    admitted_step: int = 0  # results of earlier steps for its slot belonged to someone else
    pin: bool = False  # a prefix warm-up: its prompt's whole pages stay cached until unpin_prefixes
    compiling: bool = False  # its grammar is compiling (runtime.structured.masks): it is not admitted yet
    fresh: int = 0  # tokens the latest update gave it (a speculative step gives several)
    plain_decodes: int = 0  # NGRAM found no draft: decodes to plan with the steps in flight before the next lookup

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_pages: int,
        eos_token_ids: tuple[int, ...],
        max_position: int,
        host_pages: int = 0,
        disk: Path | None = None,
        long_rope_from: int | None = None,
        window: int = 0,
        prefill_only: bool = False,
    ) -> None:
        """`host_pages`: the host tier's size in pages, under --enable-hierarchical-cache, and `disk` the folder of
        its page files (both as the engine has them: runtime.engine.kv_tiers). `long_rope_from`: LongRoPE's
        pretraining length (ModelConfig.long_rope_from), past which a prompt's KV is roped otherwise. `window`: the
        model's longest sliding window (ModelConfig.window), whose layers keep pages in the window pool.
        `prefill_only`: a disaggregated prefill engine's (runtime.scheduler.disaggregated): a request that has drawn its
        first token is not fed again, but handed over."""
        self.config = config
        self.prefill_only = prefill_only
        self.long_rope_from = long_rope_from
        self.page_size = config.page_size
        self.allocator = PageAllocator(num_pages)
        self.windows: WindowPages | None = None
        if window:
            pages = config.window_pages_for(num_pages, window)
            self.windows = WindowPages(pages, window, config.page_size, config.window_prefill_pages(window))
            self.allocator.on_free = self.windows.drop
        tiers = None
        if config.hierarchical_cache:
            tiers = Tiers(PageAllocator(host_pages), config.hicache_write_policy == "write_through", disk)
        replaced = self.windows.replace if self.windows is not None else None
        self.cache = RadixCache(self.allocator, config.page_size, tiers, replaced) if config.enable_prefix_cache else None
        self.tier_hits = dict.fromkeys(TIER_NAMES, 0)  # prompt tokens found in each tier at admission
        # speculative decoding: a request is fed its last token and a draft once its step before has answered
        self.speculative = config.speculative_algorithm is not None
        self.speculating = self.speculative  # this plan drafts: off while more requests run than it pays for
        self.draft_seconds = 0.0  # spent drafting, in all
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_position = max_position
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._free_slots = list(range(config.max_running_requests - 1, -1, -1))
        self._by_slot: dict[int, Request] = {}
        self._freed: list[int] = []
        self._seeds = random.Random(config.seed)
        self.reused_prefix_tokens = 0
        self.preemptions = 0
        self.ended: list[Request] = []  # finished while planning (they outgrew the pool); see take_ended
        self.admitted: list[Request] = []
        self.pins: dict[tuple[int, ...], tuple[RadixNode, int]] = {}  # warmed prefix (whole pages) -> its node, its pages
        self._step = 0
        self._chunk_ends: dict[int, list[tuple[Request, int]]] = {}  # by step in flight: where each chunk's KV ends
        self._resync = True  # the next plan is the first its engine runs (StepPlan.resync)
        # KV a surviving engine held for requests of the epoch before, by rid, until each is replayed: its tokens,
        # and the pages the request takes back (with a prefix cache, its whole pages are in the tree: only the tail)
        self.adopted: dict[int, tuple[list[int], list[int]]] = {}
        # disaggregated: requests handed over by rid, as they were, holding their pages until the copy is done (release);
        # on the decode side, the prefill pool's pages of requests received and not admitted yet, and the requests whose
        # copies each step in flight runs
        self.handed: dict[int, Request] = {}
        self.incoming: dict[int, list[int]] = {}
        self._imports: dict[int, list[int]] = {}
        self.imported: list[int] = []  # rids whose copies have run (update): the prefill side may release their pages
        # after a crash of the engine, each request its lost steps fed (by rid, in order): how many steps it still runs
        # alone (one a lost step that fed it); by step in flight, the request a step runs alone
        self.quarantine: dict[int, int] = {}
        self._solo: dict[int, Request] = {}

    def add(self, rid: int, prompt_ids: list[int], params: SamplingParams, generated: Sequence[int] = (), pin: bool = False) -> Request:
        """Queue a request; `generated`: tokens of a replay, recomputed like a preempted request's where
        no adopted KV holds them (adopt);
        `pin`: a prefix warm-up, whose prompt stays in the prefix cache once it has run."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_position:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_position}")
        if self.config.pages_for(len(prompt_ids) + 1) > self.allocator.num_pages:
            raise ValueError(f"the prompt needs more KV pages than the pool has ({self.allocator.num_pages})")
        if params.max_tokens is None:  # the rest of the context, within the server's default, as vLLM does
            room = self.max_position - len(prompt_ids)
            params = replace(params, max_tokens=min(room, self.config.default_max_tokens or room))
        if self.long_rope_from is not None and len(prompt_ids) > self.long_rope_from:  # LongRoPE's long factors at every
            params = replace(params, cache_salt=f"{params.cache_salt or ''}{LONG_ROPE_SALT}")  # position: KV of its own
        if params.lora is not None:  # KV computed through an adapter is the adapter's: its prefixes are cached apart
            params = replace(params, cache_salt=f"{params.cache_salt or ''}{LORA_SALT}{params.lora}")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = Request(rid, list(prompt_ids), params, seed, list(generated), pin=pin)
        self._queue(request, first=False)
        return request

    def _queue(self, request: Request, first: bool) -> None:
        """Into the waiting queue, at its end (a new request) or its front (a preempted one); under
        the priority policy, at the end or front of those of its priority."""
        if self.config.schedule_policy == "fcfs":
            if first:
                self.waiting.appendleft(request)
            else:
                self.waiting.append(request)
            return
        priority = request.params.priority
        behind = (lambda r: r.params.priority >= priority) if first else (lambda r: r.params.priority > priority)
        self.waiting.insert(next((i for i, r in enumerate(self.waiting) if behind(r)), len(self.waiting)), request)

    def take_ended(self) -> list[Request]:
        ended, self.ended = self.ended, []
        return ended

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def used_pages(self) -> int:
        return self.allocator.num_pages - self.allocator.num_free

    def schedule(self) -> StepPlan:
        """The next step; it needs no results of the previous one, as the engine feeds decodes itself."""
        self._step += 1
        plan = StepPlan(step=self._step, freed=self._freed, resync=self._resync)
        self._freed, self.admitted = [], []
        if self._resync:  # an engine over the pool a dead one left: the running requests' slots open again
            for request in self.running:
                assert request.slot is not None  # a running request holds a slot
                plan.new_slots.append(self._new_slot(request))
                plan.pages.append((request.slot, list(request.pages)))
            if self.windows is not None:  # and every pairing of the window pool
                self.windows.assigned = list(self.windows.of.items())
        for request in self.running:
            self._slide(request)
        solo = self._suspect()
        budget, mixed = self.config.max_prefill_tokens, self.config.mixed_chunk
        assert budget is not None  # EngineConfig fills in the device's default
        limit = self.config.speculative_disable_by_batch_size
        self.speculating = self.speculative and (limit is None or len(self.running) <= limit)
        for request in list(self.running):
            if solo is not None and request is not solo:
                continue
            if self.speculating and request.decoding:  # back to drafting once its decodes in flight have answered
                if request.plain_decodes and request.slot is not None and not self._fully_planned(request):
                    if self._grow(request, 1, plan):  # after a lookup that found nothing: decodes, overlapped as plain ones
                        self._feed(request, 1, plan)
                        request.plain_decodes -= 1
                    continue
                if request.computed != len(request.tokens) - 1:
                    continue
                request.decoding, request.plain_decodes = False, 0
            if request.slot is None or (request.decoding and (self._fully_planned(request) or not mixed or self.prefill_only)):
                continue  # preempted earlier in this loop, its last token already being drawn, decoded below, or handed over
            prefilling = not request.decoding
            known = len(request.tokens) - request.computed
            # a drafting request's next step feeds its last token and a draft: a decode's share, not the prefill budget's
            drafting = prefilling and known == 1 and bool(request.output_ids)
            count = min(known, budget) if prefilling and not drafting else 1
            if count <= 0:
                continue
            drafts = self._draft(request, count) if prefilling else []
            if self._grow(request, count + len(drafts), plan):
                self._feed(request, count, plan, drafts)
                budget -= count if prefilling and not drafting else 0
                if drafting and not drafts and self.speculating:  # nothing to draft: some plain decodes before looking again
                    request.decoding, request.plain_decodes = True, PLAIN_DECODES_AFTER_A_MISS
        history = 0
        adapters = {r.params.lora for r in self.running} - {None}
        for request in list(self.waiting):
            if budget <= 0 or not self._free_slots:
                break
            if request.compiling or (solo is not None and request is not solo):  # it waits for its grammar or its turn
                continue
            if (lora := request.params.lora) is not None and lora not in adapters:
                if len(adapters) >= self.config.max_loras_per_batch:  # one adapter too many for a step: the queue passes it by
                    continue
                adapters.add(lora)
            history += len(request.tokens)
            if plan.new_slots and history > MAX_PLAN_HISTORY_TOKENS or not self._admit(request, plan):
                break
            self.waiting.remove(request)
            count = min(len(request.tokens) - request.computed, budget)
            self._grow(request, count, plan)
            self._feed(request, count, plan)
            budget -= count
        # prefill first: decodes get the steps with nothing to prefill
        if not (mixed or plan.chunks or self.speculating or self.prefill_only):
            for request in list(self.running):
                if solo is not None and request is not solo:
                    continue
                if request.slot is not None and request.decoding and not self._fully_planned(request) and self._grow(request, 1, plan):
                    self._feed(request, 1, plan)
        if solo is not None:
            if not (plan.chunks or plan.decodes):  # it cannot run now (no pages): it rejoins the batch, the next runs
                del self.quarantine[solo.rid]
                self._freed = plan.freed
                return self.schedule()
            self._solo[plan.step] = solo
        if not plan:
            self._freed = plan.freed  # sent with the next real step (so are the KV moves queued meanwhile)
            if self.adopted and not self._resync and not self.has_work():  # the replays have come and gone
                self.release_adopted()
        else:
            self._resync = False  # a plan goes out
            if self.cache is not None:
                plan.moves = self.cache.take_moves(plan.step)
            if self.windows is not None:
                plan.window_pages = self.windows.take_assigned()
        return plan

    def _suspect(self) -> Request | None:
        """The quarantined request this plan runs alone, the first still here; None while none is quarantined."""
        while self.quarantine:
            rid = next(iter(self.quarantine))
            if (request := next((r for r in (*self.running, *self.waiting) if r.rid == rid), None)) is not None:
                return request
            del self.quarantine[rid]  # it ended meanwhile
        return None

    def after_crash(self, lost: list[StepPlan], launched: int) -> list[Request]:
        """The engine died of a crash (not of a kill: actors.control.crashed) with these plans unanswered, the last
        it had begun to launch `launched`. A request that ran alone in a step the dead engine launched has crashed it
        twice, the first time in a batch: it ends with an error (returned), so that the crash loop stops. Every other
        request they fed is quarantined: it runs alone, a step for each lost one that fed it, so that a second crash
        names the request that causes it, and only that one. A solo step the engine never began (it died before,
        in its start-up, say) blames nobody: its request runs alone again."""
        ended = []
        for plan in lost:
            if (request := self._solo.pop(plan.step, None)) is not None:
                if plan.step <= launched:  # the dead engine ran it: the request crashed it alone
                    self.quarantine.pop(request.rid, None)
                    if request in self.running:
                        request.error, request.crashed, request.finish_reason = CRASHED_TWICE, True, "abort"
                        self._finish(request)
                        ended.append(request)
                continue  # else the engine died before it began: the request runs alone again
            for rid in {r.rid for slot in [c.slot for c in plan.chunks] + plan.decodes if (r := self._by_slot.get(slot))}:
                self.quarantine[rid] = self.quarantine.get(rid, 0) + 1
        return ended

    def _slide(self, request: Request) -> None:
        """Its window pages before the first its next query sees go back (by `confirmed`: the steps after it may
        be run again, should the engine die)."""
        if self.windows is None:
            return
        first = min(self.windows.first_seen(request.confirmed), len(request.pages))
        if first > request.window_from:
            self.windows.release(request.pages[request.window_from : first])
            request.window_from = first

    def _let_go(self, request: Request) -> None:
        """It holds no window page any more (it stops running, or is not admitted after all)."""
        if self.windows is not None:
            self.windows.release(request.pages[request.window_from :])
            request.window_from = len(request.pages)

    def adopt(self, held: list[HeldKV], host: list[HostEntry] | None = None) -> None:
        """The KV an engine kept across the new epoch that made this scheduler (a scheduler's death): each
        request, replayed with the same rid, takes its pages back instead of recomputing them. With a prefix
        cache, every whole page goes into the tree (two requests may share them), and only a partial last
        page waits for its request. `host`: the host tier's index, whose chains go into the tree first."""
        if host and self.cache is not None and self.cache.tiers is not None:
            self.cache.restore(host)
        if self.windows is not None:  # which window page held what died with the scheduler before: replays recompute
            return
        taken: set[int] = set()
        for rid, tokens, pages, salt in held:
            self.allocator.take(page for page in pages if page not in taken)
            taken.update(pages)
            if self.cache is None:
                self.adopted[rid] = (tokens, pages)
                continue
            whole = len(tokens) // self.page_size
            self.cache.insert(tokens[: whole * self.page_size], pages[:whole], salt)
            if whole < len(pages):
                self.adopted[rid] = (tokens, pages[whole:])

    def _claim(self, request: Request) -> None:
        """A replayed request's adopted KV, past what the prefix cache gave it (request.computed): the pages
        where its tokens run on as the adopted ones do; the rest goes back to the pool."""
        tokens, pages = self.adopted.pop(request.rid)
        held = min(len(tokens), len(request.tokens) - 1)  # its last token is always fed
        start = 0 if self.cache is None else len(tokens) - len(tokens) % self.page_size  # where `pages` begin
        if request.computed != start or held <= start or tokens[start:held] != request.tokens[start:held]:
            self.allocator.free(pages)
            return
        keep = self.config.pages_for(held) - start // self.page_size
        request.pages += pages[:keep]
        self.allocator.free(pages[keep:])
        request.computed = held

    def release_adopted(self) -> None:
        """Adopted KV no replay has claimed (its request ended meanwhile, or the pool ran short) goes back to the pool."""
        for _, pages in self.adopted.values():
            self.allocator.free(pages)
        self.adopted.clear()

    def reopen(self) -> None:
        """A new engine has taken over the KV pool of one that died: each running request keeps its slot,
        its pages and the KV its answered steps wrote, and what was in flight is fed again: a request that was
        decoding decodes on (the engine takes its last token from the reopened slot), so that its redone
        steps run the kernels, and round as, its lost ones did."""
        self._chunk_ends.clear()
        for rids in self._imports.values():  # copies the dead engine may not have run: their requests compute afresh here
            self.imported += rids
        self._imports.clear()
        if self.cache is not None:
            self.cache.reopen()
        self._solo.clear()  # lost with the engine: their requests run alone again
        for request in list(self.running):
            if request.params.prompt_logprobs is not None and not request.output_ids:
                request.confirmed = 0  # the prompt's log-probabilities so far died with the engine: its prompt runs again
            if self.windows is not None and request.window_from > self.windows.first_seen(request.confirmed):
                self._preempt(request, self._freed)  # it gave back window pages its rerun would read: it is recomputed
                continue
            request.computed = request.confirmed
            request.decoding = bool(request.output_ids) and request.confirmed == len(request.tokens) - 1 and not self.speculative
        self._resync = True

    @staticmethod
    def _new_slot(request: Request) -> NewSlot:
        assert request.slot is not None  # admitted, or running
        return NewSlot(
            request.slot, request.rid, request.params, request.seed, request.prompt_ids, list(request.output_ids), request.computed
        )

    def _fully_planned(self, request: Request) -> bool:
        """Do the steps in flight already draw its last token by length?"""
        drawn = request.computed - len(request.prompt_ids) + 1
        assert request.params.max_tokens is not None  # add() fills it in
        return drawn >= request.params.max_tokens or request.computed + 1 >= self.max_position

    def _draft(self, request: Request, count: int) -> list[int]:
        """A speculative draft after the request's `count` next tokens, where they end what it knows and it is
        decoding: as many as fit its length, the context and the pool."""
        if not self.speculating or request.computed + count != len(request.tokens) or not request.output_ids:
            return []
        params, cfg = request.params, self.config
        assert params.max_tokens is not None  # add() fills it in
        room = min(
            cfg.speculative_num_draft_tokens,
            params.max_tokens - len(request.output_ids) - 1,  # the step also gives the token after the draft
            self.max_position - len(request.tokens) - 1,
            self.allocator.num_pages * self.page_size - len(request.tokens),
        )
        if room <= 0:
            return []
        if cfg.speculative_algorithm in MODEL_DRAFTS:  # the engine's draft model fills them in
            return [DRAFT_HERE] * room
        started = time.perf_counter()
        draft = ngram_draft(request.tokens, room, cfg.speculative_ngram_min_match_window_size, cfg.speculative_ngram_max_match_window_size)
        self.draft_seconds += time.perf_counter() - started
        return draft

    def _feed(self, request: Request, count: int, plan: StepPlan, drafts: Sequence[int] = ()) -> None:
        """`drafts`: verified after the chunk (Chunk.drafts); their KV counts only as far as the model keeps them,
        and the request is fed again once the step has answered."""
        assert request.slot is not None  # only running requests are fed
        if request.decoding:
            plan.decodes.append(request.slot)
        else:
            start = request.computed
            sample = start + count == len(request.tokens)
            plan.chunks.append(Chunk(request.slot, request.tokens[start : start + count] + list(drafts), sample, len(drafts)))
            self._chunk_ends.setdefault(plan.step, []).append((request, start + count))
            request.decoding = sample and not self.speculating
        request.computed += count

    def _admit(self, request: Request, plan: StepPlan) -> bool:
        """Admit only what can prefill its whole known sequence from free or evictable pages."""
        found = None
        if self.cache is not None and request.params.prompt_logprobs is None:  # those need every prompt position's logits
            found = self.cache.match(request.tokens[:-1], request.params.cache_salt)  # the last token must be computed
            self.cache.lock(found.node)
            # with windows: up to where the window before is still in the window pool
            usable = self.windows.usable(found.pages) if self.windows is not None else len(found.pages)
            request.prefix, request.pages, request.shared_pages = found.node, found.pages[:usable], usable
            request.computed = usable * self.page_size
            if self.windows is not None:
                request.window_from = self.windows.first_seen(request.computed)
                self.windows.hold(request.pages[request.window_from :])
        if request.rid in self.adopted:
            self._claim(request)
        needed = self.config.pages_for(len(request.tokens)) - len(request.pages)
        # the window pool: room for the prefill's window and chunks in flight (it gives back pages as it moves on), less
        # the window of its cached prefix, which it holds already
        window_pages = self.windows.prefill_pages - (len(request.pages) - request.window_from) if self.windows is not None else 0
        if not self._reserve(needed, min(needed, window_pages)):
            self._drop_pages(request)
            return False
        request.matched = request.confirmed = request.computed
        if request.computed and not request.output_ids:
            request.cached_tokens = request.computed
        self.reused_prefix_tokens += request.computed
        if found is not None:
            self.tier_hits["host"] += found.host_tokens
            self.tier_hits["disk"] += found.disk_tokens
            self.tier_hits["device"] += len(found.pages) * self.page_size - found.host_tokens - found.disk_tokens
        if (source := self.incoming.pop(request.rid, None)) is not None:  # its prompt's KV, from the prefill engine's pool
            self._import(request, source, plan)
        request.slot = self._free_slots.pop()
        request.admitted_step = self._step
        self.admitted.append(request)
        self._by_slot[request.slot] = request
        self.running.append(request)
        plan.new_slots.append(self._new_slot(request))
        if request.pages:
            plan.pages.append((request.slot, list(request.pages)))
        return True

    def _import(self, request: Request, source: list[int], plan: StepPlan) -> None:
        """Pages here for the KV the prefill engine wrote (its prompt's: every token but the first drawn), which the
        plan copies into them; the request feeds on from there."""
        held = len(request.tokens) - 1
        pages = self.allocator.alloc(self.config.pages_for(held))
        assert pages is not None  # _admit reserved them
        request.pages, request.computed = pages, held
        plan.imports.append((source[: len(pages)], pages))
        self._imports.setdefault(plan.step, []).append(request.rid)

    def hand_over(self, request: Request) -> Request:
        """A prefill engine's request that has drawn its first token leaves for a decode engine: its slot is freed, and
        what it holds here stays held, as it is, until `release`. Returns it, ready to be received elsewhere."""
        self.running.remove(request)
        assert request.slot is not None  # a running request holds a slot
        self._freed.append(request.slot)
        self._release_slot(request)
        self.handed[request.rid] = replace(request, output_ids=list(request.output_ids))
        request.pages, request.shared_pages, request.prefix, request.computed, request.confirmed = [], 0, None, 0, 0
        return request

    def release(self, rid: int) -> None:
        """The pages of a request handed over go back: its whole pages into the prefix cache, as at its end."""
        if (request := self.handed.pop(rid, None)) is not None:
            self._retire(request)

    def receive(self, request: Request, source: list[int]) -> None:
        """A decode engine's: a request another scheduler handed over, whose prompt's KV lies in `source` pages of the
        prefill engine's pool (the copy comes with its admission)."""
        self.incoming[request.rid] = source
        request.decoding, request.admitted_step = False, 0
        self._queue(request, first=False)

    def _reserve(self, count: int, window_count: int | None = None) -> bool:
        """Room for `count` more pages, and `window_count` (default: as many) more window pages."""
        if count > self.allocator.num_free and self.adopted:
            self.release_adopted()
        short = count - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        room = self.windows is None or self.windows.num_free >= (count if window_count is None else window_count)
        return self.allocator.num_free >= count and room

    def _grow(self, request: Request, count: int, plan: StepPlan) -> bool:
        """Pages for `count` more tokens, preempting the newest requests if short; ends one outgrowing the pool."""
        if self.config.pages_for(request.computed + count) > self.allocator.num_pages:
            request.finish_reason = "length"
            self._finish(request)
            plan.freed.extend(self._freed)
            self._freed = []
            self.ended.append(request)
            return False
        needed = self.config.pages_for(request.computed + count) - len(request.pages)
        while not self._reserve(needed):
            victim = self._victim(plan)
            self._preempt(victim, plan.freed)
            if victim is request:
                return False
        if needed:
            pages = self.allocator.alloc(needed)
            assert pages is not None and request.slot is not None  # _reserve made room; a request grows while it runs
            if self.windows is not None:
                paired = self.windows.assign(pages)
                assert paired  # so it did in the window pool
            request.pages += pages
            plan.pages.append((request.slot, pages))
        return True

    def _victim(self, plan: StepPlan) -> Request:
        """The request to preempt: the newest running (fcfs); under the priority policy the newest of
        the lowest priority among those this plan has not fed yet (the newest never has been)."""
        if self.config.schedule_policy == "fcfs":
            return self.running[-1]
        fed = {*plan.decodes, *(chunk.slot for chunk in plan.chunks)}
        return max((r for r in reversed(self.running) if r.slot not in fed), key=lambda r: r.params.priority)

    def _preempt(self, request: Request, freed: list[int]) -> None:
        """Recompute later: drop its KV and slot (into `freed`: the plan's, or the next's), keep its tokens, and queue
        it first (of its priority)."""
        self.preemptions += 1
        self.running.remove(request)
        assert request.slot is not None  # a running request holds a slot
        freed.append(request.slot)
        self._release_slot(request)
        self._drop_pages(request)
        self._queue(request, first=True)

    def _release_slot(self, request: Request) -> None:
        assert request.slot is not None
        del self._by_slot[request.slot]
        self._free_slots.append(request.slot)
        request.slot, request.decoding, request.plain_decodes = None, False, 0

    def _drop_pages(self, request: Request) -> None:
        self._let_go(request)
        self.allocator.free(request.pages[request.shared_pages :])
        if request.prefix is not None:
            assert self.cache is not None  # only the prefix cache gives a prefix
            self.cache.unlock(request.prefix)
        request.pages, request.shared_pages, request.prefix, request.computed, request.confirmed = [], 0, None, 0, 0
        request.window_from = 0

    def update(self, step: int, results: list[Sampled]) -> list[Request]:
        """Record `step`'s tokens (a slot's in order, several after a speculative chunk); returns the requests
        that got any, each once, with `fresh` set to how many."""
        if (solo := self._solo.pop(step, None)) is not None and solo.rid in self.quarantine:  # it ran alone, the engine lived
            self.quarantine[solo.rid] -= 1
            if not self.quarantine[solo.rid]:  # it has run alone past every step lost under it: back to the batch
                del self.quarantine[solo.rid]
        if self.cache is not None:
            self.cache.answered(step)
        self.imported += self._imports.pop(step, ())
        for request, end in self._chunk_ends.pop(step, ()):
            if request.slot is not None and request.admitted_step <= step:
                request.confirmed = max(request.confirmed, end)
        advanced: dict[int, Request] = {}
        for result in results:
            request = self._by_slot.get(result.slot)
            if request is None or request.admitted_step > step:
                continue  # the slot's request finished or was preempted after this step was planned
            if request.rid not in advanced:
                request.fresh, advanced[request.rid] = 0, request
            if result.error is not None:  # the draw is void: the request ends with the engine's error
                request.error, request.finish_reason = result.error, "abort"
                self._finish(request)
                continue
            request.output_ids.append(result.token)
            request.fresh += 1
            request.confirmed = len(request.tokens) - 1  # every token before the one just drawn has its KV
            if not request.decoding:  # drafting: a draft's rejected tokens' KV is void, the next chunk starts at the last token
                request.computed = request.confirmed
            if result.logprobs is not None:
                request.logprobs.append(result.logprobs)
            if request.prompt_logprobs is None and request.params.prompt_logprobs is not None:
                # a preempted request's recomputed prompt gives them again; a one-token prompt has no position to score
                request.prompt_logprobs = result.prompt_logprobs or []
            if reason := self._finish_reason(request, result.token):
                request.finish_reason = reason
                self._finish(request)
        return list(advanced.values())

    def _finish_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        assert params.max_tokens is not None  # add() fills it in
        if len(request.output_ids) >= params.max_tokens or len(request.tokens) >= self.max_position:
            return "length"
        return None

    def _finish(self, request: Request) -> None:
        self.running.remove(request)
        assert request.slot is not None  # a running request holds a slot
        self._freed.append(request.slot)
        self._release_slot(request)
        self._retire(request)

    def _retire(self, request: Request) -> None:
        """Its pages go: the whole ones its answered steps wrote into the prefix cache, the rest back to the pool."""
        if self.cache is not None:
            self._let_go(request)  # its window pages stay paired, idle, with the pages the tree takes
            whole = request.confirmed // self.page_size  # not what steps in flight will write: the engine may die first
            self.cache.insert(request.tokens[: whole * self.page_size], request.pages[:whole], request.params.cache_salt)
            request.pages, request.shared_pages = request.pages[whole:], 0  # the tree owns the rest
            if request.pin:
                self._pin(request.prompt_ids)
        self._drop_pages(request)

    def abort(self, rid: int) -> Request | None:
        for request in self.waiting:
            if request.rid == rid:
                self.waiting.remove(request)
                break
        else:
            request = next((r for r in self.running if r.rid == rid), None)
            if request is None:
                return None
            self.running.remove(request)
            assert request.slot is not None  # a running request holds a slot
            self._freed.append(request.slot)
            self._release_slot(request)
            self._drop_pages(request)
        request.finish_reason = "abort"
        return request

    def flush_cache(self) -> int:
        return self.cache.flush() if self.cache is not None else 0

    @property
    def pinned_pages(self) -> int:
        return sum(pages for _, pages in self.pins.values())

    def _pin(self, prompt_ids: list[int]) -> None:
        """Lock a warmed prompt's whole pages as a running request's prefix is locked, so that no
        eviction or flush takes them; once per prefix, and at most half the pool in all."""
        assert self.cache is not None  # warm-ups are pinned only in a prefix cache
        pages, node, *_ = self.cache.match(prompt_ids)
        key = tuple(prompt_ids[: len(pages) * self.page_size])
        if pages and key not in self.pins and self.pinned_pages + len(pages) <= self.allocator.num_pages // 2:
            self.cache.lock(node)
            self.pins[key] = (node, len(pages))

    def unpin_prefixes(self) -> int:
        """Release every warmed prefix to ordinary eviction; returns the pages they held."""
        pages = self.pinned_pages
        for node, _ in self.pins.values():
            assert self.cache is not None  # pins are made only in a prefix cache
            self.cache.unlock(node)
        self.pins = {}
        return pages
