"""The aiohttp application: OpenAI-compatible routes over a Gateway to the pipeline."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import importlib.metadata
import ipaddress
import itertools
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, cast

import orjson
import structlog
from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestPayloadError

from api.chat_output import HARMONY, ChatOutput
from api.errors import ApiError
from api.harmony import HarmonyParser
from api.protocol import (
    Completion,
    Limits,
    choice,
    envelope,
    logprobs_block,
    model_not_found,
    parse,
    parse_prefixes,
    prompt_logprobs_block,
    usage,
)
from runtime.obs.metrics import exposition, metrics

if TYPE_CHECKING:  # prometheus_client is imported by runtime.obs.metrics, once its storage is set
    from prometheus_client import Counter, Histogram

log = structlog.get_logger()
try:
    VERSION = importlib.metadata.version("ringllm")
except importlib.metadata.PackageNotFoundError:  # a checkout on the path, not installed
    VERSION = "unknown"
MAX_BODY_BYTES = 8 << 20
RETRY_AFTER_S = 1
MAX_REQUEST_ID = 256  # characters of a client's X-Request-Id that are kept
REMEMBERED_IDS = 1 << 16  # client request ids a worker remembers, to keep each one's trace its own


class Gateway(Protocol):
    """What the app needs of its api worker."""

    served_model: str
    max_model_len: int
    api_keys: tuple[str, ...]  # any one opens the guarded routes; none: all are open

    request_timeout: float | None
    body_timeout: float | None  # seconds a client may take to send a request's body
    write_timeout: float  # seconds a stream may wait for its client to read
    max_stream_backlog: int  # tokens a stream may hold for a client that has not read them
    allowed_hosts: tuple[str, ...] | None  # Host values served besides IP addresses and localhost; None: any
    cache_salt_by_key: bool  # each API key's prefix-cache entries apart from the others'

    def check_capacity(self, count: int, client: str) -> None:
        """Raise Overloaded when `count` more requests of `client` may not enter now, ApiError when never."""
        ...

    async def submit(self, meta: dict, ids: list[int] | None, inbox: asyncio.Queue, client: str) -> int: ...

    async def abort(self, rid: int) -> None: ...

    async def flush_cache(self, unpin: bool = False) -> int:
        """Evict every prefix-cache page that no request holds (or, with `unpin`, release the warmed
        prefixes' pins); returns how many pages."""
        ...

    async def warm(self, prefixes: list[dict]) -> list[dict]:
        """Prefill each prompt into the prefix cache and pin it there; each one's prompt and pinned tokens."""
        ...

    async def lora_adapter(self, name: str, path: str | None) -> dict[str, str]:
        """Load the LoRA adapter at `path` as `name` on every engine (None: unload it); the adapters served after."""
        ...

    def health(self) -> str:
        """/health's status: "ok" (200), else why not (503)."""
        ...

    def limits(self) -> Limits:
        """What a request may ask of the served model, for the checks made before it is sent on."""
        ...

    def server_info(self) -> dict: ...

    def answered(self, rid: str, body: dict, choices: list[dict]) -> None:
        """A request answered in full, its response sent: `body` is the client's with the seed it sampled with,
        `choices` each choice's index, token ids and finish reason (a shadow server may be asked the same)."""
        ...


def _json(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)


class ClosingError(ApiError):
    """An ApiError after which the connection is closed: the rest of its request's body is not coming."""


def _require_json(request: web.Request) -> None:
    """Every POST route takes a JSON body, and must be told so: a web page may send text/plain, a form
    or no Content-Type to another origin without a CORS preflight, but not application/json (the
    preflight this server never grants). So no page a browser shows can drive a local server."""
    if request.method != "POST" or request.match_info.http_exception is not None:  # a 404 or 405 stays one
        return
    if request.content_type != "application/json":  # parsed: parameters dropped, lower case
        given = request.content_type if hdrs.CONTENT_TYPE in request.headers else "none"
        given = given.encode("ascii", "backslashreplace").decode()  # header bytes that are not UTF-8 arrive as surrogates
        raise ApiError(f"the request body must be sent as Content-Type: application/json, not {given}", 415)


async def _read_body(request: web.Request, timeout: float | None) -> bytes:
    """The whole body, or a 408 once `timeout` has passed: a client that stalls mid-upload holds no
    connection open for long."""
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise ClosingError(
            f"the request body did not arrive within the server's --body-timeout of {timeout:g} s", 408, code="timeout"
        ) from None


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every failure leaves as OpenAI's error body: ours with their status, aiohttp's too."""
    try:
        _require_json(request)
        return await handler(request)
    except ClosingError as exc:  # sent now, then the connection closes, without waiting for the rest of the body
        response = _json(exc.body(), exc.status)
        response.force_close()  # Connection: close
        try:
            await response.prepare(request)
            await response.write_eof()
        finally:  # else aiohttp lingers up to 10 s after the answer, reading a body that is not coming
            request.protocol.force_close()
        return response
    except ApiError as exc:
        return _json(exc.body(), exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _json(
            ApiError(exc.reason, exc.status, kind="invalid_request_error" if exc.status < 500 else "server_error").body(), exc.status
        )
    except RequestPayloadError as exc:  # a body that its Content-Encoding cannot decode
        return _json(ApiError(f"the request body could not be read: {exc}").body(), 400)
    except Exception as exc:  # a bug of ours: still an OpenAI-shaped answer, and the worker lives on
        return _json(_internal_error(exc, path=request.path).body(), 500)


def _internal_error(exc: Exception, **where: str) -> ApiError:
    """A bug of ours as OpenAI's 500, logged once at error level with its traceback (no locals: see runtime.obs.logs)."""
    log.error("handler_failed", exc_info=exc, **where)
    return ApiError(f"internal error: {type(exc).__name__}", 500, kind="server_error")


def _cut_off(request: web.Request, rid: str, why: str) -> None:
    """Drop a slow client's connection, unsent bytes and all (a graceful close would wait for it to read
    them): its handler is cancelled, which aborts its unfinished choices."""
    log.warning("slow_client_cut_off", rid=rid, why=why)
    metrics().slow_client_aborts.inc()
    if (transport := request.transport) is not None:
        transport.abort()


def _raise_if_refused(delta: dict) -> None:
    if "error" in delta:
        error = delta["error"]
        raise ApiError(error["message"], error["status"], param=error["param"], kind=error["kind"])


class Overloaded(Exception):
    """Raised by Gateway.check_capacity: answered with a 503 and Retry-After, before any work."""


class Inbox(asyncio.Queue):
    """A request's deltas; `get` fails the request once --request-timeout has passed. A client that
    leaves more than `backlog` tokens unread (a stream it does not read: its writes wait) is cut
    off: `on_overflow` runs once, and nothing more is kept."""

    def __init__(self, timeout: float | None, backlog: int, on_overflow: Callable[[], None]) -> None:
        super().__init__()
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.backlog, self.on_overflow = backlog, on_overflow
        self.pending_tokens = 0
        self.overflowed = False

    def put_nowait(self, item: dict) -> None:
        if self.overflowed:
            return
        self.pending_tokens += len(item.get("token_ids", ()))
        if self.pending_tokens > self.backlog and not self.empty():  # one delta alone (a resync's catch-up) never trips it
            self.overflowed = True
            self.on_overflow()
            return
        super().put_nowait(item)

    async def get(self) -> dict:
        if self.deadline is None:
            delta = await super().get()
        else:
            try:
                delta = await asyncio.wait_for(super().get(), max(0.0, self.deadline - time.monotonic()))
            except TimeoutError:
                raise ApiError("the request took longer than the server's --request-timeout", 408, code="timeout") from None
        self.pending_tokens -= len(delta.get("token_ids", ()))
        return delta


@dataclass
class ChoiceState:
    index: int
    trace: str  # the id its log lines carry: the request's, with "/index" when it has several choices
    # the whole choice's text and logprobs, kept for an answer sent whole (a stream sends each delta on); its ids, kept
    # for either (Gateway.answered)
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    generated: int = 0  # tokens so far
    finish: str | None = None
    matched_stop: str | int | None = None  # what ended a "stop" finish: a stop string, or the token
    usage: dict | None = None
    started: bool = False
    token_chars: int = 0  # length of the token texts so far: where the next logprob's text_offset starts
    prompt: dict | None = None  # the prompt's text and log-probabilities, when the request echoes or asked for them
    first_token_s: float | None = None
    last_token_at: float = 0.0
    output: ChatOutput | HarmonyParser | None = None  # a streamed chat choice's reasoning and tool-call parsers


def _echoed(c: Completion, state: ChoiceState) -> tuple[str, list[dict]]:
    """What an echo puts before a completion choice's text and its logprobs (trimmed to the request's N)."""
    if not c.echo or state.prompt is None:
        return "", []
    top = c.params.logprobs
    entries = state.prompt["logprobs"] if top is not None else None
    return state.prompt["text"], [{**e, "top": e["top"][:top]} for e in entries or ()]


def _prompt_logprobs(c: Completion, state: ChoiceState) -> dict:
    """vLLM's `prompt_logprobs` field, when asked: on a completion choice, or on a chat response."""
    if c.prompt_logprobs is None or state.prompt is None:
        return {}
    return {"prompt_logprobs": prompt_logprobs_block(state.prompt["logprobs"], c.prompt_logprobs)}


@dataclass(frozen=True)
class LatencyMetrics:
    """The served model's request metrics, labelled once: a delta is no time for label lookups."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    success: Counter  # by finished_reason, labelled per finish

    @classmethod
    def of(cls, model: str) -> LatencyMetrics:
        m = metrics()
        return cls(m.ttft.labels(model), m.itl.labels(model), m.e2e.labels(model), m.success)


@dataclass
class RequestClock:
    """When a request arrived, for its latency metrics and log lines."""

    rid: str
    model: str
    metrics: LatencyMetrics
    arrived: float

    def on_delta(self, state: ChoiceState, delta: dict) -> None:
        now, m = time.monotonic(), self.metrics
        if delta["token_ids"]:
            if state.first_token_s is None:
                state.first_token_s = now - self.arrived
                m.ttft.observe(state.first_token_s)
                log.info("first_token", rid=state.trace, ttft_s=round(state.first_token_s, 6))
            else:
                m.itl.observe(now - state.last_token_at)
            state.last_token_at = now
        if state.finish is not None:
            e2e = now - self.arrived
            m.e2e.observe(e2e)
            m.success.labels(self.model, state.finish).inc()
            log.info(
                "finished",
                rid=state.trace,
                finish_reason=state.finish,
                e2e_s=round(e2e, 6),
                ttft_s=state.first_token_s and round(state.first_token_s, 6),
                **(state.usage or {}),
            )


class Handlers:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.latency = LatencyMetrics.of(gateway.served_model)
        self._seen_ids: OrderedDict[str, None] = OrderedDict()  # the newest REMEMBERED_IDS client ids
        self._suffixes = itertools.count(1)

    async def _body(self, request: web.Request) -> object:
        try:
            return orjson.loads(await _read_body(request, self.gateway.body_timeout))
        except orjson.JSONDecodeError as exc:
            raise ApiError(f"the body is not valid JSON in UTF-8: {exc}") from None

    def _request_id(self, request: web.Request, c: Completion) -> str:
        """The client's X-Request-Id, with a suffix when this worker has seen it recently (a
        reused id would merge two requests' traces); else the id of the response body. The
        response echoes it, and the body's id carries it too, as in vLLM. An id that is not printable
        is replaced: aiohttp hands header bytes that are not UTF-8 over as surrogates, which no log
        line or JSON body can carry."""
        wanted = request.headers.get("X-Request-Id", "").strip()[:MAX_REQUEST_ID]
        if not wanted or not wanted.isprintable():
            return envelope(c, chunk=False)["id"]
        rid = wanted if wanted not in self._seen_ids else f"{wanted}-{next(self._suffixes)}"
        self._seen_ids[rid] = None
        if len(self._seen_ids) > REMEMBERED_IDS:
            self._seen_ids.popitem(last=False)
        c.id = rid
        return rid

    def _client(self, request: web.Request) -> tuple[str, str | None]:
        """Who sent the request, for its share of the server: its API key's digest where keys are set (the
        key_check middleware let it in), else its address; and that digest, or None."""
        if not self.gateway.api_keys:
            return f"address:{request.remote}", None
        given = request.headers.get("Authorization", "").partition(" ")[2].strip()
        key = hashlib.sha256(given.encode()).hexdigest()[:32]
        return f"key:{key}", key

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrived = time.monotonic()
        body = await self._body(request)
        c = parse(body, chat, self.gateway.served_model, self.gateway.limits())
        picked = c.params.seed is None  # then one for the request: its choices sample from it, and a copy again
        if picked:
            c.params = replace(c.params, seed=random.getrandbits(63))
        rid = self._request_id(request, c)
        client, key = self._client(request)
        if self.gateway.cache_salt_by_key and key is not None:  # the key's own namespace, the request's salt within it
            c.params = replace(c.params, cache_salt=f"{key}/{c.params.cache_salt or ''}")
        try:
            self.gateway.check_capacity(len(c.prompts) * c.n, client)
        except Overloaded as exc:
            error = ApiError(str(exc), 503, kind="server_error", code="overloaded")
            return _json(error.body(), 503, {"Retry-After": str(RETRY_AFTER_S), "X-Request-Id": rid})
        # harmony's markers are special tokens, which its parser reads (and keeps from the client)
        skip_special_tokens = c.skip_special_tokens and not (c.chat and self.gateway.limits().reasoning_parser == HARMONY)
        clock = RequestClock(rid, self.gateway.served_model, self.latency, arrived)
        log.info("received", rid=rid, path=request.path, stream=c.stream, prompts=len(c.prompts), n=c.n)
        inbox = Inbox(self.gateway.request_timeout, self.gateway.max_stream_backlog, lambda: _cut_off(request, rid, "backlog"))
        choices: dict[int, ChoiceState] = {}
        try:
            for p, prompt in enumerate(c.prompts):
                for j in range(c.n):
                    # a client's seed: each prompt's choices j as vLLM's; one picked here: every choice its own
                    seed = c.params.seed
                    offset = p * c.n + j if picked else j
                    params = replace(c.params, seed=None if seed is None else (seed + offset) % 2**63)
                    detok = {
                        "stop": c.stop,
                        "skip_special_tokens": skip_special_tokens,
                        "top_logprobs": c.params.logprobs or 0,
                        "prompt": c.echo or c.prompt_logprobs is not None,
                    }
                    index = p * c.n + j
                    trace = rid if len(c.prompts) * c.n == 1 else f"{rid}/{index}"
                    meta = {
                        "params": params,
                        "detok": detok,
                        "trace": trace,
                        "messages": prompt.get("messages"),
                        "prompt": prompt.get("prompt"),
                        "guide": c.guide,
                        "template": c.template,
                    }
                    state = ChoiceState(index, trace, output=self._chat_output(c) if c.stream else None)
                    choices[await self.gateway.submit(meta, prompt.get("ids"), inbox, client)] = state
            if c.stream:
                response = await self._stream(request, c, inbox, choices, clock)
            else:
                while any(s.finish is None for s in choices.values()):
                    self._absorb(c, await inbox.get(), choices, clock)
                response = _json(self._whole(c, choices), headers={"X-Request-Id": rid})
                try:  # sent before anything else is done for it
                    await response.prepare(request)
                    await response.write_eof()
                except ConnectionError:  # the client left as it came
                    return response
            # a stream that failed or lost its client is not answered; nor, to a copy, several prompts under a seed
            # picked here (a client's seed numbers each prompt's choices afresh)
            if all(s.finish is not None for s in choices.values()) and (len(c.prompts) == 1 or not picked):
                answered = [
                    {"index": s.index, "token_ids": s.token_ids, "logprobs": [], "finish_reason": s.finish} for s in choices.values()
                ]
                self.gateway.answered(rid, {**cast("dict", body), "seed": c.params.seed}, answered)  # parse took only a dict
            return response
        except ApiError as exc:
            log.info("failed", rid=rid, status=exc.status, error=exc.message)
            raise
        finally:
            for choice_rid, state in choices.items():
                if state.finish is None:  # the client left, or a sibling failed
                    log.info("aborted", rid=state.trace)
                    await self.gateway.abort(choice_rid)

    @staticmethod
    def _absorb(c: Completion, delta: dict, choices: dict[int, ChoiceState], clock: RequestClock) -> ChoiceState:
        _raise_if_refused(delta)
        state = choices[delta["rid"]]
        if state.prompt is None and "prompt" in delta:  # with the first tokens (again after a replay: kept once)
            state.prompt = delta["prompt"]
            state.token_chars += sum(len(e["token"]) for e in _echoed(c, state)[1])
        state.token_ids += delta["token_ids"]
        if not c.stream:
            state.text.append(delta["text"])
            state.logprobs += delta.get("logprobs", [])
        state.generated += len(delta["token_ids"])
        state.token_chars += sum(len(e["token"]) for e in delta.get("logprobs", []))
        state.usage = delta.get("usage", state.usage)  # with the first tokens (prompt and cache), and with the finish
        if delta["finish"] is not None:
            state.finish, state.matched_stop = delta["finish"], delta["matched_stop"]
        clock.on_delta(state, delta)
        return state

    def _chat_output(self, c: Completion) -> ChatOutput | HarmonyParser | None:
        """The parsers a chat choice's text goes through, if the server or the request asks for any."""
        limits = self.gateway.limits()
        tools = c.tools if c.tools is not None and c.tools.choice != "none" else None
        tool_parser = limits.tool_call_parser if tools else None
        if not c.chat or not (tool_parser or limits.reasoning_parser):
            return None
        names = {tool["function"]["name"] for tool in tools.tools} if tools else set()
        if limits.reasoning_parser == HARMONY:  # the tool-call parser too (actors.pipeline)
            return HarmonyParser(names)
        return ChatOutput(limits.reasoning_parser, tool_parser, names, constrained=c.guide is not None)

    @staticmethod
    def _parsed(
        output: ChatOutput | HarmonyParser | None, text: str, finish: str | None, stream: bool
    ) -> tuple[str | None, dict | None, str | None]:
        """The choice's content, its other message fields and its finish reason, `text` read by `output`."""
        if output is None:
            return text, None, finish
        parts = output.feed(text, final=finish is not None)
        content = parts.pop("content")
        if not stream and "tool_calls" in parts:  # a whole message's calls carry no index, and content only if there is some
            parts["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in parts["tool_calls"]]
            content = content.strip() or None
        return content, parts, "tool_calls" if finish == "stop" and output.calls else finish

    def _usage(self, c: Completion, choices: dict[int, ChoiceState]) -> dict:
        """The request's usage so far: each prompt once, however many choices; choices not begun count nothing."""
        states = [s for s in choices.values() if s.usage is not None]
        firsts = [s.usage for s in states if s.index % c.n == 0 and s.usage is not None]
        return usage(sum(u["prompt_tokens"] for u in firsts), sum(s.generated for s in states), sum(u["cached_tokens"] for u in firsts))

    def _whole(self, c: Completion, choices: dict[int, ChoiceState]) -> dict:
        out = []
        for s in sorted(choices.values(), key=lambda s: s.index):
            echo_text, echo_entries = _echoed(c, s)
            logprobs = logprobs_block(c.chat, echo_entries + s.logprobs, 0) if c.params.logprobs is not None else None
            text, parts, finish = self._parsed(self._chat_output(c), "".join(s.text), s.finish, stream=False)
            token_ids = s.token_ids if c.echo_token_ids else None
            # an echo is a completion's, whose text is never None; a chat message's content may be (tool calls)
            text = echo_text + text if echo_text and text is not None else text
            body = choice(c, s.index, text, finish, logprobs, token_ids, delta=False, parts=parts, matched_stop=s.matched_stop)
            out.append(body if c.chat else body | _prompt_logprobs(c, s))
        response = {**envelope(c, chunk=False), "choices": out, "usage": self._usage(c, choices)}
        first = next(s for s in choices.values() if s.index == 0)
        return response | _prompt_logprobs(c, first) if c.chat else response  # a chat request has one prompt

    async def _stream(
        self, request: web.Request, c: Completion, inbox: asyncio.Queue, choices: dict[int, ChoiceState], clock: RequestClock
    ) -> web.StreamResponse:
        """The choices as server-sent events. A failure once the stream has begun ends it with an error
        event and [DONE]: its 200 has gone out, so no second status line may follow."""
        first = await inbox.get()  # a refusal before any token is still a plain HTTP error
        _raise_if_refused(first)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": clock.rid})
        await response.prepare(request)
        delta: dict | None = first
        try:
            while delta is not None:
                offset = choices[delta["rid"]].token_chars  # where this delta's logprob offsets start
                state = self._absorb(c, delta, choices, clock)
                chunk = envelope(c, chunk=True)
                echo_text, echo_entries = _echoed(c, state) if not state.started else ("", [])
                entries = echo_entries + delta.get("logprobs", [])
                logprobs = logprobs_block(c.chat, entries, offset) if c.params.logprobs is not None else None
                token_ids = delta["token_ids"] if c.echo_token_ids else None
                text, parts, finish = self._parsed(state.output, delta["text"], state.finish, stream=True)
                first = not state.started
                text = echo_text + text if echo_text and text is not None else text
                matched = state.matched_stop
                body = choice(c, state.index, text, finish, logprobs, token_ids, delta=True, first=first, parts=parts, matched_stop=matched)
                extra = _prompt_logprobs(c, state) if first else {}
                chunk["choices"] = [body if c.chat else body | extra]
                if c.chat:
                    chunk |= extra
                state.started = True
                if c.include_usage:  # each chunk's running total with continuous_usage_stats, as vLLM
                    chunk["usage"] = self._usage(c, choices) if c.continuous_usage else None
                await self._write(request, response, clock.rid, b"data: " + orjson.dumps(chunk) + b"\n\n")
                delta = await inbox.get() if any(s.finish is None for s in choices.values()) else None
        except ConnectionResetError:  # the client left; the caller's finally aborts what is unfinished
            return response
        except ApiError as exc:
            log.info("failed", rid=clock.rid, status=exc.status, error=exc.message)
            last = [exc.body()]
        except Exception as exc:
            last = [_internal_error(exc, rid=clock.rid, path=request.path).body()]
        else:
            last = [{**envelope(c, chunk=True), "choices": [], "usage": self._usage(c, choices)}] if c.include_usage else []
        try:
            for data in [*map(orjson.dumps, last), b"[DONE]"]:
                await self._write(request, response, clock.rid, b"data: " + data + b"\n\n")
            await response.write_eof()
        except ConnectionResetError:  # the client left meanwhile: nothing more to tell it
            pass
        return response

    async def _write(self, request: web.Request, response: web.StreamResponse, rid: str, data: bytes) -> None:
        """One event onto the stream; a client that has not read for --write-timeout is cut off."""
        try:
            async with asyncio.timeout(self.gateway.write_timeout):
                await response.write(data)
        except TimeoutError:
            _cut_off(request, rid, "write_timeout")
            raise ConnectionResetError("the client stopped reading") from None

    def _model_cards(self) -> list[dict]:
        """The served model's card, then each LoRA adapter's, with the served model as its parent (as vLLM lists them)."""
        served, created = self.gateway.served_model, int(time.time())
        card = {"object": "model", "created": created, "owned_by": "ringllm", "max_model_len": self.gateway.max_model_len}
        adapters = [{**card, "id": name, "root": path, "parent": served} for name, path in self.gateway.limits().adapters]
        return [{**card, "id": served, "root": served, "parent": None}, *adapters]

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": self._model_cards()})

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the served model's card or an adapter's, else OpenAI's 404."""
        wanted = request.match_info["id"]
        if (card := next((card for card in self._model_cards() if card["id"] == wanted), None)) is None:
            raise model_not_found(f"the model '{wanted}' does not exist", "model")
        return _json(card)

    async def health(self, request: web.Request) -> web.Response:
        status = self.gateway.health()
        return _json({"status": status}, 200 if status == "ok" else 503)

    async def live(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": VERSION})

    async def server_info(self, request: web.Request) -> web.Response:
        return _json(self.gateway.server_info())

    async def model_info(self, request: web.Request) -> web.Response:
        """SGLang's /model_info: the model's folder (where its tokenizer is) and the name clients pass."""
        model_dir = self.gateway.server_info()["model_path"]
        info = {"model_path": model_dir, "tokenizer_path": model_dir, "served_model_name": self.gateway.served_model}
        return _json(info | {"is_generation": True, "max_context_length": self.gateway.max_model_len})

    async def load(self, request: web.Request) -> web.Response:
        """SGLang's /get_load: the requests this server holds, running and queued (a router's power-of-two choice)."""
        scheduler = self.gateway.server_info()["scheduler"]
        return _json({"load": scheduler["running"] + scheduler["waiting"]})

    async def flush_cache(self, request: web.Request) -> web.Response:
        """SGLang's admin route: benchmarks run the same prompts again on a cold cache (warmed prefixes stay)."""
        return _json({"flushed_pages": await self.gateway.flush_cache()})

    async def warm_prefixes(self, request: web.Request) -> web.Response:
        """Prefill prefixes into the prefix cache and pin them there until DELETE /warm_prefixes."""
        body = await self._body(request)
        return _json({"prefixes": await self.gateway.warm(parse_prefixes(body, self.gateway.limits()))})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """SGLang's and vLLM's route: {"lora_name", "lora_path"} loads (or reloads) an adapter on every engine."""
        body = await self._body(request)
        name, path = _adapter_field(body, "lora_name"), _adapter_field(body, "lora_path")
        return _json({"success": True, "loaded_adapters": await self.gateway.lora_adapter(name, path)})

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """{"lora_name"}: the adapter is served no more (refused while requests run with it)."""
        name = _adapter_field(await self._body(request), "lora_name")
        return _json({"success": True, "loaded_adapters": await self.gateway.lora_adapter(name, None)})

    async def unpin_prefixes(self, request: web.Request) -> web.Response:
        return _json({"unpinned_pages": await self.gateway.flush_cache(unpin=True)})

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})


