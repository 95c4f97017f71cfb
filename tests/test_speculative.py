"""Speculative decoding (--speculative-algorithm NGRAM): drafts from the sequence's own earlier tokens, verified
in one forward, change no token. Greedy and seeded output equal plain decoding's, since a seeded draw is keyed by
the request's seed and position (runtime.engine.sampling): a draft token is kept exactly when it is the token
plain decoding would have drawn there."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.scheduler.ngram import ngram_draft

SPEC = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
STANDALONE = dict(speculative_algorithm="STANDALONE", speculative_num_draft_tokens=4)
SEEDED = SamplingParams(max_tokens=40, temperature=0.8, top_k=50, seed=5, ignore_eos=True)


def test_ngram_drafts_follow_the_latest_longest_match():
    assert ngram_draft([1, 2, 3, 4, 1, 2], 3, 1, 4) == [3, 4, 1]
    assert ngram_draft([7, 1, 9, 1, 2, 8, 1, 2], 2, 1, 4) == [8, 1]  # the match of [1, 2], not of [2]'s or [1]'s
    assert ngram_draft([1, 2, 3], 2, 1, 4) == []
    assert ngram_draft([5, 6, 5, 6, 5], 8, 2, 2) == [6, 5]  # as far as the sequence goes
    assert ngram_draft([4, 4, 1, 4], 2, 2, 3) == []  # no match of two tokens or more


@pytest.fixture(scope="module")
def looping(tmp_path_factory):
    """A tiny random model over 24 tokens: its greedy output falls into loops, which n-grams then draft."""
    from tests.tiny_models import build

    return build("llama", tmp_path_factory.mktemp("looping"), vocab_size=24)


def prompts(count: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 24) for _ in range(length)] for _ in range(count)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=120, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=120, temperature=0.7, top_p=0.9, seed=3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=120, temperature=1.0, seed=4, repetition_penalty=1.1, ignore_eos=True),
    ],
    ids=["greedy", "seeded-top-p-logprobs", "penalized"],
)
def test_ngram_speculation_keeps_drafts_and_changes_no_token(looping, params):
    plain = LLM(looping, dtype="float32", page_size=4).generate(prompts(4, 16), params)
    llm = LLM(looping, dtype="float32", page_size=4, **SPEC)
    spec = llm.generate(prompts(4, 16), params)
    stats = llm.engine.speculation
    print(f"speculation: {stats}, {(stats.kept + stats.steps) / stats.steps:.2f} tokens a step")
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    if params.logprobs:  # a verify step's rows give each kept token's own, as a decode would (to rounding)
        for s, p in zip(spec, plain):
            assert s.logprobs is not None and p.logprobs is not None and len(s.logprobs) == len(s.token_ids)
            assert [sorted(a) for a in s.logprobs] == [sorted(b) for b in p.logprobs]
            assert [list(a.values()) for a in s.logprobs] == [pytest.approx(list(b.values()), abs=1e-4) for b in p.logprobs]
    assert stats.kept > 0
    if params.temperature == 0:  # the loops a greedy run falls into: more than one token a verify step
        assert (stats.kept + stats.steps) / stats.steps > 1.2


def test_drafting_requests_take_no_prefill_budget(looping):
    """A step's prefill budget of 4 tokens, four drafting requests: drafts are not charged to it (they would
    drive it below zero), and each request is fed its last token and draft every step it can."""
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    plain = LLM(looping, dtype="float32", page_size=4, max_prefill_tokens=4).generate(prompts(4, 16), params)
    llm = LLM(looping, dtype="float32", page_size=4, max_prefill_tokens=4, **{**SPEC, "speculative_num_draft_tokens": 8})
    assert [o.token_ids for o in llm.generate(prompts(4, 16), params)] == [o.token_ids for o in plain]
    assert llm.engine.speculation.kept > 0


def test_deterministic_inference_speculates_to_the_same_tokens(looping):
    """Under --enable-deterministic-inference a verify row's logits are bit for bit a decode's (batch-invariant
    kernels), so seeded sampling speculates to exactly the deterministic plain output, log-probabilities too."""
    params = SamplingParams(max_tokens=80, temperature=0.8, seed=21, ignore_eos=True, logprobs=1)
    plain = LLM(looping, page_size=4, deterministic=True).generate(prompts(3, 16), params)
    llm = LLM(looping, page_size=4, deterministic=True, **SPEC)
    spec = llm.generate(prompts(3, 16), params)
    assert [(o.token_ids, o.logprobs) for o in spec] == [(o.token_ids, o.logprobs) for o in plain]
    assert llm.engine.speculation.kept > 0


def test_speculation_stops_where_plain_decoding_stops(looping):
    """A stop token or the length limit inside a kept draft ends the request there, as plain decoding would."""
    greedy = SamplingParams(max_tokens=90, temperature=0, ignore_eos=True)
    plain_run = LLM(looping, dtype="float32", page_size=4).generate(prompts(3, 16), greedy)
    stop = [o.token_ids[40] for o in plain_run]  # a token each output draws by then
    params = [SamplingParams(max_tokens=90, temperature=0, stop_token_ids=[t], ignore_eos=True) for t in stop]
    plain = LLM(looping, dtype="float32", page_size=4).generate(prompts(3, 16), params)
    spec = LLM(looping, dtype="float32", page_size=4, **SPEC).generate(prompts(3, 16), params)
    assert [(o.token_ids, o.finish_reason) for o in spec] == [(o.token_ids, o.finish_reason) for o in plain]
    assert all(o.finish_reason == "stop" for o in spec)
    short = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in LLM(looping, dtype="float32", page_size=4, **SPEC).generate(prompts(3, 16), short)] == [
        o.token_ids for o in LLM(looping, dtype="float32", page_size=4).generate(prompts(3, 16), short)
    ]


def test_speculation_stops_above_its_batch_size_and_resumes_below_it(looping):
    """--speculative-disable-by-batch-size 2: four requests decode plainly (with the overlap) until two have
    ended, then the other two draft again; the tokens stay plain decoding's throughout."""
    lengths = (20, 30, 100, 100)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    plain = LLM(looping, dtype="float32", page_size=4).generate(prompts(4, 16), params)
    never = LLM(looping, dtype="float32", page_size=4, **SPEC, speculative_disable_by_batch_size=0)
    assert [o.token_ids for o in never.generate(prompts(4, 16), params)] == [o.token_ids for o in plain]
    assert never.engine.speculation.steps == 0
    llm = LLM(looping, dtype="float32", page_size=4, **SPEC, speculative_disable_by_batch_size=2)
    assert [o.token_ids for o in llm.generate(prompts(4, 16), params)] == [o.token_ids for o in plain]
    stats = llm.engine.speculation
    assert stats.steps > 0 and stats.kept > 0
    assert stats.steps + stats.kept <= 2 * (100 - 30)  # only the two long requests, after the others ended


