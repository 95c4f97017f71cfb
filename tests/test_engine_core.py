"""The engine core in one process: prefix reuse, preemption by recompute, seeded sampling,
stop conditions and page accounting, on a tiny random Llama. In float32, so that runs of
different batch shapes agree token for token on any processor."""

from __future__ import annotations

import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch

from api.errors import ApiError
from runtime import LLM, SamplingParams
from runtime.batch import AttentionMeta
from tests.conftest import KeptPool

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def random_prompts(count: int, lengths: range, seed: int, prefix: list[int] | None = None) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths.start, lengths.stop, (count,), generator=generator).tolist()
    return [(prefix or []) + torch.randint(0, 512, (n,), generator=generator).tolist() for n in sizes]


def all_pages_free(llm: LLM) -> bool:
    llm.flush_cache()
    return llm.scheduler.allocator.num_free == llm.scheduler.allocator.num_pages


def test_shared_prefixes_are_reused_and_change_nothing(tiny_model):
    prompts = random_prompts(8, range(4, 20), seed=3, prefix=random_prompts(1, range(64, 65), seed=4)[0])
    runs = {}
    for enabled in (True, False):
        llm = LLM(tiny_model("llama"), dtype="float32", page_size=16, enable_prefix_cache=enabled)
        first = llm.generate(prompts[:1], GREEDY)  # warms the cache with the shared prefix
        rest = llm.generate(prompts[1:], GREEDY)
        runs[enabled] = [o.token_ids for o in first + rest]
        reused = llm.scheduler.reused_prefix_tokens
        print(f"prefix cache {'on' if enabled else 'off'}: reused prefix tokens {reused}")
        if enabled:
            assert reused >= 7 * 64 and all(o.cached_tokens >= 64 for o in rest)
        else:
            assert reused == 0
        assert all_pages_free(llm)
    assert runs[True] == runs[False]


def test_preemption_recomputes_and_gives_identical_output(tiny_model):
    prompts = random_prompts(8, range(30, 90), seed=5)
    roomy = LLM(tiny_model("llama"), dtype="float32", page_size=16)
    expected = [o.token_ids for o in roomy.generate(prompts, GREEDY)]
    tight = LLM(tiny_model("llama"), dtype="float32", page_size=16, num_pages=12)  # 192 tokens for ~800 needed
    outputs = tight.generate(prompts, GREEDY)
    print(f"preemptions: {tight.scheduler.preemptions}")
    assert tight.scheduler.preemptions > 0
    assert [o.token_ids for o in outputs] == expected
    assert all(o.finish_reason == "length" for o in outputs)
    assert all_pages_free(tight)


@pytest.mark.slow
def test_planning_further_ahead_changes_no_token(tiny_model):
    """CUDA plans two steps ahead of the results and CPU one: every depth must give the same tokens
    through stops mid-flight, penalties, a shared prefix and preemption in a pool that is too small."""
    prompts = random_prompts(10, range(20, 70), seed=11, prefix=list(range(40)))
    params = [
        SamplingParams(max_tokens=20, temperature=0.8, seed=i, stop_token_ids=[i * 37 % 512], repetition_penalty=1.1 if i % 3 == 0 else 1.0)
        for i in range(len(prompts))
    ]
    runs = {}
    for depth in (1, 2, 3):
        llm = LLM(tiny_model("llama"), dtype="float32", page_size=16, num_pages=20, steps_in_flight=depth)
        runs[depth] = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
        assert llm.scheduler.preemptions > 0 and all_pages_free(llm)
    assert runs[1] == runs[2] == runs[3]
    assert {reason for _, reason in runs[1]} == {"stop", "length"}


def test_seeded_request_samples_the_same_alone_and_in_a_batch_of_16(tiny_model):
    llm = LLM(tiny_model("qwen3"), dtype="float32", page_size=16)
    filters = dict(temperature=0.9, top_p=0.9, top_k=50, min_p=0.02)
    penalties = dict(frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.1)
    seeded = SamplingParams(max_tokens=32, seed=1234, ignore_eos=True, **filters, **penalties)
    prompt = random_prompts(1, range(20, 21), seed=6)
    alone = llm.generate(prompt, seeded)[0].token_ids
    others = random_prompts(15, range(5, 60), seed=7)
    batch = others[:7] + prompt + others[7:]
    params = [SamplingParams(max_tokens=32, temperature=1.0, seed=i) for i in range(7)] + [seeded]
    params += [SamplingParams(max_tokens=32, temperature=0.7, top_k=5) for _ in range(8)]
    in_batch = llm.generate(batch, params)[7].token_ids
    assert alone == in_batch
    assert llm.generate(prompt, SamplingParams(**{**seeded.__dict__, "seed": 99}))[0].token_ids != alone
    assert all_pages_free(llm)


