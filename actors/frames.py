"""Typed frame payloads: one frozen dataclass per Kind, on transport.codec's header + int32 arrays.

`to_wire()` gives (header, arrays); `decode(frame)` rebuilds the payload as Python objects, copied
out of the ring (its memory goes back to the writer at the next receive). Token ids travel as int32
arrays. Frames sent once per request carry a dict header; TOKENS and DELTAS, one item per running
request each step, carry positional lists, with no per-item keys, and their items are plain slotted
dataclasses (a frozen one is several times slower to build).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from actors.kinds import Kind
from runtime.sampling_params import SamplingParams
from runtime.step import HeldKV, PromptLogprob, Sampled, StepPlan, plan_from_wire, plan_to_wire, results_from_wire, results_to_wire
from transport import codec
from transport.ring import Frame

Wire = tuple[Any, list]  # a codec header and its int32 arrays


class Payload:
    """A frame's payload. The default wire form is the dataclass's fields as a JSON object (orjson
    writes dataclasses), which suits payloads without token ids."""

    __slots__ = ()
    KIND: ClassVar[Kind]

    def to_wire(self) -> Wire:
        return self, []

    @classmethod
    def from_wire(cls, meta: Any, arrays: list) -> Any:
        return cls(**meta)


@dataclass(frozen=True, slots=True)
class Detok:
    """What the detokenizer needs of a request: set by the api worker, announced with its first tokens."""

    stop: list[str]
    skip_special_tokens: bool
    top_logprobs: int
    prompt: bool = False  # the prompt's text and ids come back too (echo, prompt_logprobs)


@dataclass(frozen=True)
class Submit(Payload):
    """A request as its client sent it; a replay also carries the tokens its client has seen."""

    KIND = Kind.SUBMIT
    params: SamplingParams  # max_tokens None: the rest of the context (the scheduler fills it in)
    detok: Detok
    trace: str
    messages: list[dict] | None
    prompt: str | None
    ids: list[int] | None = None  # token ids the client sent instead of text
    generated: list[int] = field(default_factory=list)
    guide: tuple[str, str] | None = None  # what the output is held to (api.guides): the engine builds its grammar
    template: dict[str, Any] | None = None  # the chat template's options (api.protocol.Completion.template)
    pin: bool = False  # a prefix warm-up: its prompt's pages stay in the prefix cache until unpinned

    def to_wire(self) -> Wire:
        meta = {
            "params": self.params,
            "detok": self.detok,
            "trace": self.trace,
            "messages": self.messages,
            "prompt": self.prompt,
            "guide": self.guide,
            "template": self.template,
            "pin": self.pin,
        }
        return meta, [self.ids or [], self.generated]

    @classmethod
    def from_wire(cls, meta: dict, arrays: list) -> Submit:
        ids, generated = (a.tolist() for a in arrays)
        return cls(
            **{**meta, "params": SamplingParams(**meta["params"]), "detok": Detok(**meta["detok"])}, ids=ids or None, generated=generated
        )


@dataclass(frozen=True)
class Tokenized(Payload):
    """REQUEST: a request the tokenizer accepted; its prompt's text stays behind."""

    KIND = Kind.REQUEST
    params: SamplingParams
    detok: Detok
    trace: str
    prompt_ids: list[int]
    generated: list[int]  # a replay's tokens so far
    pin: bool = False  # Submit.pin

    def to_wire(self) -> Wire:
        return {"params": self.params, "detok": self.detok, "trace": self.trace, "pin": self.pin}, [self.prompt_ids, self.generated]

    @classmethod
    def from_wire(cls, meta: dict, arrays: list) -> Tokenized:
        prompt_ids, generated = (a.tolist() for a in arrays)
        return cls(SamplingParams(**meta["params"]), Detok(**meta["detok"]), meta["trace"], prompt_ids, generated, meta["pin"])


@dataclass(frozen=True, slots=True)
class Refusal(Payload):
    """ERROR: a request refused, answered to its client as an HTTP error."""

    KIND = Kind.ERROR
    message: str
    status: int = 400
    param: str | None = None
    kind: str = "invalid_request_error"  # OpenAI's error type


@dataclass(frozen=True)
class Step(Payload):
    KIND = Kind.STEP
    plan: StepPlan

    def to_wire(self) -> Wire:
        return plan_to_wire(self.plan)

    @classmethod
    def from_wire(cls, meta: dict, arrays: list) -> Step:
        return cls(plan_from_wire(meta, arrays))


