"""The tokenizer actor: chat templates and batch encoding of everything that is waiting (through
tiktoken where the model's tokenizer allows it: runtime.text.fast_encode).

Stateless: each frame is a whole request, and the result goes straight on to the scheduler. A
replayed request is encoded again (encoding is deterministic) and keeps the tokens it already has.
Under data parallelism it places each encoded request on a replica (actors.replicas); aborts, pings
and flushes go to every replica.

A request with an output constraint (a guide) goes on with it: its engine builds and compiles the
grammar out of the batch's way (runtime.structured.masks), and a bad guide is refused from there with
a 400. Building it here too, to refuse it sooner, held this actor's GIL while plain prompts waited,
and took a second share of the cores the engine's steps run on.

Each frame is decoded as it is received, since the next receive hands its space back to the
writer. Long prompts go to a lane of their own (a thread with its own tokenizer, whose Rust core
runs without the GIL), so short prompts, pings and aborts never wait behind them; a prompt whose
head already overflows the context is refused without being encoded whole.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from actors.base import Actor
from actors.frames import Abort, Payload, Refusal, Submit, Tokenized, decode
from actors.gauges import TokenizerGauge
from actors.replicas import Replicas
from api.protocol import MAX_PROMPT_LOGPROB_ENTRIES, context_overflow, prompt_overflow
from runtime.config import ModelConfig
from runtime.models.source import load_tokenizer
from runtime.text.fast_encode import Encode, encode_with_transformers, fast_encoder
from runtime.text.prompt_length import encode_unless_longer, max_token_bytes
from transport.ring import Frame

log = structlog.get_logger()
LONG_PROMPT_CHARS = 16_384  # prompts longer than this encode in the long lane
MESSAGE_CHARS = 16  # what a message adds in the chat template, roughly, for choosing the lane
MAX_BATCH = 256  # frames taken in one batch, so that a flood still lets the loop turn
_libc = ctypes.CDLL(None)


@dataclass(frozen=True)
class Submission:
    """A SUBMIT frame, decoded, with the rid and epoch it came with."""

    rid: int
    epoch: int
    req: Submit

    @property
    def text_chars(self) -> int:
        if self.req.messages is not None:
            return sum(len(m["content"]) + MESSAGE_CHARS for m in self.req.messages)
        return len(self.req.prompt or "")


def _encoder(tokenizer: Any) -> Encode:
    fast = fast_encoder(tokenizer)
    return fast or functools.partial(encode_with_transformers, tokenizer)


class TokenizerActor(Actor):
    async def setup(self) -> None:
        serve = self.options["serve"]
        self.tokenizer = load_tokenizer(serve.model_dir, required=True)
        self.encode = _encoder(self.tokenizer)
        log.info("prompt_encoder", kind="transformers" if isinstance(self.encode, functools.partial) else "tiktoken")
        # the long lane's own tokenizer: a Hugging Face tokenizer must not be entered by two threads
        self.lane_tokenizer = load_tokenizer(serve.model_dir, required=True)
        self.lane_encode = _encoder(self.lane_tokenizer)
        self.lane = ThreadPoolExecutor(1, thread_name_prefix="long-prompts")
        self.in_lane: dict[tuple[int, int], bool] = {}  # (rid, epoch) -> aborted while it waits or encodes
        model = ModelConfig.load(Path(serve.model_dir))
        self.max_position, self.vocab_size = model.max_position, model.vocab_size
        self.slot["gauges"][TokenizerGauge.TOKEN_BYTES] = max_token_bytes(self.tokenizer)  # the api workers' length bound
        self.replicas = Replicas(self.control, serve)

    def on_epoch(self, epoch: int) -> None:
        self.replicas.restart()

    async def teardown(self) -> None:
        self.lane.shutdown(wait=False, cancel_futures=True)

    async def run(self) -> None:
        while True:
            batch = [self._decode(await self.next_frame())]
            while len(batch) < MAX_BATCH and (more := self.poll_frame()) is not None:
                batch.append(self._decode(more))
            submissions: dict[int, Submission] = {}
            for rid, epoch, payload in batch:
                if isinstance(payload, Submit):
                    submissions[rid] = Submission(rid, epoch, payload)
                    continue
                if isinstance(payload, Abort):
                    submissions.pop(rid, None)  # submitted and aborted in one batch: never forward it
                    if (rid, epoch) in self.in_lane:
                        self.in_lane[rid, epoch] = True
                await self.send_all(self.replicas.schedulers, payload, rid, epoch=epoch)  # an abort, ping or flush
            short = []
            for sub in submissions.values():
                if sub.req.ids is None and sub.text_chars > LONG_PROMPT_CHARS:
                    self.in_lane[sub.rid, sub.epoch] = False
                    asyncio.get_running_loop().create_task(self._tokenize_long(sub))
                else:
                    short.append(sub)
            if short:
                await self._tokenize(short)

    @staticmethod
    def _decode(got: tuple[str, Frame]) -> tuple[int, int, Payload]:
        """Everything the frame says, as Python objects: its space is the writer's at the next receive."""
        frame = got[1]
        return frame.rid, frame.epoch, decode(frame)

    async def _tokenize(self, submissions: list[Submission]) -> None:
        started = time.monotonic()
        texts, todo = [], []
        for sub in submissions:
            if sub.req.ids is None:
                try:
                    texts.append(self._text_of(self.tokenizer, sub.req))
                except Exception as exc:  # a template that rejects the messages
                    await self._refuse(sub, f"the chat template failed: {exc}")
                    continue
            todo.append(sub)
        encoded = iter(self.encode(texts)) if texts else iter(())
        for sub in todo:  # each goes on as soon as its ids are ready
            await self._forward(sub, sub.req.ids if sub.req.ids is not None else next(encoded), started, len(todo))

    async def _tokenize_long(self, sub: Submission) -> None:
        started = time.monotonic()
        try:
            ids = await asyncio.get_running_loop().run_in_executor(self.lane, self._encode_long, sub)
        except Exception as exc:  # a template that rejects the messages
            ids = f"the chat template failed: {exc}"
        if self.in_lane.pop((sub.rid, sub.epoch), True):
            return  # aborted while it encoded: the abort has gone on already
        if ids is None:
            param = "messages" if sub.req.messages is not None else "prompt"
            await self._refuse(
                sub, prompt_overflow(self.max_position, f"more than {self.max_position} tokens in the messages"), param=param
            )
        elif isinstance(ids, str):
            await self._refuse(sub, ids)
        else:
            await self._forward(sub, ids, started, 1)

    def _encode_long(self, sub: Submission) -> list[int] | None:
        """In the lane: the prompt's ids, or None when its head already overflows the context (or its
        client left while it waited: the result is dropped)."""
        if self.in_lane.get((sub.rid, sub.epoch), True):
            return None
        try:
            return encode_unless_longer(self.lane_encode, self._text_of(self.lane_tokenizer, sub.req), self.max_position)
        finally:
            _libc.malloc_trim(0)  # hand the encoding's megabytes back to the system

    async def _forward(self, sub: Submission, ids: list[int], started: float, batch: int) -> None:
        req, limit = sub.req, self.max_position
        log.info("tokenized", rid=req.trace, prompt_tokens=len(ids), batch=batch, tokenize_s=round(time.monotonic() - started, 6))
        params = req.params
        if not ids:
            await self._refuse(sub, "the prompt is empty")
        elif max(ids) >= self.vocab_size:
            await self._refuse(sub, f"token id {max(ids)} is outside the vocabulary of {self.vocab_size}", param="prompt")
        elif message := context_overflow(limit, len(ids), params.max_tokens):
            await self._refuse(sub, message, param="max_tokens")
        elif (top := params.prompt_logprobs) is not None and len(ids) * (top + 2) > MAX_PROMPT_LOGPROB_ENTRIES:
            await self._refuse(
                sub,
                f"the prompt's log-probabilities (echo with logprobs, or prompt_logprobs) of {len(ids)} tokens with the top "
                f"{top} each make {len(ids) * (top + 2)} entries; at most {MAX_PROMPT_LOGPROB_ENTRIES} (prompt tokens x (N + 2))",
                param="prompt_logprobs",
            )
        else:  # the prompt's text stays here
            params = params if req.guide is None else replace(params, guide=req.guide)
            scheduler = self.replicas.place(ids, params.cache_salt)
            await self.send(scheduler, Tokenized(params, req.detok, req.trace, ids, req.generated, req.pin), sub.rid, epoch=sub.epoch)

    @staticmethod
    def _text_of(tokenizer: Any, req: Submit) -> str:
        if req.messages is None:
            assert req.prompt is not None  # called only without ids: then a request brings messages or a prompt
            return req.prompt
        options = req.template  # a chat request's always (api.protocol.Completion.template)
        assert options is not None
        return tokenizer.apply_chat_template(
            req.messages,
            tools=options["tools"],
            add_generation_prompt=options["add_generation_prompt"],
            continue_final_message=options["continue_final_message"],
            tokenize=False,
            **options["kwargs"],
        )

    async def _refuse(self, sub: Submission, message: str, param: str | None = None) -> None:
        await self.send(self.replicas.any_live(), Refusal(message, 400, param), sub.rid, epoch=sub.epoch)
