"""The window pool (runtime.scheduler.window_pages): a sliding-window layer keeps a request's window and a page,
not its whole sequence, in a pool far smaller than the sequences, with the same tokens and log-probabilities as
transformers; idle window pages serve prefix-cache hits until the pool takes them back."""

from __future__ import annotations

import random

import pytest

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.scheduler.scheduler import Request, Scheduler
from runtime.scheduler.window_pages import WindowPages
from runtime.step import Sampled
from tests.test_parity import CHUNK_BUDGET, LOGPROB_TOLERANCE, NEW_TOKENS, divergence, greedy_matches, prompts_for, reference

WINDOW = 16  # tests.tiny_models' gemma3


def held(request: Request) -> int:
    return len(request.pages) - request.window_from


@pytest.mark.parametrize(("page_size", "steps_in_flight"), [(4, 1), (1, 2)])
def test_window_layers_hold_a_window_and_a_page_and_match_transformers(tiny_model, page_size, steps_in_flight):
    """Eight prompts of up to 90 tokens, 48 tokens each after them, in a window pool of a fifth of the tokens they
    reach: each decoding request holds the window pages of its last 16 positions (and of the steps in flight),
    never more; the tokens and log-probabilities are transformers', then again from the prefix cache."""
    model = tiny_model("gemma3")
    llm = LLM(
        model,
        dtype="float32",
        page_size=page_size,
        max_prefill_tokens=CHUNK_BUDGET,
        num_pages=2048 // page_size,
        swa_full_tokens_ratio=0.06,
        steps_in_flight=steps_in_flight,
    )
    scheduler = llm.scheduler
    windows = scheduler.windows
    assert windows is not None and windows.allocator.num_pages * page_size < 0.2 * sum(len(p) + NEW_TOKENS for p in prompts_for(model))
    most = -(-WINDOW // page_size) + 1  # a window and a page
    schedule, seen = scheduler.schedule, []

    def checked():
        plan = schedule()
        for request in scheduler.running:
            assert all(page in windows.holders for page in request.pages[request.window_from :])
            if request.decoding and request.output_ids:
                earlier = request.computed - request.confirmed - 1  # tokens of earlier steps not answered yet
                assert held(request) <= most + -(-earlier // page_size), (request.rid, held(request), request.confirmed)
                seen.append(held(request))
        assert windows.num_held <= sum(held(r) for r in scheduler.running)
        return plan

    scheduler.schedule = checked
    prompts = [list(p) for p in prompts_for(model)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    for attempt in range(2):
        for output, (theirs, logprobs) in zip(llm.generate(prompts, params), reference(model)):
            for position, top in enumerate(output.logprobs[: divergence(output.token_ids, theirs) + 1]):
                for token, logprob in top.items():
                    assert abs(logprob - logprobs[position, token].item()) < LOGPROB_TOLERANCE, (attempt, position, token)
            greedy_matches(output.token_ids, theirs, logprobs)
    assert max(seen) == most or steps_in_flight > 1  # the bound is reached, not loose
    llm.flush_cache()
    assert windows.allocator.num_free == windows.allocator.num_pages and not windows.of


def test_an_idle_window_page_is_taken_back_and_the_match_stops_before_it():
    """Pages whose window page the pool took back are tombstones: a cached prefix is used up to the last page
    whose window before it is whole; a finished request's twin pages hand their window pages to the tree's."""
    pages = WindowPages(num_pages=6, window=8, page_size=4)
    assert pages.assign([10, 11, 12, 13]) and pages.num_held == 4
    pages.release([10, 11, 12, 13])
    assert pages.num_held == 0 and pages.num_free == 6
    assert pages.usable([10, 11, 12, 13]) == 4
    assert pages.assign([20, 21, 22])  # two free, one taken back from the longest idle: page 10's
    assert 10 not in pages.of and pages.usable([10, 11, 12, 13]) == 4  # a query at 16 sees 9..16: pages 2 and 3
    pages.release([20, 21, 22])
    assert pages.assign([30, 31, 32, 33, 34])  # 11, 12, 13 and two of 20..22 taken back
    assert pages.usable([10, 11, 12, 13]) == 0
    pages.release([30, 31, 32, 33, 34])
    pages.replace([30, 31], [10, 11])  # the tree's 10 and 11 take their twins' window pages
    assert 10 in pages.of and 11 in pages.of and 30 not in pages.of and pages.usable([10, 11, 12, 13]) == 2
    pages.drop([10, 11, 22, 32, 33, 34])
    assert pages.allocator.num_free == pages.allocator.num_pages and not pages.of


def test_the_scheduler_gives_back_what_falls_out_of_the_window():
    """A prompt of 64 tokens in chunks of 8 with a window of 8 and pages of 4: after each chunk the request holds the
    pages its next query sees and the chunk's, and the window pool never holds more than that."""
    config = EngineConfig(page_size=4, max_prefill_tokens=8)
    scheduler = Scheduler(config, num_pages=64, eos_token_ids=(), max_position=256, window=8)
    request = scheduler.add(0, list(range(1, 65)), SamplingParams(max_tokens=1, temperature=0))
    for _ in range(8):
        plan = scheduler.schedule()
        assert len(plan.chunks) == 1 and len(plan.window_pages) == 2  # each chunk's two new pages are paired
        request.confirmed = request.computed  # as if the step had answered
        assert held(request) <= 2 + 3, held(request)  # the chunk's, and those a query at its start sees
    assert scheduler.windows is not None and scheduler.windows.num_held == held(request) <= 5


def test_windows_refuse_the_host_tier(tiny_model):
    with pytest.raises(ValueError, match="sliding windows"):
        LLM(tiny_model("gemma3"), dtype="float32", hierarchical_cache=True)


def drive(scheduler: Scheduler) -> int:
    """Plans until nothing is left, each answered at once with token 5 for every row that samples; returns plans run."""
    plans = 0
    while scheduler.has_work():
        plan = scheduler.schedule()
        plans += 1
        assert plans < 200, "the scheduler makes no progress"
        sampled = [Sampled(chunk.slot, 5, None) for chunk in plan.chunks if chunk.sample] + [
            Sampled(slot, 5, None) for slot in plan.decodes
        ]
        scheduler.update(plan.step, sampled)
    return plans


def test_a_cached_prefix_is_admitted_into_the_smallest_window_pool():
    """The window pool at its least (one prefill's window and chunk): a prompt whose prefix the cache holds, its window
    pages idle there, and a long tail after it is admitted (the window it takes over is part of what its prefill
    holds, not more), and runs to its end."""
    config = EngineConfig(page_size=4, max_prefill_tokens=8, steps_in_flight=1, swa_full_tokens_ratio=0.01)
    scheduler = Scheduler(config, num_pages=64, eos_token_ids=(), max_position=256, window=8)
    assert scheduler.windows is not None and scheduler.windows.allocator.num_pages == config.window_prefill_pages(8)
    prompt = list(range(1, 33))
    scheduler.add(0, prompt, SamplingParams(max_tokens=2, temperature=0))
    drive(scheduler)
    again = scheduler.add(1, prompt + list(range(40, 80)), SamplingParams(max_tokens=2, temperature=0))  # a long new tail
    drive(scheduler)
    assert again.finish_reason == "length" and again.cached_tokens == len(prompt)


def test_a_speculative_draft_fits_the_smallest_window_pool(tiny_model):
    """NGRAM drafts of 16 after chunks of 8, a window of 16, pages of one token: the window pool at its least still
    holds a verify chunk's window and draft, so a lone request is not preempted by its own draft, over and over.
    Its 480 prompt tokens are all different: whatever it draws was in the prompt, followed by 16 more to draft."""
    llm = LLM(
        tiny_model("gemma3"),
        dtype="float32",
        page_size=1,
        num_pages=2048,
        max_prefill_tokens=8,
        steps_in_flight=1,
        swa_full_tokens_ratio=0.01,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=16,
        enable_prefix_cache=False,
    )
    schedule, plans = llm.scheduler.schedule, []

    def counted():
        plans.append(schedule())
        assert len(plans) < 400, f"{llm.scheduler.preemptions} preemptions"
        return plans[-1]

    llm.scheduler.schedule = counted
    prompt = random.Random(0).sample(range(1, 512), 480)
    [output] = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert len(output.token_ids) == 20 and llm.scheduler.preemptions == 0
    assert any(chunk.drafts >= 8 for plan in plans for chunk in plan.chunks)  # the drafts were long


def test_a_prompt_rerun_after_an_engine_death_recomputes_the_window_it_gave_back(tiny_model):
    """A request wanting its prompt's log-probabilities reruns its prompt from position 0 when the engine dies (they
    died with it), but it has given back the window pages of its first chunks, and the pool has taken some back:
    it is recomputed from the queue, and gives the tokens and log-probabilities of a run that never died."""
    from tests.conftest import KeptPool

    llm = LLM(
        tiny_model("gemma3"),
        dtype="float32",
        page_size=1,
        num_pages=1200,
        swa_full_tokens_ratio=0.01,
        max_prefill_tokens=16,
        steps_in_flight=1,
        enable_prefix_cache=False,
    )
    prompt, params = list(range(5, 85)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)
    expected = llm.generate([prompt], params)[0]
    kept = KeptPool(llm)
    request = kept.scheduler.add(0, prompt, params)
    kept.step()
    kept.step()  # chunks 0-15 and 16-31, answered
    plan = kept.scheduler.schedule()  # chunk 32-47: its window pages are taken back from the first ones, given back idle
    assert request.window_from > 0
    kept.engine.launch(plan)  # lost with the engine
    kept.revive()
    kept.scheduler.reopen()
    kept.run()
    assert request.output_ids == expected.token_ids
    assert request.prompt_logprobs is not None and expected.prompt_logprobs is not None
    assert all(abs(ours[0] - theirs[0]) < 1e-4 for ours, theirs in zip(request.prompt_logprobs, expected.prompt_logprobs))