@dataclass(frozen=True)
class StepResults(Payload):
    """SAMPLED: the token each slot that finished its input sampled in a step."""

    KIND = Kind.SAMPLED
    step: int
    results: list[Sampled]

    def to_wire(self) -> Wire:
        return results_to_wire(self.step, self.results)

    @classmethod
    def from_wire(cls, meta: dict, arrays: list) -> StepResults:
        return cls(meta["step"], results_from_wire(meta, arrays))


@dataclass(slots=True)
class Announce:
    """What the detokenizer must know of a request, sent with its first tokens (again after a replay)."""

    detok: Detok
    generated: list[int]  # tokens a replay's client has seen already: the detokenizer's state is rebuilt from them
    prompt_tokens: int
    cached_tokens: int
    # after a detokenizer restart: `generated` is every token so far, and the text of all of them goes to the
    # api worker, which keeps what its client has not had yet
    resync: bool = False
    prompt_ids: list[int] = field(default_factory=list)  # when detok.prompt: the prompt, whose text goes back


@dataclass(slots=True)
class TokenItem:
    """A request's part of a step."""

    rid: int
    finish: str | None
    token_ids: list[int]  # the step's new tokens (several after a speculative step), or none (aborted, or ended while planned)
    logprobs: list[list[tuple[int, float]]] | None = None  # each new token's top log-probabilities
    announce: Announce | None = None
    prompt_logprobs: list[PromptLogprob] | None = None  # with the first tokens, when the request asked for them


@dataclass(frozen=True)
class Tokens(Payload):
    """One step's new tokens and finishes. Wire: [rid, finish, token count, logprobs, announce,
    prompt logprobs] an item; arrays: the new tokens, then the announced histories and prompts."""

    KIND = Kind.TOKENS
    items: list[TokenItem]

    def to_wire(self) -> Wire:
        meta, tokens, history = [], [], []
        for i in self.items:
            tokens += i.token_ids
            announce = None
            if (a := i.announce) is not None:
                history += a.generated + a.prompt_ids
                announce = [a.detok, len(a.generated), a.prompt_tokens, a.cached_tokens, a.resync, len(a.prompt_ids)]
            meta.append([i.rid, i.finish, len(i.token_ids), i.logprobs, announce, i.prompt_logprobs])
        return meta, [tokens, history]

    @classmethod
    def from_wire(cls, meta: list, arrays: list) -> Tokens:
        tokens, history = (a.tolist() for a in arrays)
        items, at, seen = [], 0, 0
        for rid, finish, n, logprobs, announce, prompt_logprobs in meta:
            if announce is not None:
                detok, count, prompt_tokens, cached_tokens, resync, prompt_count = announce
                generated, prompt_ids = history[seen : seen + count], history[seen + count : seen + count + prompt_count]
                announce = Announce(Detok(**detok), generated, prompt_tokens, cached_tokens, resync, prompt_ids)
                seen += count + prompt_count
            if logprobs is not None:
                logprobs = [[(t, lp) for t, lp in top] for top in logprobs]
            items.append(TokenItem(rid, finish, tokens[at : at + n], logprobs, announce, prompt_logprobs))
            at += n
        return cls(items)


@dataclass(slots=True)
class Delta:
    """A request's newly released text, or its refusal."""

    rid: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish: str | None = None
    abort: bool = False  # a stop string ended it in the detokenizer: the scheduler must let go too
    logprobs: list[dict] | None = None  # per token: token_id, token, logprob, top
    usage: dict[str, int] | None = None  # with the finish: prompt_tokens, completion_tokens, cached_tokens
    error: Refusal | None = None
    resync: bool = False  # the whole completion so far (Announce.resync), not only what is new
    prompt: dict | None = None  # with the first tokens when Detok.prompt: the prompt's text, and its logprobs if asked
    matched_stop: str | int | None = None  # with a "stop" finish: the stop string, or the token (EOS or a stop id), that ended it

    def as_dict(self) -> dict:
        """The form api.app reads from a request's inbox."""
        if self.error is not None:
            error = self.error
            return {"rid": self.rid, "error": {"message": error.message, "status": error.status, "param": error.param, "kind": error.kind}}
        out = {"rid": self.rid, "text": self.text, "token_ids": self.token_ids, "finish": self.finish, "matched_stop": self.matched_stop}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.usage is not None:
            out["usage"] = self.usage
        if self.prompt is not None:
            out["prompt"] = self.prompt
        return out


