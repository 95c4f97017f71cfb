"""Speculative decoding (--speculative-algorithm NGRAM): drafts from the sequence's own earlier tokens, verified
in one forward, change no token. Greedy and seeded output equal plain decoding's, since a seeded draw is keyed by
the request's seed and position (runtime.engine.sampling): a draft token is kept exactly when it is the token
plain decoding would have drawn there."""

from __future__ import annotations

import json
import random
import re
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


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), SEEDED], ids=["greedy", "seeded"])
def test_a_draft_model_that_is_the_target_keeps_every_draft_token(tiny_model, params):
    """STANDALONE with the target's own weights: its draws are the target's (same logits, same seeded noise),
    so every verify step keeps the whole draft and gives draft + 1 tokens, and the output is plain decoding's."""
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


@pytest.mark.parametrize(
    "kind, draft_vocab", [("EAGLE", None), ("EAGLE3", 200), ("EAGLE3", None)], ids=["EAGLE", "EAGLE3", "EAGLE3-full-vocab"]
)
def test_eagle_heads_load_from_their_published_layouts_and_change_no_token(tiny_model, tmp_path, kind, draft_vocab):
    """Random EAGLE and EAGLE-3 heads, saved as the published ones are (an EAGLE-3 head over a draft vocabulary with
    its id map, or over the whole one without), draft for the tiny Llama: their weights are the checkpoint's, and
    the output is plain decoding's, greedy and seeded."""
    from safetensors.torch import load_file

    from tests.tiny_models import build_eagle_head

    model = tiny_model("llama")
    head_dir = build_eagle_head(kind, model, tmp_path / kind, draft_vocab=draft_vocab)
    prompts = [[random.Random(n).randrange(3, 500) for _ in range(n)] for n in (20, 33, 7)]
    for params in (SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), SEEDED):
        plain = LLM(model, dtype="float32", page_size=4).generate(prompts, params)
        llm = LLM(model, dtype="float32", page_size=4, speculative_algorithm=kind, speculative_draft_model_path=str(head_dir))
        spec = llm.generate(prompts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        stats = llm.engine.speculation
        assert stats.steps > 0 and stats.drafted > 3 * stats.steps
    drafter = llm.engine.drafter
    assert drafter is not None
    head = drafter.engine.model
    stored = torch.load(head_dir / "pytorch_model.bin") if kind == "EAGLE" else load_file(head_dir / "model.safetensors")
    assert torch.equal(head.fc.weight, stored["fc.weight"])
    assert head.model.embed_tokens is llm.engine.model.model.embed_tokens  # the target's, not a copy
    if kind == "EAGLE3":
        assert torch.equal(head.d2t, stored["d2t"] if draft_vocab else torch.zeros(512, dtype=torch.int64))
        assert llm.engine.model.capture == (1, 1, 2)


def reference_drafts(kind: str, target: Path, head_dir: Path, prompt: list[int], drawn: int, count: int) -> list[int]:
    """The head's greedy drafts after a prefill of `prompt` that drew `drawn`, computed whole in torch from the
    checkpoints and transformers' target (its hidden states as features): rows 0..n-1 read the prompt's next
    token and the target's feature, each row after reads the draft before it and the feature the row before
    handed on."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv

    hf = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    cfg = hf.config
    w = torch.load(head_dir / "pytorch_model.bin") if kind == "EAGLE" else load_file(head_dir / "model.safetensors")
    w = {k.removeprefix("layers.0.").removeprefix("midlayer."): v for k, v in w.items()}
    heads, kv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        features = states[-1][0] if kind == "EAGLE" else torch.cat([states[1][0]] * 3, dim=-1)  # EAGLE3 reads layers 1, 1, 1
        features = features if kind == "EAGLE" else features @ w["fc.weight"].T
        tokens, drafts = [*prompt[1:], drawn], []
        for _ in range(count):
            n = len(tokens)
            emb = hf.get_input_embeddings()(torch.tensor(tokens))
            if kind == "EAGLE":
                x = torch.cat([emb, features], -1) @ w["fc.weight"].T + w["fc.bias"]
                pair, residual = x, x
            else:
                pair, residual = torch.cat([norm(emb, w["input_layernorm.weight"]), norm(features, w["hidden_norm.weight"])], -1), features
            q, k, v = ((pair @ w[f"self_attn.{p}_proj.weight"].T).view(1, n, -1, dim).transpose(1, 2) for p in ("q", "k", "v"))
            cos, sin = LlamaRotaryEmbedding(cfg)(v, torch.arange(n)[None])
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = repeat_kv(k, heads // kv), repeat_kv(v, heads // kv)
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = residual + attended.transpose(1, 2).reshape(n, -1) @ w["self_attn.o_proj.weight"].T
            m = norm(h, w["post_attention_layernorm.weight"])
            gated = torch.nn.functional.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)
            out = h + gated @ w["mlp.down_proj.weight"].T
            if kind == "EAGLE":
                token = int(hf.lm_head(out[-1]).argmax())
            else:
                best = int((norm(out[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
                token = best + int(w["d2t"][best])
            drafts.append(token)
            tokens, features = [*tokens, token], torch.cat([features[:n], out[-1:]])
    return drafts


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_an_eagle_heads_drafts_are_the_heads_own_arithmetic(tiny_model, tmp_path, kind):
    """The drafts of the first verify step equal the head's arithmetic done whole in torch over transformers'
    hidden states: the features reach the rows they belong to, and each draft row reads the one before."""
    from tests.tiny_models import build_eagle_head

    model = tiny_model("llama")
    head_dir = build_eagle_head(kind, model, tmp_path / kind, aux_layers=(0, 0, 0))
    prompt = [random.Random(1).randrange(3, 500) for _ in range(19)]
    llm = LLM(model, dtype="float32", page_size=4, speculative_algorithm=kind, speculative_draft_model_path=str(head_dir))
    drafter = llm.engine.drafter
    assert drafter is not None
    seen = []
    draft = drafter.draft
    drafter.draft = lambda plan, targets: seen.append(draft(plan, targets)) or seen[-1]  # pyright: ignore[reportAttributeAccessIssue]
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    verifies = [chunk.token_ids for plan in seen for chunk in plan.chunks if chunk.drafts]
    assert verifies[0][0] == output.token_ids[0]
    assert verifies[0][1:] == reference_drafts(kind, model, head_dir, prompt, output.token_ids[0], 4)


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_an_eagle_head_catches_up_in_prefill_sized_steps_and_redoes_rows_read_before_their_features(tiny_model, tmp_path, kind):
    """Requests through a pool so small that some are preempted and prefill again, the last chunk of that carrying
    a draft: the head's catch-up steps stay within --max-prefill-tokens, a head row read with a zero feature whose
    target feature came with that step is redone with it at the next draft, and the output is plain decoding's."""
    from runtime.engine.drafts import EagleDraft
    from tests.tiny_models import build_eagle_head

    model = tiny_model("llama")
    head_dir = build_eagle_head(kind, model, tmp_path / kind)
    prompts = [[random.Random(n).randrange(3, 500) for _ in range(n)] for n in (30, 31, 32, 33, 29, 40)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    options = dict(dtype="float32", page_size=4, num_pages=40, max_prefill_tokens=16)
    plain = LLM(model, **options).generate(prompts, params)
    llm = LLM(model, **options, speculative_algorithm=kind, speculative_draft_model_path=str(head_dir))
    drafter = llm.engine.drafter
    assert isinstance(drafter, EagleDraft)
    rows, zeros, features = [], {}, {}  # per head step; slot -> positions read with a zero feature; slot -> positions given
    launch, catch_up, take, mirror = drafter.engine.launch, drafter._catch_up, drafter.take_features, drafter.mirror

    def counting_launch(plan):
        rows.append(sum(len(c.token_ids) for c in plan.chunks))
        return launch(plan)

    def watched_catch_up(slot, target):
        tokens, given = catch_up(slot, target)
        begin = int(drafter.engine.lengths[slot])
        assert given is not None
        blank = {begin + i for i, row in enumerate(given) if not row.any()}
        read = set(range(begin, begin + len(given))) - blank
        came = features.get(slot, set())
        assert not (blank & came), "a row is read with a zero feature after its feature came"
        assert zeros.get(slot, set()) & came <= read, "a row read with a zero feature is not redone once its feature came"
        zeros[slot], features[slot] = blank, set()
        return tokens, given

    def watched_take(plan, step, hidden):
        take(plan, step, hidden)
        for i, chunk in enumerate(plan.chunks):
            first = int(step.positions[int(step.qo_indptr[i])])
            features.setdefault(chunk.slot, set()).update(range(first, first + len(chunk.token_ids)))

    def watched_mirror(plan):
        mirror(plan)
        for slot in [*plan.freed, *(n.slot for n in plan.new_slots)]:  # another request's slot now
            features.pop(slot, None)
            zeros.pop(slot, None)

    drafter.engine.launch, drafter._catch_up, drafter.take_features = counting_launch, watched_catch_up, watched_take  # pyright: ignore[reportAttributeAccessIssue]
    drafter.mirror = watched_mirror  # pyright: ignore[reportAttributeAccessIssue]
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert max(rows) <= 16 and llm.scheduler.preemptions > 0


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