def test_stop_conditions(tiny_model):
    llm = LLM(tiny_model("mistral"), dtype="float32", page_size=4)
    prompt = random_prompts(1, range(10, 11), seed=8)
    free_run = llm.generate(prompt, GREEDY)[0].token_ids
    stop_id = free_run[5]
    cut = free_run.index(stop_id) + 1
    stopped = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id]))[0]
    assert stopped.token_ids == free_run[:cut] and stopped.finish_reason == "stop"
    llm.scheduler.eos_token_ids = frozenset({stop_id, 511})  # several EOS ids
    eos = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0))[0]
    assert eos.token_ids == free_run[:cut] and eos.finish_reason == "stop"
    ignored = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert ignored.token_ids == free_run and ignored.finish_reason == "length"
    assert all_pages_free(llm)


def test_logprobs_and_greedy_agree(tiny_model):
    llm = LLM(tiny_model("qwen2"), dtype="float32", page_size=16)
    out = llm.generate(random_prompts(1, range(12, 13), seed=9), SamplingParams(max_tokens=8, temperature=0, logprobs=3))[0]
    for token, top in zip(out.token_ids, out.logprobs):
        assert len(top) == 3 and max(top, key=top.get) == token and all(lp <= 0 for lp in top.values())


@pytest.mark.parametrize("page_size", [1, 16])
def test_prompt_logprobs_over_chunks_equal_transformers_and_skip_the_prefix_cache(tiny_model, page_size):
    from transformers import AutoModelForCausalLM

    folder = tiny_model("llama")
    llm = LLM(folder, dtype="float32", page_size=page_size, max_prefill_tokens=16)  # the prompt takes three chunks
    prompt = random_prompts(1, range(40, 41), seed=4)[0]
    first, again = llm.generate([prompt, prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0], -1)
    assert again.cached_tokens == 0  # the second's prompt was computed anew, not read from the cache
    assert [lp for lp, _, _ in again.prompt_logprobs] == pytest.approx([lp for lp, _, _ in first.prompt_logprobs], abs=1e-5)
    assert len(first.prompt_logprobs) == len(prompt) - 1
    for position, (logprob, rank, top) in enumerate(first.prompt_logprobs, 1):
        row = expected[position - 1]
        assert logprob == pytest.approx(row[prompt[position]].item(), abs=1e-4)
        assert int((row > logprob + 1e-4).sum()) + 1 <= rank <= int((row > logprob - 1e-4).sum()) + 1
        assert [t for t, _ in top] == row.topk(3).indices.tolist()


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_tokens=0),
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_k=-2),
        dict(min_p=1.5),
        dict(presence_penalty=3),
        dict(repetition_penalty=0),
        dict(logprobs=-1),
        dict(prompt_logprobs=-1),
    ],
)
def test_invalid_sampling_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_prompt_longer_than_the_context_is_refused(tiny_model):
    llm = LLM(tiny_model("llama"), dtype="float32", page_size=16)
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1] * 600], GREEDY)


@pytest.mark.parametrize("mixed_chunk", [False, True])
def test_step_policies_chunk_prefill_and_agree(tiny_model, mixed_chunk):
    """Prefill first: no step carries chunks and decodes together. Mixed: some do. Either way the
    prefill is chunked, and the greedy ids are those of one request at a time."""
    prompts = random_prompts(6, range(5, 80), seed=10)
    llm = LLM(tiny_model("llama"), dtype="float32", page_size=16, max_prefill_tokens=16, mixed_chunk=mixed_chunk)
    shapes = []
    launch = llm.engine.launch

    def recording(plan):
        shapes.append((sum(len(c.token_ids) for c in plan.chunks), len(plan.decodes)))
        return launch(plan)

    llm.engine.launch = recording
    together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert any(chunked and decodes for chunked, decodes in shapes) == mixed_chunk, shapes
    prefill_steps = [chunked for chunked, _ in shapes if chunked]
    assert max(prefill_steps) <= 16 and sum(prefill_steps) == sum(map(len, prompts)), shapes  # the budget held
    assert len(prefill_steps) >= sum(map(len, prompts)) / 16 > len(prompts), shapes  # so prompts spanned steps
    llm.engine.launch = launch
    assert together == [llm.generate([p], GREEDY)[0].token_ids for p in prompts]