@dataclass(frozen=True)
class Deltas(Payload):
    """One step's deltas for one api worker. Wire: [rid, text, token count, finish, abort, logprobs,
    usage, error, resync, prompt, matched stop] a delta; array: their token ids."""

    KIND = Kind.DELTAS
    deltas: list[Delta]

    def to_wire(self) -> Wire:
        meta = [
            [d.rid, d.text, len(d.token_ids), d.finish, d.abort, d.logprobs, d.usage, d.error, d.resync, d.prompt, d.matched_stop]
            for d in self.deltas
        ]
        return meta, [[t for d in self.deltas for t in d.token_ids]]

    @classmethod
    def from_wire(cls, meta: list, arrays: list) -> Deltas:
        tokens, deltas, at = arrays[0].tolist(), [], 0
        for rid, text, n, finish, abort, logprobs, usage, error, resync, prompt, matched_stop in meta:
            refusal = error and Refusal(**error)
            deltas.append(Delta(rid, text, tokens[at : at + n], finish, abort, logprobs, usage, refusal, resync, prompt, matched_stop))
            at += n
        return cls(deltas)


@dataclass(frozen=True)
class Adopt(Payload):
    """A new epoch's scheduler asks its engine (empty), and rank 0 answers with what its pool holds of the
    requests of the epoch before (runtime.engine.Engine.reset): a request replayed into this epoch takes
    its KV back instead of recomputing it. With KV tiers, the answer also names the engine's disk folder, and
    says that the host tier's index is complete (the scheduler reads it from the keeper's segment). Wire:
    {"held": [rid, tokens, pages, salt] an entry, "disk"}; arrays: the tokens, the pages."""

    KIND = Kind.ADOPT
    held: list[HeldKV] = field(default_factory=list)
    disk: str | None = None

    def to_wire(self) -> Wire:
        meta = {"held": [[rid, len(tokens), len(pages), salt] for rid, tokens, pages, salt in self.held], "disk": self.disk}
        return meta, [[t for _, tokens, _, _ in self.held for t in tokens], [p for _, _, pages, _ in self.held for p in pages]]

    @classmethod
    def from_wire(cls, meta: dict, arrays: list) -> Adopt:
        tokens, pages = (a.tolist() for a in arrays)
        held, at, page_at = [], 0, 0
        for rid, count, page_count, salt in meta["held"]:
            held.append((rid, tokens[at : at + count], pages[page_at : page_at + page_count], salt))
            at, page_at = at + count, page_at + page_count
        return cls(held, meta["disk"])


@dataclass(frozen=True)
class Compile(Payload):
    """The scheduler asks its engines to compile a waiting request's grammar (`guide` set, the frame's rid the
    request's), or withdraws the question (`guide` None: the request was aborted); rank 0 answers once it is
    compiled (`guide` and `error` None), or with why it is not (`error`: the request is refused with it). The
    request joins the batch only then (runtime.structured.masks)."""

    KIND = Kind.COMPILE
    guide: tuple[str, str] | None = None
    error: str | None = None

    @classmethod
    def from_wire(cls, meta: dict, arrays: list) -> Compile:
        guide = meta["guide"]  # a list on the wire
        return cls(None if guide is None else (guide[0], guide[1]), meta["error"])


@dataclass(frozen=True)
class Abort(Payload):
    """Drop a request: its client left, or a stop string ended it in the detokenizer."""

    KIND = Kind.ABORT


@dataclass(frozen=True)
class Ping(Payload):
    """A round trip through every actor, which keeps /health honest."""

    KIND = Kind.PING


@dataclass(frozen=True)
class FlushCache(Payload):
    """Evict the prefix cache's unpinned pages; or, with `unpin`, release the warmed prefixes' pins."""

    KIND = Kind.FLUSH_CACHE
    pages: int | None = None  # on the way back: the pages evicted, or unpinned
    unpin: bool = False


@dataclass(frozen=True)
class LoraAdapter(Payload):
    """Load a LoRA adapter (`path` given) or unload it (`path` None) on every engine of every scheduler; rank 0
    answers with `error` None when done (`replaced`: a loaded adapter of that name took the new weights)."""

    KIND = Kind.LORA_ADAPTER
    name: str
    path: str | None = None
    error: str | None = None
    replaced: bool = False


PAYLOADS: dict[int, type[Payload]] = {
    p.KIND: p for p in (Submit, Abort, Tokenized, Refusal, Step, StepResults, Tokens, Deltas, Ping, FlushCache, Adopt, Compile, LoraAdapter)
}


def decode(frame: Frame) -> Payload:
    """The frame's payload as Python objects, safe to keep past the next receive."""
    return PAYLOADS[frame.kind].from_wire(*codec.unpack(frame))