PENALIZED = SamplingParams(max_tokens=40, temperature=0, presence_penalty=0.5, ignore_eos=True)


@pytest.mark.parametrize(
    "params", [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), SEEDED, PENALIZED], ids=["greedy", "seeded", "penalized"]
)
def test_a_draft_model_that_is_the_target_keeps_every_draft_token(tiny_model, params):
    """STANDALONE with the target's own weights: its draws are the target's (same logits, same seeded noise),
    so every verify step keeps the whole draft and gives draft + 1 tokens, and the output is plain decoding's.
    The draft stays on the device for the verify step, except under penalties, which read it on the host."""
    model, prompts = tiny_model("llama"), [[random.Random(n).randrange(3, 500) for _ in range(n)] for n in (20, 33, 7)]
    plain = LLM(model, dtype="float32", page_size=4).generate(prompts, params)
    llm = LLM(model, dtype="float32", page_size=4, **STANDALONE, speculative_draft_model_path=str(model))
    spec = llm.generate(prompts, params)
    stats = llm.engine.speculation
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert stats.steps > 0 and stats.kept == stats.drafted
    weights, page = llm.engine.draft_cost()  # what a CUDA pool's sizing sets aside for the draft model
    assert page == llm.engine.pool.bytes_per_page(2, 4, 2, 16, torch.float32) and weights > 512 * 64 * 2 * 4
    assert stats.gave.count(5) >= len(stats.gave) - len(prompts)  # all but each request's last step, cut by max_tokens