@pytest.mark.parametrize(("dtype", "tolerance"), [("bfloat16", 0.5), ("float16", 0.1)])  # 8- and 11-bit mantissas
def test_half_precision_tracks_fp32(tiny_model, dtype, tolerance):
    prompts = random_prompts(8, range(5, 40), seed=11)
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)  # top 5: at a half-precision near-tie the top differs
    full = LLM(tiny_model("qwen2"), dtype="float32", page_size=16).generate(prompts, params)
    half = LLM(tiny_model("qwen2"), page_size=16, dtype=dtype)
    assert half.engine.pool.kv[0].dtype == getattr(torch, dtype)
    for a, b in zip(full, half.generate(prompts, params)):
        top = a.token_ids[0]
        assert abs(a.logprobs[0][top] - b.logprobs[0].get(top, -99)) < tolerance


def test_dummy_weights_need_only_a_config(tiny_model, tmp_path):
    (tmp_path / "config.json").write_text((tiny_model("qwen3") / "config.json").read_text())
    llm = LLM(tmp_path, dummy_weights=True, page_size=16)
    out = llm.generate(random_prompts(2, range(5, 9), seed=12), GREEDY)
    assert all(len(o.token_ids) == 24 for o in out)
    with pytest.raises(FileNotFoundError):
        LLM(tmp_path, page_size=16)  # without the flag, weights are required


def test_a_step_never_prefills_more_than_the_budget(tiny_model):
    llm = LLM(tiny_model("llama"), dtype="float32", page_size=16, max_prefill_tokens=100)
    launch, fed = llm.engine.launch, []

    def recording(plan):
        fed.append(sum(len(c.token_ids) for c in plan.chunks))
        return launch(plan)

    llm.engine.launch = recording
    llm.generate(random_prompts(4, range(150, 151), seed=13), SamplingParams(max_tokens=2, temperature=0))
    assert max(fed) == 100  # a chunk that ends its prompt counts against the budget too


def test_a_request_that_outgrows_the_whole_pool_ends_with_length(tiny_model):
    llm = LLM(tiny_model("llama"), dtype="float32", page_size=4, num_pages=4)  # 16 tokens of KV in all
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and 0 < len(out.token_ids) <= 13  # not a preemption loop
    assert llm.scheduler.allocator.num_free + llm.scheduler.cache.cached_pages == 4


def test_filters_apply_in_order_top_k_then_top_p_then_min_p():
    from runtime.engine.sampling import _filtered_log_probs

    def kept(probs: list[float], **params) -> list[int]:
        logits = torch.tensor([probs]).log()
        out = _filtered_log_probs(logits, [SamplingParams(temperature=1.0, **params)])
        return torch.nonzero(out[0] > float("-inf")).flatten().tolist()

    assert kept([0.5, 0.3, 0.2], top_k=2, top_p=0.6) == [0]  # top-p of the renormalised top-2: .625 > .6
    assert kept([0.5, 0.3, 0.2], top_p=0.6) == [0, 1]
    assert kept([0.5, 0.2, 0.15, 0.15], min_p=0.35) == [0, 1]
    assert kept([0.3, 0.25, 0.2, 0.15, 0.1], top_k=3) == [0, 1, 2]


def test_the_gumbel_draw_never_takes_a_token_whose_logit_is_minus_infinity():
    """Seed 3562 at position 7 hashes token 131 to all ones in its top 24 bits: a uniform made of 24
    bits rounds that to 1.0 in fp32, whose noise is +inf, and the masked token would be drawn."""
    from runtime.engine.sampling import SampleRow, gumbel_noise, row_keys, sample

    logits = torch.zeros(1, 4096)
    logits[0, 131] = float("-inf")
    drawn = sample(logits, [SampleRow(SamplingParams(temperature=1.0), 3562, 7, [], [])])
    assert int(drawn.tokens[0]) != 131
    assert torch.isfinite(gumbel_noise(torch.from_numpy(row_keys([3562], [7])), 4096)).all()