def _adapter_field(body: object, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value.strip():
        raise ApiError(f"'{name}' must be a non-empty string", param=name)
    return value


OPEN_ROUTES = frozenset({"/health", "/health/live", "/metrics", "/version"})  # probes and scrapers carry no key


def key_check(keys: tuple[str, ...]):
    """The outermost middleware: a request passes only with 'Authorization: Bearer KEY' for one of
    `keys`, each compared in constant time, else a 401 in OpenAI's shape before anything else is
    looked at; OPEN_ROUTES pass without one."""
    wanted = [key.encode() for key in keys]
    refusal = ApiError("a valid API key is required: send it as 'Authorization: Bearer KEY'", 401, code="invalid_api_key")

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in OPEN_ROUTES:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            given_bytes = given.strip().encode()
            if scheme.lower() != "bearer" or not any([hmac.compare_digest(given_bytes, key) for key in wanted]):  # noqa: C419 (all compared)
                return _json(refusal.body(), 401, {"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check


def _host_name(host: str) -> str:
    """A Host header's name: its port, and an IPv6 address's brackets, taken off; lower case."""
    if host.startswith("["):
        return host[1 : host.find("]")].lower()
    return (host.rpartition(":")[0] if host.count(":") == 1 else host).lower()


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_check(allowed: tuple[str, ...]):
    """A guard against DNS rebinding where no API key guards the server: a web page whose name an attacker
    points at this machine reaches it with its own name as Host. Served are IP addresses (a page shown from
    one is no rebinding), localhost and its subdomains, and the `allowed` names; the rest get a 403."""
    names = {name.lower() for name in allowed}

    @web.middleware
    async def check(request: web.Request, handler):
        host = request.headers.get(hdrs.HOST)
        name = _host_name(host) if host else None
        if name is None or _is_ip(name) or name == "localhost" or name.endswith(".localhost") or name in names:
            return await handler(request)
        shown = (host or "").encode("ascii", "backslashreplace").decode()
        refusal = ApiError(
            f"this server does not answer to the Host {shown!r}: start it with --allowed-host {_host_name(shown)} (or --api-key)", 403
        )
        return _json(refusal.body(), 403)

    return check


def build_app(gateway: Gateway) -> web.Application:
    keys = [key_check(gateway.api_keys)] if gateway.api_keys else []
    hosts = [host_check(gateway.allowed_hosts)] if gateway.allowed_hosts is not None else []
    app = web.Application(middlewares=[*hosts, *keys, openai_errors], client_max_size=MAX_BODY_BYTES)
    h = Handlers(gateway)
    app.add_routes(
        [
            web.post("/v1/chat/completions", h.chat),
            web.post("/v1/completions", h.completions),
            web.get("/v1/models", h.models),
            web.get("/v1/models/{id:.+}", h.model),  # ids may hold a slash (org/name)
            web.get("/health", h.health),
            web.get("/health/live", h.live),
            web.get("/version", h.version),
            web.get("/server_info", h.server_info),
            # what SGLang's router (`ringllm router`) asks a worker: its model, older spellings, its load
            web.get("/get_server_info", h.server_info),
            web.get("/model_info", h.model_info),
            web.get("/get_model_info", h.model_info),
            web.get("/get_load", h.load),
            web.get("/metrics", h.metrics),
            web.post("/flush_cache", h.flush_cache),
            web.post("/load_lora_adapter", h.load_lora_adapter),  # SGLang's spellings, then vLLM's
            web.post("/unload_lora_adapter", h.unload_lora_adapter),
            web.post("/v1/load_lora_adapter", h.load_lora_adapter),
            web.post("/v1/unload_lora_adapter", h.unload_lora_adapter),
            web.post("/warm_prefixes", h.warm_prefixes),
            web.delete("/warm_prefixes", h.unpin_prefixes),
        ]
    )
    return app