def test_another_draft_model_changes_no_token(tiny_model, tmp_path):
    """A draft model of other random weights drafts badly; the verification keeps the output plain decoding's."""
    from tests.tiny_models import build

    model = tiny_model("llama")
    draft = build("llama", tmp_path, num_hidden_layers=1, hidden_size=32, intermediate_size=64)
    prompts = [[random.Random(n).randrange(3, 500) for _ in range(n)] for n in (20, 9)]
    for params in (SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), SEEDED):
        plain = LLM(model, dtype="float32", page_size=4).generate(prompts, params)
        spec = LLM(model, dtype="float32", page_size=4, **STANDALONE, speculative_draft_model_path=str(draft)).generate(prompts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_a_catch_up_queued_behind_its_verify_drafts_what_one_after_it_would(tiny_model, tmp_path, monkeypatch):
    """The draft model's catch-up is queued behind each verify before the host reads it, over every verify row,
    and a branch from each row decodes the rest of the next draft. With a draft that keeps some tokens and not
    others (the target's first layer; the target's second scaled down), deterministic inference gives the
    drafts, kept counts and tokens of a catch-up and decodes launched after the read, and most drafts launch
    neither."""
    from safetensors.torch import load_file, save_file

    from runtime.engine.engine import DraftModel

    model = tiny_model("llama")
    target, draft = tmp_path / "target", tmp_path / "draft"
    for folder, layers in ((target, 2), (draft, 1)):
        shutil.copytree(model, folder)
        weights = next(folder.glob("*.safetensors"))
        scaled = lambda name: 0.1 if ".layers.1." in name and name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0  # noqa: E731
        kept = {name: t * scaled(name) for name, t in load_file(weights).items() if layers > 1 or ".layers.1." not in name}
        save_file(kept, weights, metadata={"format": "pt"})
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    prompts = [[random.Random(n).randrange(3, 500) for _ in range(n)] for n in (20, 9, 31)]
    options = dict(dtype="float32", page_size=4, deterministic=True, **STANDALONE, speculative_draft_model_path=str(draft))

    def run(params: SamplingParams, follow: bool) -> tuple[list[list[int]], int, int, int, int, int]:
        launched = []  # the draft steps a draft launched: (over chunks, over decodes)
        with monkeypatch.context() as patch:
            launch = DraftModel._launch
            patch.setattr(
                DraftModel,
                "_launch",
                lambda self, plan, *rest: (launched.append((bool(plan.chunks), bool(plan.decodes))), launch(self, plan, *rest))[1],
            )
            if not follow:
                patch.setattr(DraftModel, "follow", lambda self, step, verify: None)
            llm = LLM(target, **options)
            tokens = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.speculation
        return tokens, stats.steps, stats.drafted, stats.kept, *map(sum, zip(*launched))

    for params in (SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), SEEDED):
        (*followed, catch_ups, decodes), (*after, catch_ups_after, decodes_after) = run(params, True), run(params, False)
        assert followed == after and 0 < after[3] < after[2], (followed, after)
        assert catch_ups < catch_ups_after / 2 and decodes < decodes_after / 2, (catch_ups, catch_ups_after, decodes, decodes_after)


def test_a_grammar_masks_every_draft_row_and_the_output_stays_plain(tiny_smol):
    """Guided requests draft too: the grammar takes the draft a token a row to mask each verify row, then gives
    it back. Regex and JSON schema, greedy and seeded, beside an unguided request: plain decoding's tokens."""
    items = {"type": "array", "minItems": 6, "maxItems": 6, "items": {"enum": ["alpha beta", "gamma delta"]}}
    schema = json.dumps({"type": "object", "properties": {"items": items}, "required": ["items"]})
    params = [
        SamplingParams(max_tokens=80, temperature=0, guide=("regex", "(the cat sat on the mat\\. ){4}")),
        SamplingParams(max_tokens=80, temperature=0.9, seed=3, guide=("json_schema", schema)),
        SamplingParams(max_tokens=40, temperature=0),
    ]
    prompts = ["Say it:", "List:", "Free text"]
    plain = LLM(tiny_smol, dtype="float32").generate(prompts, params)
    llm = LLM(tiny_smol, dtype="float32", speculative_algorithm="NGRAM")
    spec = llm.generate(prompts, params)
    assert [(o.token_ids, o.finish_reason) for o in spec] == [(o.token_ids, o.finish_reason) for o in plain]
    assert spec[0].text.startswith("the cat sat on the mat. the cat") and spec[1].text.lstrip().startswith("{")
    assert llm.engine.speculation.kept > 0


