"""The step protocol between scheduler and engine: the engine keeps per-slot state, and only deltas
travel (new slots, pages, chunks, decodes, freed slots; back, one sampled token per finished input, or
per kept draft token and one more after a speculative chunk)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.sampling_params import SamplingParams

# the histories one plan carries for the slots it opens: a quarter of the scheduler->engine ring
MAX_PLAN_HISTORY_TOKENS = 1 << 20


@dataclass(frozen=True)
class NewSlot:
    slot: int
    rid: int  # the request's: what the engine names the slot's KV by when a new scheduler adopts it
    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]  # tokens generated before a preemption
    cached: int  # leading tokens whose KV the slot's first pages already hold (prefix cache)


DRAFT_HERE = -1  # a draft token the engine's draft model or head is to fill in (STANDALONE, EAGLE, EAGLE3)


@dataclass(frozen=True)
class Chunk:
    slot: int
    token_ids: list[int]  # fed at the slot's current length onwards
    sample: bool  # the chunk ends the sequence's known tokens: sample the next one
    drafts: int = 0  # its last tokens are a speculative draft (or DRAFT_HERE): sample after each, keep it as far as it matches
    every_row: bool = False  # each row draws the token after it (the engine's own: a draft model's catch-up over a verify)


@dataclass(frozen=True)
class KVMove:
    """A copy of whole KV pages between the tiers (runtime.scheduler.radix_cache), run before the step's forward,
    in plan order. `keys`: each page's chain key (runtime.scheduler.tiers.chain_keys), the name of its disk file;
    a store also gives what the host tier's index records of each page: the key before the first page (`parent`),
    the first page's place in the chain (`position`) and the pages' tokens."""

    kind: str  # device pages to host (store), host to device (load), host to disk files (save), files to host (read)
    device: list[int] = field(default_factory=list)  # store, load
    host: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # store, save, read
    parent: bytes = b""  # store
    position: int = 0  # store
    tokens: list[int] = field(default_factory=list)  # store


@dataclass
class StepPlan:
    step: int = 0
    freed: list[int] = field(default_factory=list)  # applied first: a freed slot may be reused below
    new_slots: list[NewSlot] = field(default_factory=list)
    pages: list[tuple[int, list[int]]] = field(default_factory=list)  # appended to the slot's page table
    chunks: list[Chunk] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)  # slots fed their own last sampled token
    # the first plan for an engine: one that starts (or took over a dead one's KV pool) runs plans from here on
    resync: bool = False
    engine_start: int = 0  # with `resync`: which start of the engine it is for (ignored by an earlier start's successor)
    moves: list[KVMove] = field(default_factory=list)  # run first, after `freed`, `new_slots` and `pages` are applied
    # (full page, window page): where a sliding-window layer keeps a full page's tokens (runtime.scheduler.window_pages)
    window_pages: list[tuple[int, int]] = field(default_factory=list)
    # (pages of the prefill engine's pool, pages of this one's): the KV of requests handed over to this decode engine
    # (runtime.scheduler.disaggregated), copied after `pages` are applied, before the forward
    imports: list[tuple[list[int], list[int]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.chunks or self.decodes)


# what the host tier's index says one host page holds (runtime.engine.kv_tiers): the page, its chain key, the key
# before it, its place in the chain and its tokens; a new scheduler rebuilds the host tier's tree from these
HostEntry = tuple[int, bytes, bytes, int, list[int]]


# a request's KV that an engine holds across a new epoch: its rid, the tokens whose KV the pool has, their pages,
# and its cache salt (the prefix-cache tree they go back into)
HeldKV = tuple[int, list[int], list[int], str | None]
# a prompt token's log-probability given the tokens before it, its rank, and the top (id, log-probability) pairs there
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


@dataclass(frozen=True)
class Sampled:
    slot: int
    token: int
    logprobs: dict[int, float] | None
    prompt_logprobs: list[PromptLogprob] | None = None  # with a slot's first token: positions 1.. of its prompt
    error: str | None = None  # the slot cannot go on (its grammar allows no token): the draw is void, the request fails


def plan_to_wire(plan: StepPlan) -> tuple[dict, list[list[int]]]:
    """Control fields as JSON; token ids and pages as int32 arrays."""
    meta = {
        "step": plan.step,
        "freed": plan.freed,
        "decodes": plan.decodes,
        "new": [[n.slot, n.rid, n.params.to_dict(), n.seed, len(n.prompt_ids), len(n.output_ids), n.cached] for n in plan.new_slots],
        "pages": [[slot, len(pages)] for slot, pages in plan.pages],
        "chunks": [[c.slot, len(c.token_ids), c.sample, c.drafts] for c in plan.chunks],
        "resync": plan.resync,
        "engine_start": plan.engine_start,
        "moves": [
            [m.kind, len(m.device), len(m.host), [k.hex() for k in m.keys], m.parent.hex(), m.position, len(m.tokens)] for m in plan.moves
        ],
        "imports": [len(source) for source, _ in plan.imports],
    }
    history = [t for n in plan.new_slots for t in (*n.prompt_ids, *n.output_ids)]
    pages = [p for _, ps in plan.pages for p in ps]
    tokens = [t for c in plan.chunks for t in c.token_ids]
    moved = [p for m in plan.moves for p in (*m.device, *m.host, *m.tokens)]
    imported = [p for source, target in plan.imports for p in (*source, *target)]
    return meta, [history, pages, tokens, moved, [p for pair in plan.window_pages for p in pair], imported]


def plan_from_wire(meta: dict, arrays: list) -> StepPlan:
    history, pages, tokens, moved, window, imported = (a.tolist() for a in arrays)
    plan = StepPlan(step=meta["step"], freed=meta["freed"], decodes=meta["decodes"])
    plan.resync, plan.engine_start = meta["resync"], meta["engine_start"]
    plan.window_pages = list(zip(window[::2], window[1::2]))
    at = 0
    for slot, rid, params, seed, prompt_len, output_len, cached in meta["new"]:
        prompt, output = history[at : at + prompt_len], history[at + prompt_len : at + prompt_len + output_len]
        plan.new_slots.append(NewSlot(slot, rid, SamplingParams(**params), seed, prompt, output, cached))
        at += prompt_len + output_len
    at = 0
    for slot, count in meta["pages"]:
        plan.pages.append((slot, pages[at : at + count]))
        at += count
    at = 0
    for slot, count, sample, drafts in meta["chunks"]:
        plan.chunks.append(Chunk(slot, tokens[at : at + count], sample, drafts))
        at += count
    at = 0
    for kind, devices, hosts, keys, parent, position, tokens_moved in meta["moves"]:
        device, host = moved[at : at + devices], moved[at + devices : at + devices + hosts]
        moved_tokens = moved[at + devices + hosts : at + devices + hosts + tokens_moved]
        plan.moves.append(KVMove(kind, device, host, [bytes.fromhex(k) for k in keys], bytes.fromhex(parent), position, moved_tokens))
        at += devices + hosts + tokens_moved
    at = 0
    for count in meta["imports"]:
        plan.imports.append((imported[at : at + count], imported[at + count : at + 2 * count]))
        at += 2 * count
    return plan


def results_to_wire(step: int, results: list[Sampled]) -> tuple[dict, list[list[int]]]:
    """Extras by the result's index: a slot has several results after a speculative chunk."""
    logprobs = [[i, list(r.logprobs.items())] for i, r in enumerate(results) if r.logprobs is not None]
    prompt_logprobs = [[i, r.prompt_logprobs] for i, r in enumerate(results) if r.prompt_logprobs is not None]
    errors = [[i, r.error] for i, r in enumerate(results) if r.error is not None]
    meta = {"step": step, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs, "errors": errors}
    return meta, [[r.slot for r in results], [r.token for r in results]]


def results_from_wire(meta: dict, arrays: list) -> list[Sampled]:
    logprobs = {i: {int(t): lp for t, lp in pairs} for i, pairs in meta["logprobs"]}
    prompts = dict(meta["prompt_logprobs"])  # each position as it came off the wire: [log-probability, rank, [[id, value]...]]
    errors = dict(meta["errors"])
    slots, tokens = arrays[0].tolist(), arrays[1].tolist()
    return [Sampled(slot, token, logprobs.get(i), prompts.get(i), errors.get(i)) for i, (slot, token) in enumerate(zip(slots, tokens))]
