"""Grammars compile off the engine's step: a request waits out of the batch while its grammar compiles
(the scheduler passes it by), the engine compiles on a thread of its own, and a compile that runs past
--grammar-compile-timeout refuses its request with a 400 while the server goes on. Through the scheduler
core, the engine's GrammarMasks with SmolLM2's vocabulary, and a real server with the openai client."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
import sys
import time
from collections.abc import Iterator

import aiohttp
import numpy as np
import openai
import pytest
import torch

from benchmarks.server import sse_events
from runtime.config import EngineConfig, ModelConfig
from runtime.sampling_params import SamplingParams
from runtime.scheduler.scheduler import Scheduler
from runtime.structured.builder import Builder
from runtime.structured.grammars import GuideError, build_grammar
from runtime.structured.masks import GrammarMasks
from runtime.structured.vocabulary import tokenizer_info
from tests.conftest import Server, launch

# a few kB of grammar that takes seconds to compile against SmolLM2's vocabulary (2-3 s on a 2-core EPYC)
SLOW = ("json_schema", json.dumps({"type": "string", "maxLength": 3_000_000}))
# less than a second there, past 0.1 s anywhere
SLOWISH = ("json_schema", json.dumps({"type": "string", "minLength": 1_000_000}))
QUICK = ("regex", "[ab]{3}")
TIMEOUT_S = 0.5  # the server's bound: far below SLOW's compile, far above QUICK's


def test_a_request_waits_while_its_grammar_compiles_and_the_queue_passes_it():
    core = Scheduler(EngineConfig(page_size=4, max_running_requests=4), 64, (0,), 256)
    guided = core.add(1, [5, 6, 7], SamplingParams(max_tokens=4, guide=QUICK))
    guided.compiling = True
    core.add(2, [8, 9], SamplingParams(max_tokens=4))
    assert [slot.rid for slot in core.schedule().new_slots] == [2]
    assert [r.rid for r in core.waiting] == [1]
    guided.compiling = False
    assert [slot.rid for slot in core.schedule().new_slots] == [1]


def _answers(masks: GrammarMasks, rids: set[int], timeout: float = 60) -> dict[int, str | None]:
    """take_prepared's answers for `rids`, polled as the engine actor polls them."""
    answers: dict[int, str | None] = {}
    deadline = time.monotonic() + timeout
    while not rids <= answers.keys():
        assert time.monotonic() < deadline, f"no answer for {rids - answers.keys()}"
        answers.update(masks.take_prepared())
        time.sleep(0.005)
    return answers


@pytest.fixture
def masks(smollm2) -> Iterator[GrammarMasks]:
    """The engine's grammars, whose compiles may take 0.1 s."""
    cfg = ModelConfig.load(smollm2)
    grammar_masks = GrammarMasks(smollm2, cfg.vocab_size, cfg.eos_token_ids, compile_timeout=0.1)
    yield grammar_masks
    grammar_masks.stop()


def test_a_compile_past_the_bound_refuses_at_once_and_its_grammar_is_kept(masks):
    masks.prepare(1, QUICK)  # loads the compiler, which the bound does not count
    assert _answers(masks, {1}) == {1: None}
    masks.prepare(2, SLOWISH)
    refused = _answers(masks, {2})[2]
    assert refused is not None and "took longer than 0.1 s to compile" in refused
    masks.prepare(3, SLOWISH)  # the same grammar, still compiling past its bound: refused at once
    assert masks.take_prepared() == [(3, refused)]
    masks.prepare(5, SLOW)  # queued behind it, and withdrawn (its request was aborted): never run
    masks.forget(5)
    assert SLOW not in masks._compiling and not masks.waiting
    while not all(job.future.done() for job in masks._compiling.values()):  # it runs on to its end
        time.sleep(0.01)
    masks.prepare(4, SLOWISH)
    assert masks.take_prepared() == [(4, None)]
    masks.open(0, SamplingParams(guide=SLOWISH))
    assert masks.constrains(np.array([0]))