TEXT = "The quick brown fox jumps over the lazy dog near the river bank, while the sun sets slowly behind the hills. " * 3
REPEAT = [{"role": "user", "content": "Repeat this text exactly, word for word:\n\n" + TEXT}]


@pytest.mark.slow
def test_a_server_speculates_through_the_pipeline_and_answers_as_a_plain_one(smollm2, smol_server, tmp_path):
    """SmolLM2 asked to repeat a text, behind the real pipeline: the same answers as the plain session server
    (greedy, streamed with log-probabilities, and n=2 seeded), several tokens a verify step, in /metrics."""
    import openai
    import requests

    from tests.conftest import launch

    server = launch(smollm2, tmp_path / "serve.log", "--speculative-algorithm", "NGRAM", model=smol_server.model)
    try:
        spec, plain = (openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", max_retries=0) for s in (server, smol_server))
        ask = dict(model=smol_server.model, messages=REPEAT, max_tokens=40, temperature=0)
        answers = [client.chat.completions.create(**ask).choices[0].message.content for client in (spec, plain)]  # pyright: ignore[reportCallIssue, reportArgumentType]
        assert answers[0] == answers[1] and answers[0] and "quick brown fox" in answers[0]
        streams = []
        for client in (spec, plain):
            chunks = list(client.chat.completions.create(**ask, stream=True, logprobs=True, top_logprobs=2))  # pyright: ignore[reportCallIssue, reportArgumentType]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
            streams.append((text, [e.token for block in logprobs for e in block.content or []]))
        assert streams[0] == streams[1] and streams[0][0] == answers[0]
        seeded = dict(model=smol_server.model, prompt=TEXT, max_tokens=20, temperature=0.8, seed=9, n=2)
        texts = [[c.text for c in client.completions.create(**seeded).choices] for client in (spec, plain)]  # pyright: ignore[reportCallIssue, reportArgumentType]
        assert texts[0] == texts[1]
        metrics = requests.get(f"{server.base_url}/metrics", timeout=10).text
        count = float(re.search(r"ringllm:spec_accept_length_count\{[^}]*\} (\S+)", metrics).group(1))  # pyright: ignore[reportOptionalMemberAccess]
        total = float(re.search(r"ringllm:spec_accept_length_sum\{[^}]*\} (\S+)", metrics).group(1))  # pyright: ignore[reportOptionalMemberAccess]
        print(f"verify steps {count:.0f}, {total / count:.2f} tokens a step")
        assert count > 0 and total / count > 1.5
    finally:
        server.stop()


@pytest.mark.slow
def test_a_server_drafts_with_a_draft_model_in_its_engine(tiny_smol, tmp_path):
    """STANDALONE behind the real pipeline (the draft model runs inside the engine actor): the tokens of
    plain decoding offline, and whole drafts kept (the draft is the target)."""
    import openai
    import requests

    from tests.conftest import launch

    prompt = "Once upon a time there was a lighthouse keeper who"
    expected = LLM(tiny_smol, dtype="float32").generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    flags = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(tiny_smol))
    server = launch(tiny_smol, tmp_path / "serve.log", *flags)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(
            model=server.model, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}
        )
        assert reply.choices[0].token_ids == expected.token_ids  # pyright: ignore[reportAttributeAccessIssue]
        metrics = requests.get(f"{server.base_url}/metrics", timeout=10).text
        count = float(re.search(r"ringllm:spec_accept_length_count\{[^}]*\} (\S+)", metrics).group(1))  # pyright: ignore[reportOptionalMemberAccess]
        total = float(re.search(r"ringllm:spec_accept_length_sum\{[^}]*\} (\S+)", metrics).group(1))  # pyright: ignore[reportOptionalMemberAccess]
        assert count > 0 and total / count > 4
    finally:
        server.stop()


