"""The detokenizer actor: incremental, UTF-8-safe text; stop strings across chunks; logprob text.

Text comes from tokenizers' incremental decoder (`DecodeStream`, far cheaper than re-decoding a
window in Python), which holds text back inside a multi-byte character. Everything kept per request
can be rebuilt from token ids, so a replay restores it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import structlog
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from actors.base import Actor
from actors.frames import Announce, Delta, Deltas, FlushCache, LoraAdapter, Ping, Refusal, TokenItem, Tokens, decode
from actors.kinds import worker_of
from runtime.models.source import load_tokenizer
from runtime.step import PromptLogprob
from runtime.text.stop_matcher import StopMatcher

log = structlog.get_logger()


@dataclass
class Stream:
    stop: list[str]
    skip_special_tokens: bool
    top_logprobs: int
    decoder: DecodeStream
    held: str = ""  # text that may be the start of a stop string, already fed to `matcher`
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    matcher: StopMatcher | None = field(init=False)  # None without stop strings: nothing to pay

    def __post_init__(self) -> None:
        self.matcher = StopMatcher(self.stop) if self.stop else None


def _frames(deltas: list[Delta]) -> list[list[Delta]]:
    """A step's deltas for one worker, those that bring a prompt (up to a few MB of log-probabilities
    with their text) each in a frame of its own, so that no frame outgrows the ring."""
    plain = [d for d in deltas if d.prompt is None]
    return ([plain] if plain else []) + [[d] for d in deltas if d.prompt is not None]


class DetokenizerActor(Actor):
    async def setup(self) -> None:
        self.tokenizer = load_tokenizer(self.options["serve"].model_dir, required=True)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(self.tokenizer).__name__} has no `tokenizers` backend, which incremental decoding needs")
        self.backend: Tokenizer = backend
        self.on_epoch(self.epoch)

    def on_epoch(self, epoch: int) -> None:
        self.streams: dict[int, Stream] = {}

    async def run(self) -> None:
        while True:
            _, frame = await self.next_frame()
            match payload := decode(frame):
                case Tokens(items=items):
                    by_worker: dict[int, list[Delta]] = defaultdict(list)
                    for item in items:
                        if (delta := self._apply(item)) is not None:
                            by_worker[worker_of(item.rid)].append(delta)
                    for worker, deltas in by_worker.items():
                        for part in _frames(deltas):
                            await self.send(f"api{worker}", Deltas(part), epoch=frame.epoch)
                case Ping() | FlushCache() | LoraAdapter():
                    await self.send(f"api{worker_of(frame.rid)}", payload, frame.rid, epoch=frame.epoch)
                case Refusal():
                    self.streams.pop(frame.rid, None)
                    await self.send(f"api{worker_of(frame.rid)}", Deltas([Delta(frame.rid, error=payload)]), epoch=frame.epoch)

    def _apply(self, item: TokenItem) -> Delta | None:
        rid, new = item.rid, item.token_ids
        if (first := item.announce) is not None:
            skip = first.detok.skip_special_tokens
            self.streams[rid] = Stream(
                first.detok.stop,
                skip,
                first.detok.top_logprobs,
                DecodeStream(skip_special_tokens=skip),
                prompt_tokens=first.prompt_tokens,
                cached_tokens=first.cached_tokens,
            )
            if first.resync:  # every token so far, text and all: the api worker keeps what its client lacks
                new = first.generated + new
            else:
                for token in first.generated:  # a replay: rebuild the state its client has already seen
                    self._advance(self.streams[rid], [token], None)
        stream = self.streams.get(rid)
        if stream is None:  # finished here already (a stop string), or aborted
            return None
        text, finish, matched_stop, kept = self._advance(stream, new, item.finish)
        own = item.token_ids[: max(kept - (len(new) - len(item.token_ids)), 0)]  # `new` ends with the item's own tokens
        new = new[:kept]
        logprobs = None if item.logprobs is None else self._logprob_entries(own, item.logprobs, stream.top_logprobs)
        usage = None
        if finish is not None:
            del self.streams[rid]
        if finish is not None or first is not None:  # the first tokens bring the prompt's counts, for running usage
            usage = {
                "prompt_tokens": stream.prompt_tokens,
                "completion_tokens": stream.completion_tokens,
                "cached_tokens": stream.cached_tokens,
            }
        abort = finish is not None and item.finish is None
        prompt = self._prompt(first, item.prompt_logprobs) if first is not None and first.detok.prompt else None
        resync = first is not None and first.resync
        return Delta(
            rid, text, new, finish, abort=abort, logprobs=logprobs, usage=usage, resync=resync, prompt=prompt, matched_stop=matched_stop
        )

    def _advance(self, stream: Stream, new: list[int], finish: str | None) -> tuple[str, str | None, str | int | None, int]:
        """Take in new ids: the text they release, the finish (a stop string may end it here), what matched
        for a "stop" finish (the stop string, or the token that ended it: EOS or a stop id), and how many of
        the ids count: a stop string ends the output at the token that completes it, as it would have ended
        a step that gave one token (a speculative step gives several)."""
        matched: str | int | None = new[-1] if finish == "stop" and new else None
        shown = new[:-1] if matched is not None else new  # the stop token leaves no text, as in vLLM
        pieces = [self._text_of(stream, token) for token in shown]
        released, kept = "".join(pieces), len(new)
        if stream.matcher is not None:
            text = stream.held + released  # the held text was fed already: feed only what is new
            if (start := stream.matcher.feed(released)) is not None:
                cut = len(stream.held) + start
                # the first stop string to complete: of those that begin at the cut, the shortest
                matched = min((stop for stop in stream.stop if text.startswith(stop, cut)), key=len)
                text, finish = text[:cut], "stop"
                stream.held = ""
                kept = _tokens_through(pieces, start + len(matched))
            elif finish is None:
                hold = stream.matcher.held
                text, stream.held = text[: len(text) - hold], text[len(text) - hold :]
            released = text
        stream.completion_tokens += kept
        return released, finish, matched, kept

    def _text_of(self, stream: Stream, token: int) -> str:
        """The text `token` releases. DecodeStream raises when the window's text stops extending what
        it showed before (invalid UTF-8 runs can do that), and a replay would raise again: start a
        fresh window at this token instead, whose empty prefix every text extends."""
        try:
            return stream.decoder.step(self.backend, token) or ""
        except Exception as exc:  # tokenizers raises a plain Exception
            log.warning("decode_stream_reset", token=token, error=str(exc)[:200])
            stream.decoder = DecodeStream(skip_special_tokens=stream.skip_special_tokens)
            return stream.decoder.step(self.backend, token) or ""

    def _prompt(self, first: Announce, logprobs: list[PromptLogprob] | None) -> dict:
        """The prompt's text (echo) and, if asked, an entry per prompt token: its log-probability given
        those before it (none for the first), rank, and the best alternatives, with their text."""
        skip = first.detok.skip_special_tokens
        out: dict = {"text": self.tokenizer.decode(first.prompt_ids, skip_special_tokens=skip), "logprobs": None}
        if logprobs is not None:
            ids = first.prompt_ids
            unique = list({*ids, *(i for _, _, top in logprobs for i, _ in top)})
            text = dict(zip(unique, self.tokenizer.batch_decode([[t] for t in unique])))  # one call: prompts run to thousands
            out["logprobs"] = [{"token_id": ids[0], "token": text[ids[0]], "logprob": None, "rank": None, "top": []}] + [
                {"token_id": t, "token": text[t], "logprob": lp, "rank": rank, "top": [[i, text[i], v] for i, v in top]}
                for t, (lp, rank, top) in zip(ids[1:], logprobs)
            ]
        return out

    def _logprob_entries(self, tokens: list[int], tops: list[list[tuple[int, float]]], keep: int) -> list[dict]:
        """Each sampled token's log-probability (from its own top list), and the `keep` best alternatives with their text."""
        text = lambda t: self.tokenizer.decode([t])  # noqa: E731
        entries = []
        for t, top in zip(tokens, tops):
            ranked = sorted(((int(i), lp) for i, lp in top), key=lambda pair: -pair[1])
            best = [[i, text(i), lp] for i, lp in ranked[:keep]]
            entries.append({"token_id": t, "token": text(t), "logprob": dict(ranked)[t], "top": best})
        return entries


def _tokens_through(pieces: list[str], end: int) -> int:
    """How many tokens, of those whose texts are `pieces`, it takes to release `end` characters."""
    released = 0
    for count, piece in enumerate(pieces, 1):
        released += len(piece)
        if released >= end:
            return count
    return len(pieces)
