"""A request's answer as a trace, and where two answers to one request first differ.

A body is sent whole (not streamed) with vLLM's `return_token_ids`; each choice of the answer becomes its index,
token ids, log-probabilities and finish reason; `compare` finds each choice's first divergence from another
answer's. Golden traces (benchmarks.golden) compare a replay with a record through it, and shadow mode
(actors.shadow) a shadow server's answer with what the live server sent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson


@dataclass(frozen=True)
class Divergence:
    """Where a replayed choice first departs from its record. `kind`: "tokens" (position is the first token that
    differs, or where one stream ends; logprob_delta the replayed minus the recorded log-probability there, when
    both have one), "logprobs" (the tokens agree; position is the first log-probability past the tolerance,
    logprob_delta the largest absolute difference), "finish", "choices" (a different number of them) or "error"
    (the replay failed: `detail` says how)."""

    request: int
    choice: int
    kind: str
    position: int | None = None
    recorded: int | None = None  # the token id at `position` in the record (None: past its end)
    replayed: int | None = None
    logprob_delta: float | None = None
    detail: str = ""

    def describe(self) -> str:
        """One line for a person."""
        where = f"request {self.request}" + (f" choice {self.choice}" if self.choice else "")
        if self.kind == "tokens":
            delta = "" if self.logprob_delta is None else f", logprob delta {self.logprob_delta:+.6g}"
            return f"{where}: token {self.position} differs: recorded {self.recorded}, replayed {self.replayed}{delta}"
        if self.kind == "logprobs":
            return f"{where}: tokens agree; logprobs differ from token {self.position}, by up to {self.logprob_delta:.6g}"
        return f"{where}: {self.detail}"


def endpoint(body: dict[str, Any]) -> str:
    """The route a body is for: a prompt is a completion's, messages a chat's."""
    if "prompt" in body:
        return "/v1/completions"
    if "messages" in body:
        return "/v1/chat/completions"
    raise ValueError("a request body needs 'prompt' (/v1/completions) or 'messages' (/v1/chat/completions)")


def whole(body: dict[str, Any]) -> dict[str, Any]:
    """The body sent whole (not streamed), with the choices' token ids asked for."""
    return {key: value for key, value in body.items() if key != "stream_options"} | {"stream": False, "return_token_ids": True}


async def complete(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Each choice of a whole body's answer: its index, token ids, their log-probabilities (none unless the body
    asked for them) and finish reason."""
    async with http.post(url + endpoint(body), json=body) as reply:
        answer = await reply.json(loads=orjson.loads, content_type=None)
    if reply.status != 200:
        raise RuntimeError(f"the server answered {reply.status}: {answer.get('error', answer)}")
    try:
        return sorted((_traced_choice(choice) for choice in answer["choices"]), key=lambda c: c["index"])
    except (KeyError, TypeError) as exc:
        raise RuntimeError(f"the answer has no token ids or logprobs where a trace needs them ({exc!r})") from None


def _traced_choice(choice: dict[str, Any]) -> dict[str, Any]:
    ids, block = choice["token_ids"], choice["logprobs"]
    if block is None:
        logprobs = []
    else:
        logprobs = [entry["logprob"] for entry in block["content"]] if "content" in block else block["token_logprobs"]
    # an echo's logprobs begin with the prompt's tokens: the emitted ones are the last
    return {
        "index": choice["index"],
        "token_ids": ids,
        "logprobs": logprobs[len(logprobs) - len(ids) :],
        "finish_reason": choice["finish_reason"],
    }


def compare(index: int, recorded: list[dict[str, Any]], replayed: list[dict[str, Any]], tolerance: float) -> list[Divergence]:
    """Each choice's first divergence from its record."""
    if len(recorded) != len(replayed):
        return [Divergence(index, 0, "choices", detail=f"recorded {len(recorded)} choices, replayed {len(replayed)}")]
    found = []
    for choice, (was, now) in enumerate(zip(recorded, replayed)):
        if (divergence := _first_difference(index, choice, was, now, tolerance)) is not None:
            found.append(divergence)
    return found


def _first_difference(index: int, choice: int, was: dict[str, Any], now: dict[str, Any], tolerance: float) -> Divergence | None:
    ids, again = was["token_ids"], now["token_ids"]
    logprobs, relogged = was["logprobs"], now["logprobs"]
    differs = [i for i, (a, b) in enumerate(zip(ids, again)) if a != b]
    if differs or len(ids) != len(again):
        at = differs[0] if differs else min(len(ids), len(again))
        delta = relogged[at] - logprobs[at] if at < min(len(logprobs), len(relogged)) else None
        return Divergence(index, choice, "tokens", at, _at(ids, at), _at(again, at), delta)
    deltas = [abs(a - b) for a, b in zip(logprobs, relogged)]
    if past := [i for i, delta in enumerate(deltas) if delta > tolerance]:
        return Divergence(index, choice, "logprobs", past[0], ids[past[0]], again[past[0]], max(deltas))
    if was["finish_reason"] != now["finish_reason"]:
        return Divergence(index, choice, "finish", detail=f"finish reason recorded {was['finish_reason']}, replayed {now['finish_reason']}")
    return None


def _at(ids: list[int], position: int) -> int | None:
    return ids[position] if position < len(ids) else None