def test_any_integer_seed_samples(tiny_model):
    llm = LLM(tiny_model("llama"), dtype="float32", page_size=16)
    for seed in (-1, 2**64 + 5):
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.7, seed=seed))[0].token_ids) == 4


def test_decode_graphs_pad_only_to_a_clearly_faster_graph_at_most_twice_as_large():
    from runtime.engine.cuda_graph import padding_choice

    replay_ms = {1: 1.0, 2: 0.99, 4: 0.98, 8: 0.5, 16: 0.6, 32: 0.9, 48: 1.0, 64: 1.1, 256: 0.2}
    choice = padding_choice(replay_ms)
    assert [choice[n] for n in (1, 2, 4, 8)] == [8, 8, 8, 8]  # small sizes may pad up to 8
    assert choice[16] == 16 and choice[32] == 32  # a larger graph within reach, but not 5% faster
    assert choice[48] == 48 and choice[64] == 64  # 256 timed fastest (a busy GPU's figure): out of reach
    assert choice[256] == 256


@pytest.mark.parametrize("tokens, seqs", [(128, 3), (128, 8), (1024, 4), (3, 3)])
def test_graph_padding_adds_sequences_that_attend_only_to_the_scratch_page(tokens, seqs):
    from runtime.engine.cuda_graph import pad_meta

    page_size, scratch = 16, 99
    real = AttentionMeta(
        np.array([0, 1, 2], np.int32), np.array([0, 3, 4], np.int32), np.array([5, 6, 7, 8], np.int32), np.array([40, 9], np.int32)
    )
    padded = pad_meta(real, tokens, seqs, scratch, page_size)
    assert padded.qo_indptr[-1] == tokens and len(padded.kv_lens) == seqs == len(padded.qo_indptr) - 1
    assert all(a.dtype == np.int32 for a in (padded.qo_indptr, padded.kv_indptr, padded.kv_indices, padded.kv_lens))
    assert padded.kv_indptr[-1] == len(padded.kv_indices)
    assert padded.kv_indices[:4].tolist() == real.kv_indices.tolist() and set(padded.kv_indices[4:].tolist()) == {scratch}
    q_lens, pages = np.diff(padded.qo_indptr)[2:], np.diff(padded.kv_indptr)[2:]
    assert (q_lens >= 1).all() and (padded.kv_lens[2:] == q_lens).all()  # each attends to itself
    assert (pages == -(-q_lens // page_size)).all()


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_prefill_tokens", 0),
        ("page_size", 0),
        ("max_running_requests", -1),
        ("num_pages", 0),
        ("cuda_graph_max_bs", -1),
        ("mem_fraction", 1.5),
        ("steps_in_flight", 0),
    ],
)
def test_sizes_that_could_never_run_are_refused(field, value, tiny_model):
    """A chunk budget of 0 used to hold every prompt forever; now the offline API and `ringllm serve`
    refuse such sizes before anything starts."""
    with pytest.raises(ValueError, match=field):
        LLM(tiny_model("llama"), **{field: value})
    flag = "--" + field.replace("_", "-")
    done = subprocess.run(
        [sys.executable, "-m", "actors.cli", "serve", flag, str(value), "--port", "1"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and f"error: {field}" in done.stderr, done.stderr[-2000:]


def test_a_dropped_llm_is_freed_though_its_start_up_froze_it(tiny_model):
    """LLM moves what its start-up built, itself included, out of the collector's reach: only reference
    counting can free it then, so it must sit in no reference cycle, or dropping it would keep its
    weights and KV pool for the rest of the process."""
    llm = LLM(tiny_model("llama"), dtype="float32", page_size=16)
    llm.generate(random_prompts(3, range(4, 20), seed=8), GREEDY)
    engine, pool = weakref.ref(llm.engine), weakref.ref(llm.engine.pool.kv[0])
    del llm
    assert engine() is None and pool() is None


def test_temperatures_too_small_for_float32_draw_greedily(tiny_model):
    """Logits over 1e-38 overflow float32 to inf, and the draw took the first token id that did. Below vLLM's
    1e-5 a temperature draws greedily."""
    llm = LLM(tiny_model("llama"), dtype="float32", page_size=16)
    prompts = random_prompts(2, range(5, 12), seed=9)
    greedy = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    tiny = SamplingParams(max_tokens=24, temperature=1e-38, ignore_eos=True, seed=3)
    assert [o.token_ids for o in llm.generate(prompts, tiny)] == greedy


def test_a_plan_carries_a_bounded_history_however_many_slots_it_could_open(monkeypatch):
    """Each slot a plan opens carries its whole history to the engine: a step that admitted hundreds
    of long prompts (their prefixes cached) would outgrow the ring to the engine."""
    import runtime.scheduler.scheduler
    from runtime.config import EngineConfig
    from runtime.scheduler.scheduler import Scheduler

    monkeypatch.setattr(runtime.scheduler.scheduler, "MAX_PLAN_HISTORY_TOKENS", 250)
    scheduler = Scheduler(EngineConfig(page_size=16, max_prefill_tokens=8192), num_pages=1024, eos_token_ids=(), max_position=4096)
    for rid, prompt in enumerate(random_prompts(12, range(100, 101), seed=3)):
        scheduler.add(rid, prompt, SamplingParams(max_tokens=2, temperature=0))
    opened = []
    while scheduler.waiting:
        plan = scheduler.schedule()
        opened.append(len(plan.new_slots))
        assert sum(len(n.prompt_ids) + len(n.output_ids) for n in plan.new_slots) <= 250
    assert opened[:6] == [2] * 6 and sum(opened) == 12


def test_a_servers_default_max_tokens_is_capped_by_the_context_not_refused():
    """--override-generation-config's max_tokens is a ceiling on every request (vLLM's rule); one that leaves
    max_tokens out draws within it what its prompt leaves of the context, and never gets a 400 about a field it
    did not send."""
    from api.protocol import Limits, parse
    from runtime.config import EngineConfig
    from runtime.scheduler.scheduler import Scheduler

    config = EngineConfig(page_size=4, max_prefill_tokens=64, override_generation_config={"max_tokens": 40, "temperature": 0.5})
    limits = Limits(100, 1000, 0, sampling_defaults=config.override_generation_config)
    scheduler = Scheduler(config, num_pages=64, eos_token_ids=(), max_position=100)
    for prompt, drawn in [(list(range(10)), 40), (list(range(90)), 10)]:
        for chat in (False, True):
            body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": prompt}
            params = parse(body, chat, "m", limits).params
            assert params.max_tokens is None and params.temperature == 0.5
            assert scheduler.add(len(scheduler.waiting), prompt, params).params.max_tokens == drawn
    asked = parse({"prompt": list(range(90)), "max_tokens": 10}, False, "m", limits)  # the client's own is still checked
    assert asked.params.max_tokens == 10
    assert parse({"prompt": [1], "max_tokens": 60}, False, "m", limits).params.max_tokens == 40  # and held to the ceiling
    with pytest.raises(ApiError, match="maximum context length is 100 tokens"):
        parse({"prompt": list(range(90)), "max_tokens": 11}, False, "m", limits)
    with pytest.raises(ValueError, match="max_tokens are whole numbers"):  # a fractional ceiling is no count of tokens
        EngineConfig(override_generation_config={"max_tokens": 40.5})


def test_float32_on_cuda_runs_torch_attention_or_is_refused():
    """flashinfer has no float32 kernels: float32 on CUDA takes the torch attention backend unless
    flashinfer is asked for by name, which is refused at configuration, before anything loads."""
    from runtime.config import EngineConfig

    assert EngineConfig(device="cuda", dtype="float32").attention_backend == "torch"
    assert EngineConfig(device="cuda", dtype="bfloat16").attention_backend == "flashinfer"
    with pytest.raises(ValueError, match="flashinfer has no float32 kernels"):
        EngineConfig(device="cuda", dtype="fp32", attention_backend="flashinfer")


def test_an_abandoned_eager_step_stops_after_a_layer_and_a_reset_engine_runs_on(tiny_model):
    """Engine.between_layers runs after each layer of an eager step, and True abandons the step there
    (StepAbandoned); reset as a new epoch resets it, the engine then gives the tokens it would have."""
    from runtime.batch import StepAbandoned
    from runtime.scheduler.scheduler import Scheduler

    prompts = random_prompts(4, range(20, 40), seed=7)
    llm = LLM(tiny_model("llama"), dtype="float32", page_size=16)
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    calls: list[int] = []
    llm.engine.between_layers = lambda: calls.append(1) or True
    with pytest.raises(StepAbandoned):
        llm.generate(prompts, GREEDY)
    assert len(calls) == 1 < llm.engine.model_config.num_layers  # cut short after its first layer
    llm.engine.between_layers = lambda: calls.append(1) or False
    llm.engine.reset()
    cfg = llm.engine.model_config
    llm.scheduler = Scheduler(llm.config, llm.engine.num_pages, cfg.eos_token_ids, cfg.max_position, window=cfg.window)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert len(calls) > cfg.num_layers


def test_the_priority_policy_admits_by_priority_and_preempts_the_lowest_first(tiny_model, monkeypatch):
    """With one running slot, a saturated queue is admitted by (priority, arrival); under KV pressure
    the request preempted is the lowest priority one, though older, where fcfs takes the newest. The
    tokens are those of fcfs either way."""
    prompts = random_prompts(5, range(20, 30), seed=11)
    priorities = [3, 1, 2, 1, 0]
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, priority=p) for p in priorities]
    expected = [o.token_ids for o in LLM(tiny_model("llama"), dtype="float32", max_running_requests=1).generate(prompts, params)]
    llm = LLM(tiny_model("llama"), dtype="float32", max_running_requests=1, schedule_policy="priority")
    admitted: list[int] = []
    admit = llm.scheduler._admit
    monkeypatch.setattr(llm.scheduler, "_admit", lambda r, plan: admit(r, plan) and (admitted.append(r.params.priority) or True))
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert admitted == [0, 1, 1, 2, 3]  # all queued before the first step: by priority, ties by arrival

    victims: dict[str, list[int]] = {}
    for policy in ("fcfs", "priority"):  # 2 requests of ~70 tokens in 6 pages of 16: one must give way
        tight = LLM(tiny_model("llama"), dtype="float32", page_size=16, num_pages=6, schedule_policy=policy)
        preempt, seen = tight.scheduler._preempt, victims.setdefault(policy, [])
        monkeypatch.setattr(tight.scheduler, "_preempt", lambda r, plan, p=preempt, seen=seen: seen.append(r.params.priority) or p(r, plan))
        long = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, priority=p) for p in (5, 0)]
        outputs = tight.generate(random_prompts(2, range(30, 31), seed=12), long)
        assert all(len(o.token_ids) == 40 for o in outputs)
    assert victims["fcfs"][0] == 0 and victims["priority"][0] == 5, victims


