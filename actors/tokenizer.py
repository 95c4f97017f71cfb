"""The tokenizer actor: chat templates and batch encoding of everything that is waiting (through
tiktoken where the model's tokenizer allows it: runtime.fast_encode).

Stateless: each frame is a whole request, and the result goes straight on to the scheduler. A
replayed request is encoded again (encoding is deterministic) and keeps the tokens it already has.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from actors.base import Actor
from actors.kinds import Kind
from actors.pipeline import TOKEN_BYTES_GAUGE
from api.protocol import context_overflow
from runtime.config import ModelConfig
from runtime.fast_encode import Encode, encode_with_transformers, fast_encoder
from runtime.model_source import load_tokenizer
from runtime.prompt_length import encode_unless_longer, max_token_bytes
from transport.codec import unpack
from transport.ring import Frame

log = structlog.get_logger()
LONG_PROMPT_CHARS = 16_384  # prompts longer than this encode in the long lane
MESSAGE_CHARS = 16  # what a message adds in the chat template, roughly, for choosing the lane
MAX_BATCH = 256  # frames taken in one batch, so that a flood still lets the loop turn
_libc = ctypes.CDLL(None)


@dataclass
class Submission:
    """A frame as the tokenizer needs it, copied out of the ring."""

    kind: Kind
    rid: int
    epoch: int
    meta: dict
    ids: list[int] | None  # token ids the client sent instead of text
    generated: list[int]  # a replay's tokens so far

    @property
    def text_chars(self) -> int:
        if (messages := self.meta.get("messages")) is not None:
            return sum(len(m["content"]) + MESSAGE_CHARS for m in messages)
        return len(self.meta.get("prompt") or "")


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
        self.slot["gauges"][TOKEN_BYTES_GAUGE] = max_token_bytes(self.tokenizer)  # the api workers' length bound

    async def teardown(self) -> None:
        self.lane.shutdown(wait=False, cancel_futures=True)

    async def run(self) -> None:
        while True:
            batch = [self._decode(await self.next_frame())]
            while len(batch) < MAX_BATCH and (more := self.poll_frame()) is not None:
                batch.append(self._decode(more))
            submissions: dict[int, Submission] = {}
            for sub in batch:
                if sub.kind != Kind.SUBMIT:
                    if sub.kind == Kind.ABORT:
                        submissions.pop(sub.rid, None)  # submitted and aborted in one batch: never forward it
                        if (sub.rid, sub.epoch) in self.in_lane:
                            self.in_lane[sub.rid, sub.epoch] = True
                    await self.send("scheduler", sub.kind, sub.rid, {}, epoch=sub.epoch)
                else:
                    submissions[sub.rid] = sub
            short = []
            for sub in submissions.values():
                if sub.ids is None and sub.text_chars > LONG_PROMPT_CHARS:
                    self.in_lane[sub.rid, sub.epoch] = False
                    asyncio.get_running_loop().create_task(self._tokenize_long(sub))
                else:
                    short.append(sub)
            if short:
                await self._tokenize(short)

    @staticmethod
    def _decode(got: tuple[str, Frame]) -> Submission:
        """Everything the frame says, as Python objects: its space is the writer's at the next receive."""
        frame = got[1]
        if frame.kind != Kind.SUBMIT:  # an abort, ping or flush: no payload to keep
            return Submission(frame.kind, frame.rid, frame.epoch, {}, None, [])
        meta, arrays = unpack(frame)
        ids = arrays[0].tolist() if arrays and len(arrays[0]) else None
        generated = arrays[1].tolist() if len(arrays) > 1 else []
        return Submission(frame.kind, frame.rid, frame.epoch, meta, ids, generated)

    async def _tokenize(self, submissions: list[Submission]) -> None:
        started = time.monotonic()
        texts, todo = [], []
        for sub in submissions:
            if sub.ids is None:
                try:
                    texts.append(self._text_of(self.tokenizer, sub.meta))
                except Exception as exc:  # a template that rejects the messages
                    await self._refuse(sub, f"the chat template failed: {exc}")
                    continue
            todo.append(sub)
        encoded = iter(self.encode(texts)) if texts else iter(())
        for sub in todo:  # each goes on as soon as its ids are ready
            await self._forward(sub, sub.ids if sub.ids is not None else next(encoded), started, len(todo))

    async def _tokenize_long(self, sub: Submission) -> None:
        started = time.monotonic()
        try:
            ids = await asyncio.get_running_loop().run_in_executor(self.lane, self._encode_long, sub)
        except Exception as exc:  # a template that rejects the messages
            ids = f"the chat template failed: {exc}"
        if self.in_lane.pop((sub.rid, sub.epoch), True):
            return  # aborted while it encoded: the abort has gone on already
        if ids is None:
            param = "messages" if sub.meta.get("messages") is not None else "prompt"
            await self._refuse(sub, f"this model's maximum context length is {self.max_position} tokens; the prompt "
                                    "has more than that", param=param)
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
            return encode_unless_longer(self.lane_encode, self._text_of(self.lane_tokenizer, sub.meta), self.max_position)
        finally:
            _libc.malloc_trim(0)  # hand the encoding's megabytes back to the system

    async def _forward(self, sub: Submission, ids: list[int], started: float, batch: int) -> None:
        meta, limit = sub.meta, self.max_position
        log.info("tokenized", rid=meta["trace"], prompt_tokens=len(ids), batch=batch,
                 tokenize_s=round(time.monotonic() - started, 6))
        if meta["params"]["max_tokens"] is None:  # the rest of the context, as vLLM does
            meta["params"]["max_tokens"] = max(1, limit - len(ids))
        if not ids:
            await self._refuse(sub, "the prompt is empty")
        elif max(ids) >= self.vocab_size:
            await self._refuse(sub, f"token id {max(ids)} is outside the vocabulary of {self.vocab_size}", param="prompt")
        elif message := context_overflow(limit, len(ids), meta["params"]["max_tokens"]):
            await self._refuse(sub, message, param="max_tokens")
        else:
            forwarded = {key: meta[key] for key in ("params", "detok", "trace")}  # the prompt's text stays here
            await self.send("scheduler", Kind.REQUEST, sub.rid, forwarded, [ids, sub.generated], epoch=sub.epoch)

    @staticmethod
    def _text_of(tokenizer: Any, meta: dict) -> str:
        if meta.get("messages") is not None:
            return tokenizer.apply_chat_template(meta["messages"], add_generation_prompt=True, tokenize=False)
        return meta["prompt"]

    async def _refuse(self, sub: Submission, message: str, param: str | None = None) -> None:
        await self.send("scheduler", Kind.ERROR, sub.rid, {"message": message, "param": param, "status": 400}, epoch=sub.epoch)

