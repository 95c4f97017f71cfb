"""`ringllm serve` through the official `openai` client, sync and async: chat and completions,
whole and streamed (streamed text must equal the whole answer, each choice must finish once with
SGLang's matched_stop on its last chunk, usage only on the last chunk and the same as the whole
answer's), n > 1, stop strings and stop token ids, seeds, logprobs (top 0 too, echo and prompt
logprobs of a one-token prompt), token-id prompts, prefix-cache reporting, the models list and the
context-overflow wording clients match on. Every request also checks that usage counts exactly
the tokens returned (`return_token_ids`), so the numbers a billing client reads are the real ones."""

from __future__ import annotations

import asyncio
import functools
import inspect
import re
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from openai.types import CompletionUsage

pytestmark = pytest.mark.slow  # the session's SmolLM2 server and transformers' reference model

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time"
FINISHES = ("stop", "length")


@dataclass
class Choice:
    text: str
    finish: str
    token_ids: list[int]
    logprobs: Any  # the response's logprobs object, or one per chunk when streamed
    matched_stop: str | int | None  # the stop string or token that ended a "stop" choice


@dataclass
class Result:
    choices: list[Choice]
    usage: CompletionUsage

    @property
    def one(self) -> Choice:
        assert len(self.choices) == 1
        return self.choices[0]


def _whole(response: Any, chat: bool) -> Result:
    assert response.object == ("chat.completion" if chat else "text_completion")
    assert [c.index for c in response.choices] == list(range(len(response.choices)))
    choices = []
    for c in response.choices:
        if chat:
            assert c.message.role == "assistant"
        assert c.finish_reason in FINISHES
        extra = c.model_extra
        choices.append(
            Choice(c.message.content if chat else c.text, c.finish_reason, extra["token_ids"], c.logprobs, extra["matched_stop"])
        )
    return Result(choices, response.usage)


def _merge(chunks: list[Any], chat: bool) -> Result:
    """Folds a stream (with include_usage) into one Result, checking the shape of every chunk."""
    *body, last = chunks
    assert last.choices == [] and last.usage is not None, "include_usage: the last chunk carries usage alone"
    assert all(chunk.usage is None for chunk in body), "usage before the last chunk"
    assert len({chunk.id for chunk in chunks}) == 1
    by_index: dict[int, list[Any]] = defaultdict(list)
    for chunk in body:
        assert chunk.object == ("chat.completion.chunk" if chat else "text_completion")
        for c in chunk.choices:
            by_index[c.index].append(c)
    assert sorted(by_index) == list(range(len(by_index)))
    choices = []
    for index in sorted(by_index):
        seq = by_index[index]
        finishes = [c.finish_reason for c in seq]
        assert finishes[:-1] == [None] * (len(seq) - 1) and finishes[-1] in FINISHES, f"choice {index}: {finishes}"
        assert ["matched_stop" in c.model_extra for c in seq] == [False] * (len(seq) - 1) + [True], "matched_stop on the last chunk only"
        if chat:
            assert [c.delta.role for c in seq] == ["assistant"] + [None] * (len(seq) - 1)
        text = "".join((c.delta.content if chat else c.text) or "" for c in seq)
        ids = [t for c in seq for t in c.model_extra["token_ids"]]
        choices.append(Choice(text, finishes[-1], ids, [c.logprobs for c in seq], seq[-1].model_extra["matched_stop"]))
    return Result(choices, last.usage)


@dataclass
class Api:
    client: openai.OpenAI | openai.AsyncOpenAI
    model: str

    async def create(self, stream: bool = False, **kw: Any) -> Result:
        """One request (chat when `messages` is given), greedy and short unless told otherwise."""
        chat = "messages" in kw
        endpoint = self.client.chat.completions if chat else self.client.completions
        if "max_completion_tokens" not in kw:
            kw.setdefault("max_tokens", 24)
        kw.setdefault("temperature", 0)
        if stream:
            kw["stream_options"] = {"include_usage": True}
        extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
        out = endpoint.create(model=self.model, stream=stream, extra_body=extra, **kw)
        if inspect.isawaitable(out):
            out = await out
        if stream:
            result = _merge([c async for c in out] if isinstance(out, openai.AsyncStream) else list(out), chat)
        else:
            result = _whole(out, chat)
        usage = result.usage
        assert usage.prompt_tokens > 0
        assert usage.completion_tokens == sum(len(c.token_ids) for c in result.choices)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
        return result