def test_an_engine_over_the_pool_a_dead_one_left_decodes_on_with_the_same_tokens(tiny_model):
    """Scheduler.reopen: a new Engine over the KV memory of one that died with two steps unanswered gives
    the tokens of an uninterrupted run, and the decoding requests go on as decodes (their last tokens taken
    from the reopened slots), not as recomputed chunks, so that on a GPU the redone steps round as the lost
    ones did."""
    prompts = random_prompts(4, range(20, 40), seed=5)
    llm = LLM(tiny_model("llama"), dtype="float32")
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    kept = KeptPool(llm)
    requests = [kept.scheduler.add(rid, prompt, GREEDY) for rid, prompt in enumerate(prompts)]
    for _ in range(8):
        kept.step()
    for _ in range(2):  # launched, and lost with the engine
        kept.engine.launch(kept.scheduler.schedule())
    kept.revive()
    kept.scheduler.reopen()
    first = kept.scheduler.schedule()
    assert first.resync and sorted(first.decodes) == sorted(r.slot for r in requests) and not first.chunks
    kept.scheduler.update(first.step, kept.engine.launch(first).result())
    kept.run()
    assert [r.output_ids for r in requests] == expected


def test_the_prefix_cache_keeps_no_page_that_a_step_lost_with_its_engine_would_have_written(tiny_model):
    """A request that ends (a stop token) while the step feeding that token is still in flight gives the
    prefix cache only the KV of answered steps: the engine may die before the step runs, and a later
    request sharing the prefix must not read what it never wrote."""
    prompt = list(range(5, 25))
    llm = LLM(tiny_model("llama"), dtype="float32")
    answer = llm.generate([prompt], GREEDY)[0].token_ids
    stop = next(k for k in range(11, len(answer)) if answer[k] not in answer[:k])  # prompt + answer[:stop + 1]: 2 pages
    follow_up = prompt + answer[: stop + 1] + [7, 8, 9]
    expected = llm.generate([follow_up], GREEDY)[0].token_ids
    kept = KeptPool(llm)
    kept.memory.random_(0, 256)  # what a dead epoch left: the pages a lost step should have written keep it
    request = kept.scheduler.add(0, prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[answer[stop]]))
    plan = kept.scheduler.schedule()
    pending = kept.engine.launch(plan)
    while True:
        ahead = kept.scheduler.schedule()  # planned before `plan`'s results, as with steps in flight
        kept.scheduler.update(plan.step, pending.result())
        if request.finish_reason is not None:
            break  # `ahead` feeds the stop token, and is lost with the engine
        plan, pending = ahead, kept.engine.launch(ahead)
    kept.revive()
    kept.scheduler.reopen()
    follow = kept.scheduler.add(1, follow_up, GREEDY)
    kept.run()
    assert follow.output_ids == expected