def test_without_xgrammar_the_engine_warms_up_and_a_guided_request_is_refused_with_why(smollm2, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as where the optional structured extra is not installed
    cfg = ModelConfig.load(smollm2)
    masks = GrammarMasks(smollm2, cfg.vocab_size, cfg.eos_token_ids)
    try:
        masks.warm_up(torch.device("cpu"))
        masks.prepare(1, QUICK)
        refused = _answers(masks, {1})[1]
        assert refused is not None and "xgrammar" in refused
    finally:
        masks.stop()


@pytest.mark.slow  # the builder process imports xgrammar and loads the tokenizer
def test_the_builder_process_builds_what_this_one_does_and_the_vocabulary_is_cached(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("RINGLLM_CACHE", str(tmp_path))
    cfg = ModelConfig.load(smollm2)
    builder = Builder()
    try:
        build = functools.partial(builder.vocabulary, str(smollm2), cfg.vocab_size, list(cfg.eos_token_ids))
        there = tokenizer_info(smollm2, cfg.vocab_size, cfg.eos_token_ids, build)
        (cached,) = tmp_path.rglob("*.json")
        assert cached.parent.name == "xgrammar_vocab"
        cached.unlink()
        here = tokenizer_info(smollm2, cfg.vocab_size, cfg.eos_token_ids)
        assert there.serialize_json() == here.serialize_json() == cached.read_text()
        assert builder.grammar(*SLOWISH) == build_grammar(*SLOWISH)
        with pytest.raises(GuideError, match="cannot be used"):
            builder.grammar("regex", "(")
    finally:
        builder.close()


@pytest.fixture(scope="module")
def bounded(tiny_smol, tmp_path_factory) -> Iterator[Server]:
    server = launch(tiny_smol, tmp_path_factory.mktemp("bounded") / "serve.log", "--grammar-compile-timeout", str(TIMEOUT_S))
    yield server
    server.stop()


async def _plain_streams(http: aiohttp.ClientSession, model: str, arrivals: list[tuple[int, float]]) -> None:
    """Plain streamed completions one after another, each token's (completion, arrival)."""
    for completion in range(1000):
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
        async with http.post("/v1/completions", json=body) as reply:
            async for _ in sse_events(reply):
                arrivals.append((completion, time.monotonic()))


@pytest.mark.slow
async def test_plain_tokens_flow_while_a_grammar_compiles_and_a_slow_one_is_a_400(bounded):
    api = openai.OpenAI(base_url=f"{bounded.base_url}/v1", api_key="none", max_retries=0)
    # a quick grammar waits for its compile, then joins the batch (and the engine's compiler is loaded from here on)
    guided = api.completions.create(model=bounded.model, prompt=[5, 6, 7], max_tokens=8, extra_body={"guided_regex": QUICK[1]})
    assert re.fullmatch(QUICK[1], guided.choices[0].text)

    arrivals: list[tuple[int, float]] = []
    async with aiohttp.ClientSession(bounded.base_url) as http:
        plain = asyncio.create_task(_plain_streams(http, bounded.model, arrivals))
        while len(arrivals) < 3:
            await asyncio.sleep(0.01)
        sent = time.monotonic()
        body = {"model": bounded.model, "prompt": [5, 6, 7], "max_tokens": 8, "response_format": _schema_format(SLOW)}
        async with http.post("/v1/completions", json=body) as reply:
            status, answer = reply.status, await reply.json()
        answered = time.monotonic()
        plain.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await plain
    assert status == 400, answer
    assert f"took longer than {TIMEOUT_S:g} s to compile" in answer["error"]["message"]
    during = [(completion, at) for completion, at in arrivals if sent < at < answered]
    gaps = [b - a for (c, a), (d, b) in zip(during, during[1:]) if c == d]
    print(f"{len(during)} plain tokens in the {answered - sent:.2f} s the grammar compiled; longest gap {max(gaps, default=0):.3f} s")
    assert len(during) >= 5  # the engine stepped on while the grammar compiled
    assert max(gaps) < TIMEOUT_S  # a compile between steps would have held every stream past the bound

    # the server goes on
    assert api.completions.create(model=bounded.model, prompt=[5, 6, 7], max_tokens=4, extra_body={"ignore_eos": True}).usage


def _schema_format(guide: tuple[str, str]) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "slow", "schema": json.loads(guide[1])}}