def _client(kind: type, smol_server) -> Any:
    return kind(base_url=smol_server.base_url + "/v1", api_key="x", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def sync_api(smol_server) -> Iterator[Api]:
    with _client(openai.OpenAI, smol_server) as client:
        yield Api(client, smol_server.model)


@pytest.fixture
async def async_api(smol_server) -> AsyncIterator[Api]:
    async with _client(openai.AsyncOpenAI, smol_server) as client:
        yield Api(client, smol_server.model)


@pytest.fixture(params=["sync", "async"])
def api(request) -> Api:
    return request.getfixturevalue(f"{request.param}_api")


@pytest.fixture(scope="module")
def story(sync_api: Api) -> Choice:
    """A greedy 24-token completion that later tests cut short."""
    return asyncio.run(sync_api.create(prompt=STORY, extra_body={"ignore_eos": True})).one


async def test_chat_answers_greedily_with_exact_usage(sync_api: Api) -> None:
    response = sync_api.client.chat.completions.create(
        model=sync_api.model, messages=CAPITAL, temperature=0, max_tokens=24, extra_body={"return_token_ids": True}
    )
    choice = response.choices[0]
    assert response.id.startswith("chatcmpl-") and response.model == sync_api.model
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    token_ids = choice.model_extra["token_ids"]
    assert response.usage.prompt_tokens > 0
    assert response.usage.completion_tokens == len(token_ids) > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


async def test_chat_stream_equals_whole(async_api: Api) -> None:
    whole = await async_api.create(messages=CAPITAL)
    streamed = await async_api.create(stream=True, messages=CAPITAL)  # _merge checks role, finish and usage placement
    assert "Paris" in whole.one.text
    assert streamed.one.text == whole.one.text and streamed.one.token_ids == whole.one.token_ids
    assert streamed.one.finish == whole.one.finish == "stop"
    assert streamed.one.matched_stop == whole.one.matched_stop == whole.one.token_ids[-1]  # the EOS token
    assert streamed.usage.completion_tokens == len(streamed.one.token_ids)
    assert streamed.usage.prompt_tokens == whole.usage.prompt_tokens


async def test_completion_stream_equals_whole_and_stops_at_max_tokens(api: Api) -> None:
    whole, streamed = [await api.create(stream=s, prompt=STORY, max_tokens=8, extra_body={"ignore_eos": True}) for s in (False, True)]
    assert whole.one.text and streamed.one.text == whole.one.text
    assert streamed.one.token_ids == whole.one.token_ids
    for result in (whole, streamed):
        assert result.one.finish == "length" and result.one.matched_stop is None and result.usage.completion_tokens == 8
        assert result.usage.prompt_tokens == whole.usage.prompt_tokens


async def test_n_choices_share_one_prompt_in_usage(sync_api: Api) -> None:
    single = await sync_api.create(messages=CAPITAL, max_tokens=1)
    several = await sync_api.create(messages=CAPITAL, n=3, temperature=1.0, seed=11, max_tokens=16)
    assert len(several.choices) == 3  # indices 0, 1, 2 and completion_tokens = their sum: checked in create
    assert several.usage.prompt_tokens == single.usage.prompt_tokens


async def test_n_choices_stream(async_api: Api) -> None:
    result = await async_api.create(stream=True, messages=CAPITAL, n=2, temperature=1.0, seed=5, max_tokens=12)
    assert len(result.choices) == 2  # each index present, finishing exactly once: checked in _merge
    assert all(c.token_ids for c in result.choices)


def _word(text: str) -> str:
    words = [w for w in re.findall(r"[A-Za-z]{4,}", text) if text.index(w) > 0]
    return words[len(words) // 2]


def _phrase(text: str) -> str:  # spans tokens: the detokenizer must hold the first word back
    phrases = re.findall(r"[a-z]+ [a-z]+", text)
    return phrases[len(phrases) // 2]


def _infix(text: str) -> str:  # ends inside a token
    return _word(text)[1:-1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("pick", [_word, _phrase, _infix])
async def test_stop_string_cuts_before_it(sync_api: Api, story: Choice, pick: Callable[[str], str], stream: bool) -> None:
    stop = pick(story.text)
    expected = story.text[: story.text.index(stop)]
    assert expected, f"stop {stop!r} must lie inside {story.text!r}"
    result = (await sync_api.create(stream=stream, prompt=STORY, stop=[stop], extra_body={"ignore_eos": True})).one
    assert result.text == expected and stop not in result.text
    assert result.finish == "stop" and result.matched_stop == stop
    assert story.token_ids[: len(result.token_ids)] == result.token_ids and len(result.token_ids) < len(story.token_ids)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_stop_token_id(sync_api: Api, story: Choice, stream: bool) -> None:
    stop_id = story.token_ids[6]
    cut = story.token_ids.index(stop_id) + 1
    result = (await sync_api.create(stream=stream, prompt=STORY, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})).one
    assert result.finish == "stop" and result.matched_stop == stop_id
    assert result.token_ids == story.token_ids[:cut]  # the stop token is the last one returned
    assert story.text.startswith(result.text) and len(result.text) < len(story.text)


async def test_seed_makes_sampling_repeatable(sync_api: Api) -> None:
    async def sample(seed: int, stream: bool = False) -> list[int]:
        return (await sync_api.create(stream=stream, prompt=STORY, temperature=1.0, seed=seed, max_tokens=12)).one.token_ids

    first = await sample(7)
    assert await sample(7) == first and await sample(7, stream=True) == first
    assert any([await sample(seed) != first for seed in (8, 9, 10)])


async def test_chat_logprobs(sync_api: Api) -> None:
    result = await sync_api.create(messages=CAPITAL, logprobs=True, top_logprobs=3)
    entries = result.one.logprobs.content
    assert len(entries) == result.usage.completion_tokens
    for entry in entries:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob <= 0
        assert entry.logprob == pytest.approx(max(tops), abs=1e-5) and entry.token == entry.top_logprobs[0].token


@pytest.mark.parametrize(
    ("stream", "held"), [(False, False), (True, False), (False, True), (True, True)], ids=["whole", "stream", "whole-held", "stream-held"]
)
async def test_completion_logprobs(sync_api: Api, story: Choice, stream: bool, held: bool) -> None:
    """`held`: a stop string that starts like the output but never completes, so text is held back and released."""
    stop = {"stop": [_word(story.text) + "Zzz"]} if held else {}
    result = await sync_api.create(stream=stream, prompt=STORY, logprobs=2, extra_body={"ignore_eos": True}, **stop)
    blocks = result.one.logprobs if stream else [result.one.logprobs]
    tokens = [t for b in blocks for t in b.tokens]
    logprobs = [lp for b in blocks for lp in b.token_logprobs]
    tops = [top for b in blocks for top in b.top_logprobs]
    offsets = [o for b in blocks for o in b.text_offset]
    assert len(tokens) == len(logprobs) == len(tops) == len(offsets) == result.usage.completion_tokens == 24
    assert "".join(tokens) == result.one.text == story.text
    for logprob, top in zip(logprobs, tops):
        assert len(top) == 2 and logprob <= 0 and logprob == pytest.approx(max(top.values()), abs=1e-5)
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


async def test_max_completion_tokens(sync_api: Api) -> None:
    result = await sync_api.create(messages=CAPITAL, max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert result.one.finish == "length" and result.usage.completion_tokens == 5


async def test_token_id_prompts_count_as_sent(sync_api: Api, story: Choice) -> None:
    ids = story.token_ids[:6]
    assert (await sync_api.create(prompt=ids, max_tokens=2)).usage.prompt_tokens == 6
    batch = await sync_api.create(prompt=[ids[:2], ids], n=2, temperature=1.0, seed=3, max_tokens=2)
    assert len(batch.choices) == 4  # index = prompt * n + choice
    assert batch.usage.prompt_tokens == 2 + 6  # each prompt once, however many choices


async def test_repeated_prefix_is_reported_cached(async_api: Api) -> None:
    system = f"Session {uuid.uuid4().hex}. " + "You are a careful assistant who answers briefly and politely. " * 16
    messages = [{"role": "system", "content": system}, *CAPITAL]
    first, second = [await async_api.create(messages=messages, max_tokens=8) for _ in range(2)]
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 150
    assert first.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > second.usage.prompt_tokens // 2
    assert second.one.token_ids == first.one.token_ids  # reusing the cache changes nothing


async def test_models_lists_the_served_model(sync_api: Api) -> None:
    models = list(sync_api.client.models.list())
    assert [m.id for m in models] == [sync_api.model] and models[0].object == "model"
    assert sync_api.client.models.retrieve(sync_api.model).id == sync_api.model
    with pytest.raises(openai.NotFoundError):
        sync_api.client.models.retrieve("org/another-model")


@pytest.mark.parametrize(
    ("change", "error"),
    [({"model": "nope"}, openai.NotFoundError), ({"temperature": 3}, openai.BadRequestError)],
    ids=["unknown-model", "temperature-3"],
)
async def test_invalid_requests_raise_the_client_errors(sync_api: Api, change: dict, error: type) -> None:
    with pytest.raises(error):
        sync_api.client.chat.completions.create(**{"model": sync_api.model, "messages": CAPITAL, "max_tokens": 2, **change})


async def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(sync_api: Api) -> None:
    """stream_options.continuous_usage_stats (vLLM's): each chunk carries the usage so far, two choices summed."""
    stream = sync_api.client.completions.create(
        model=sync_api.model,
        prompt=STORY,
        max_tokens=6,
        n=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    *body, last = chunks
    prompt = last.usage.prompt_tokens
    assert last.usage.completion_tokens == 12 and prompt > 0
    completions = [chunk.usage.completion_tokens for chunk in body]
    assert completions == list(range(1, 13)) and all(chunk.usage.prompt_tokens == prompt for chunk in body)


@pytest.fixture(scope="module")
def reference(smollm2) -> Callable[[list[int]], Any]:
    """transformers' own log-softmax over a prompt (float32, as the server runs)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> Any:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return log_softmax


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_echo_puts_the_prompt_and_its_logprobs_first(sync_api: Api, smollm2, reference, stream: bool) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    ids = tokenizer.encode(STORY + ", in a village by the sea, there lived an old fisherman")
    result = await sync_api.create(stream=stream, prompt=ids, max_tokens=4, echo=True, logprobs=2, extra_body={"ignore_eos": True})
    blocks = result.one.logprobs if stream else [result.one.logprobs]
    tokens, logprobs = [t for b in blocks for t in b.tokens], [lp for b in blocks for lp in b.token_logprobs]
    tops, offsets = [top for b in blocks for top in b.top_logprobs], [o for b in blocks for o in b.text_offset]
    assert result.one.text.startswith(tokenizer.decode(ids)) and "".join(tokens) == result.one.text
    assert len(tokens) == len(logprobs) == len(tops) == len(ids) + 4 and result.usage.prompt_tokens == len(ids)
    assert tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert logprobs[0] is None and tops[0] is None  # nothing comes before the first prompt token
    expected = reference(ids)
    for position in range(1, len(ids)):
        assert logprobs[position] == pytest.approx(expected[position - 1, ids[position]].item(), abs=2e-3)
        top = tops[position]  # the top 2 and the prompt's own token, as OpenAI and vLLM give them
        assert 2 <= len(top) <= 3 and top[tokens[position]] == logprobs[position] and max(top.values()) >= logprobs[position] - 1e-5
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]


async def test_prompt_logprobs_are_the_models_own_and_skip_the_prefix_cache(sync_api: Api, smollm2, reference) -> None:
    from transformers import AutoTokenizer

    prompt = f"Session {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog. " * 8
    await sync_api.create(prompt=prompt, max_tokens=2)  # now cached
    response = sync_api.client.completions.create(model=sync_api.model, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 3})
    assert response.usage.prompt_tokens_details.cached_tokens == 0  # every position's logits were computed again
    positions = response.choices[0].model_extra["prompt_logprobs"]
    ids = AutoTokenizer.from_pretrained(smollm2).encode(prompt)
    assert len(positions) == len(ids) == response.usage.prompt_tokens and positions[0] is None
    expected = reference(ids)
    for position, entries in enumerate(positions[1:], 1):
        row, own = expected[position - 1], entries[str(ids[position])]
        assert own["logprob"] == pytest.approx(row[ids[position]].item(), abs=2e-3)
        # its rank, give or take the tokens within the tolerance of it
        assert int((row > own["logprob"] + 2e-3).sum()) + 1 <= own["rank"] <= int((row > own["logprob"] - 2e-3).sum()) + 1
        best = sorted((e["rank"], e["logprob"], int(i)) for i, e in entries.items())[:3]
        assert [rank for rank, _, _ in best] == [1, 2, 3] and best[0][1] == pytest.approx(row.max().item(), abs=2e-3)


async def test_prompt_logprobs_past_their_bound_get_a_400_and_chat_refuses_echo(sync_api: Api) -> None:
    long_prompt = list(range(100, 1700))  # 1,600 tokens x (20 + 2) entries: past the 32,768 a request may ask for
    with pytest.raises(openai.BadRequestError, match="at most 32768"):
        sync_api.client.completions.create(model=sync_api.model, prompt=long_prompt, max_tokens=1, extra_body={"prompt_logprobs": 20})
    with pytest.raises(openai.BadRequestError, match="'echo' is for completions"):
        sync_api.client.chat.completions.create(model=sync_api.model, messages=CAPITAL, max_tokens=1, extra_body={"echo": True})
    chat = sync_api.client.chat.completions.with_raw_response.create(
        model=sync_api.model, messages=CAPITAL, max_tokens=1, extra_body={"prompt_logprobs": 0}
    ).parse()
    positions = chat.model_extra["prompt_logprobs"]  # vLLM puts a chat request's on the response
    assert len(positions) == chat.usage.prompt_tokens and all(len(p) == 1 for p in positions[1:])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_one_token_prompt_echoes_its_token_and_has_no_prompt_logprob(sync_api: Api, stream: bool) -> None:
    """ "Hi" is one token: its prompt_logprobs are [None] (nothing comes before it, as vLLM gives), and an
    echo with logprobs puts it first among the tokens, each token's text_offset pointing at it in the text."""
    create = functools.partial(sync_api.client.completions.create, model=sync_api.model, prompt="Hi", max_tokens=3, temperature=0)
    extra = {"prompt_logprobs": 1, "ignore_eos": True}
    response = create(stream=stream, echo=True, logprobs=1, extra_body=extra)
    choices = [c for chunk in response for c in chunk.choices] if stream else response.choices
    text = "".join(c.text for c in choices)
    tokens = [t for c in choices for t in c.logprobs.tokens]
    logprobs, offsets = [lp for c in choices for lp in c.logprobs.token_logprobs], [o for c in choices for o in c.logprobs.text_offset]
    assert choices[0].model_extra["prompt_logprobs"] == [None]
    assert text.startswith("Hi") and tokens[0] == "Hi" and logprobs[0] is None and len(tokens) == 4
    assert "".join(tokens) == text and [text[o : o + len(t)] for t, o in zip(tokens, offsets)] == tokens
    assert all(lp <= 0 for lp in logprobs[1:])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_zero_top_logprobs_give_the_drawn_tokens_own(sync_api: Api, stream: bool) -> None:
    """Chat's top_logprobs 0: each token's log-probability and an empty top list; completions' logprobs 0:
    each token's, its top dict holding only the token itself (vLLM's N + 1 with N = 0)."""
    extra = {"extra_body": {"ignore_eos": True}}
    chat = await sync_api.create(stream=stream, messages=CAPITAL, logprobs=True, top_logprobs=0, max_tokens=4, **extra)
    entries = [e for block in (chat.one.logprobs if stream else [chat.one.logprobs]) for e in block.content]
    assert len(entries) == 4 and all(e.top_logprobs == [] and e.logprob <= 0 for e in entries)
    text = await sync_api.create(stream=stream, prompt=STORY, logprobs=0, max_tokens=4, **extra)
    blocks = text.one.logprobs if stream else [text.one.logprobs]
    drawn = [(t, lp, top) for b in blocks for t, lp, top in zip(b.tokens, b.token_logprobs, b.top_logprobs)]
    assert len(drawn) == 4 and all(top == {token: logprob} for token, logprob, top in drawn)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_usage_is_the_same_streamed_and_whole(sync_api: Api, chat: bool) -> None:
    """The same fields and counts either way; a first request caches the prompt for both that follow."""
    prompt = f"Session {uuid.uuid4().hex}: " + STORY * 20
    ask = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    await sync_api.create(**ask, max_tokens=1)
    streamed, whole = [await sync_api.create(stream=s, **ask, max_tokens=3, extra_body={"ignore_eos": True}) for s in (True, False)]
    assert streamed.usage.model_dump(exclude_unset=True) == whole.usage.model_dump(exclude_unset=True)
    assert whole.usage.prompt_tokens_details.cached_tokens > 0


async def test_context_overflow_is_worded_as_openai_and_vllm_word_it(sync_api: Api) -> None:
    """Clients match on these words to shorten a conversation, on chat and completions alike."""
    limit = sync_api.client.models.retrieve(sync_api.model).model_extra["max_model_len"]
    for ask in ({"messages": CAPITAL}, {"prompt": STORY}):
        prompt = (await sync_api.create(**ask, max_tokens=1)).usage.prompt_tokens
        endpoint = sync_api.client.chat.completions if "messages" in ask else sync_api.client.completions
        with pytest.raises(openai.BadRequestError) as refused:
            endpoint.create(model=sync_api.model, max_tokens=limit, **ask)
        assert refused.value.body["message"] == (
            f"This model's maximum context length is {limit} tokens. However, you requested {prompt + limit} tokens "
            f"({prompt} in the messages, {limit} in the completion). Please reduce the length of the messages or completion."
        )
