"""The tokenizer actor: chat templates and batch encoding of everything that is waiting (through
tiktoken where the model's tokenizer allows it: runtime.fast_encode).

Stateless: each frame is a whole request, and the result goes straight on to the scheduler. A
replayed request is encoded again (encoding is deterministic) and keeps the tokens it already has.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import structlog

from actors.base import Actor
from actors.kinds import Kind
from runtime.config import ModelConfig
from runtime.fast_encode import encode_with_transformers, fast_encoder
from runtime.model_source import load_tokenizer
from transport.codec import unpack

log = structlog.get_logger()


class TokenizerActor(Actor):
    async def setup(self) -> None:
        serve = self.options["serve"]
        self.tokenizer = load_tokenizer(serve.model_dir, required=True)
        fast = fast_encoder(self.tokenizer)
        self.encode = fast or functools.partial(encode_with_transformers, self.tokenizer)
        log.info("prompt_encoder", kind="tiktoken" if fast else "transformers")
        model = ModelConfig.load(Path(serve.model_dir))
        self.max_position, self.vocab_size = model.max_position, model.vocab_size

    async def run(self) -> None:
        while True:
            batch = [await self.next_frame()]
            while (more := self.poll_frame()) is not None:  # encode all that waits in one call
                batch.append(more)
            submissions: dict[int, tuple] = {}
            for _, frame in batch:
                meta, arrays = unpack(frame)
                if frame.kind in (Kind.ABORT, Kind.PING, Kind.FLUSH_CACHE):
                    if frame.kind == Kind.ABORT:
                        submissions.pop(frame.rid, None)  # submitted and aborted in one batch: never forward it
                    await self.send("scheduler", frame.kind, frame.rid, {}, epoch=frame.epoch)
                else:
                    ids = arrays[0].tolist() if arrays and len(arrays[0]) else None
                    generated = arrays[1].tolist() if len(arrays) > 1 else []  # a replay's tokens so far
                    submissions[frame.rid] = (frame.rid, frame.epoch, meta, ids, generated)
            if submissions:
                await self._tokenize(list(submissions.values()))

    async def _tokenize(self, submissions: list) -> None:
        started = time.monotonic()
        texts, todo = [], []
        for rid, epoch, meta, ids, generated in submissions:
            if ids is None:
                try:
                    texts.append(self._text_of(meta))
                except Exception as exc:  # a template that rejects the messages
                    await self._refuse(rid, epoch, f"the chat template failed: {exc}")
                    continue
            todo.append((rid, epoch, meta, ids, generated))
        encoded = iter(self.encode(texts)) if texts else iter(())
        for rid, epoch, meta, ids, generated in todo:  # each goes on as soon as its ids are ready
            ids = ids if ids is not None else next(encoded)
            log.info("tokenized", rid=meta["trace"], prompt_tokens=len(ids), batch=len(todo),
                     tokenize_s=round(time.monotonic() - started, 6))
            limit = self.max_position
            if meta["params"]["max_tokens"] is None:  # the rest of the context, as vLLM does
                meta["params"]["max_tokens"] = max(1, limit - len(ids))
            if not ids:
                await self._refuse(rid, epoch, "the prompt is empty")
            elif max(ids) >= self.vocab_size:
                await self._refuse(rid, epoch, f"token id {max(ids)} is outside the vocabulary of {self.vocab_size}", param="prompt")
            elif len(ids) + meta["params"]["max_tokens"] > limit:
                await self._refuse(
                    rid, epoch, f"this model's maximum context length is {limit} tokens; the prompt has {len(ids)} and "
                    f"max_tokens asks for {meta['params']['max_tokens']} more", param="max_tokens",
                )
            else:
                await self.send("scheduler", Kind.REQUEST, rid, meta, [ids, generated], epoch=epoch)

    def _text_of(self, meta: dict) -> str:
        if meta.get("messages") is not None:
            return self.tokenizer.apply_chat_template(meta["messages"], add_generation_prompt=True, tokenize=False)
        return meta["prompt"]

    async def _refuse(self, rid: int, epoch: int, message: str, param: str | None = None) -> None:
        await self.send("scheduler", Kind.ERROR, rid, {"message": message, "param": param, "status": 400}, epoch=epoch)