@pytest.mark.slow
def test_two_ranks_speculate_as_one(looping):
    """A tensor-parallel follower reads its steps late; a verify step's kept length must reach it before its
    next plan does, or its ranks would attend over other lengths than rank 0's."""
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    plain = LLM(looping, dtype="float32", page_size=4, tensor_parallel_size=2)
    try:
        expected = [o.token_ids for o in plain.generate(prompts(3, 16), params)]
    finally:
        plain.close()
    spec = LLM(looping, dtype="float32", page_size=4, tensor_parallel_size=2, **SPEC)
    try:
        assert [o.token_ids for o in spec.generate(prompts(3, 16), params)] == expected
        assert spec.engine.speculation.kept > 0
    finally:
        spec.close()


def test_a_lookup_that_finds_nothing_lets_the_request_decode_with_steps_in_flight(tiny_model):
    """NGRAM over output that rarely repeats: after a lookup finds nothing, the request decodes as plain requests
    do, with later steps planned before earlier ones answer, and looks again after a few; its tokens are plain
    decoding's."""
    from runtime.scheduler.scheduler import PLAIN_DECODES_AFTER_A_MISS

    model = tiny_model("llama")
    prompts = [[random.Random(n).randrange(3, 500) for _ in range(n)] for n in (20, 9)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    plain = LLM(model, dtype="float32", page_size=4).generate(prompts, params)
    llm = LLM(model, dtype="float32", page_size=4, **SPEC)
    plans, launch = [], llm.engine.launch

    def watched(plan):
        plans.append(plan)
        return launch(plan)

    llm.engine.launch = watched  # pyright: ignore[reportAttributeAccessIssue]
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    decodes = sum(len(p.decodes) for p in plans)
    misses = sum(1 for p in plans for c in p.chunks if len(c.token_ids) == 1 and not c.drafts)  # the prompts are longer
    assert misses > 0 and decodes >= PLAIN_DECODES_AFTER_A_MISS * (misses - len(prompts))  # each one's last: cut by max_tokens


def test_the_benchmark_sets_the_acceptance_by_the_scale_of_the_later_layers(tiny_smol, tmp_path):
    """benchmarks.speculative --residual-scales: at 0 the target is its first layer, so a draft model of that layer
    keeps every draft token; at 1 it drafts as it may. At each scale, both arms give the same tokens."""
    from safetensors.torch import load_file, save_file

    from benchmarks import speculative

    def copy(folder: Path, layers: int) -> Path:  # the task's prompt is longer than the tiny model's context
        folder.mkdir()
        for source in tiny_smol.iterdir():
            if source.name == "config.json":
                config = json.loads(source.read_text())
                (folder / source.name).write_text(json.dumps({**config, "num_hidden_layers": layers, "max_position_embeddings": 2048}))
            elif source.suffix == ".safetensors":
                save_file(
                    {name: t for name, t in load_file(source).items() if ".layers.1." not in name or layers > 1}, folder / source.name
                )
            elif source.is_file():
                shutil.copy(source, folder / source.name)
        return folder

    target, draft = copy(tmp_path / "target", 2), copy(tmp_path / "draft", 1)
    flags = f"--speculative-algorithm STANDALONE --speculative-draft-model-path {draft} --speculative-num-draft-tokens 3"
    argv = ["--model", str(target), "--max-tokens", "25", "--rounds", "1", "--tasks", "repeat", "--ignore-eos", "--dtype", "float32"]
    record = speculative.main([*argv, "--residual-scales", "1,0", "--agree-layers", "1", "--arm", f"L1={flags}"])
    results = record["results"]
    assert results["L1"]["repeat@0"]["1"]["tokens_per_verify_step"] == 4.0  # 24 tokens after the first, 4 a step
    assert results["L1"]["repeat@1"]["1"]["tokens_per_verify_step"] < 4.0
    assert all(cell["same_tokens"] for cases in results.values() for cells in cases.values() for cell in cells.values())