def test_a_reopened_prefill_gives_every_prompt_logprob(tiny_model):
    """The prompt's log-probabilities of the chunks before an engine's death died with it: a request that
    asked for them and had no first draw runs its prompt again, and all of them come back."""
    llm = LLM(tiny_model("llama"), dtype="float32", max_prefill_tokens=16)
    prompt = list(range(5, 45))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)
    expected = llm.generate([prompt], params)[0]
    kept = KeptPool(llm)
    request = kept.scheduler.add(0, prompt, params)
    kept.step()  # the first chunk, answered
    kept.engine.launch(kept.scheduler.schedule())  # the second, lost
    kept.revive()
    kept.scheduler.reopen()
    kept.run()
    assert len(request.prompt_logprobs) == len(expected.prompt_logprobs) == len(prompt) - 1
    assert request.output_ids == expected.token_ids


def test_after_a_crash_each_fed_request_runs_alone_and_a_repeat_crash_alone_ends_it():
    """The scheduler core's side of a query of death: two steps in flight die with the engine (a crash), so each
    request they fed runs alone for two steps, one after another; a solo step the dead engine never began blames
    nobody; one it began ends its request with the crash's error, and the others run on."""
    from runtime.config import EngineConfig
    from runtime.scheduler.scheduler import CRASHED_TWICE, Scheduler
    from runtime.step import Sampled, StepPlan

    core = Scheduler(EngineConfig(page_size=4, max_prefill_tokens=64), num_pages=64, eos_token_ids=(), max_position=256)
    for rid in range(3):
        core.add(rid, [5 + rid] * 6, SamplingParams(max_tokens=20, temperature=0))

    def answer(plan: StepPlan) -> None:
        core.update(plan.step, [Sampled(slot, 7, None) for slot in [c.slot for c in plan.chunks if c.sample] + plan.decodes])

    def fed(plan: StepPlan) -> set[int]:
        return {core._by_slot[slot].rid for slot in [c.slot for c in plan.chunks] + plan.decodes}

    answer(core.schedule())  # the prefill
    lost = [core.schedule(), core.schedule()]  # two decode steps in flight when the engine crashes
    assert core.after_crash(lost, launched=lost[-1].step) == []
    core.reopen()
    assert core.quarantine == {0: 2, 1: 2, 2: 2}
    alone = []
    while core.quarantine:
        plan = core.schedule()
        alone.append(fed(plan))
        answer(plan)
    assert alone == [{0}, {0}, {1}, {1}, {2}, {2}]
    assert fed(core.schedule()) == {0, 1, 2}  # back in one batch

    lost = [core.schedule()]
    core.after_crash(lost, launched=lost[0].step)
    core.reopen()
    solo = core.schedule()
    assert fed(solo) == {0}
    assert core.after_crash([solo], launched=solo.step - 1) == []  # the engine died before it began the step
    core.reopen()
    assert 0 in core.quarantine
    solo = core.schedule()
    (ended,) = core.after_crash([solo], launched=solo.step)  # it ran alone and the engine died again
    assert ended.rid == 0 and ended.crashed and ended.error == CRASHED_TWICE and ended.finish_reason == "abort"
    core.reopen()
    assert 0 not in core.quarantine and {r.rid for r in core.running} == {1, 2}
