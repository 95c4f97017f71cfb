"""Tensor parallelism on CPU (gloo): two engine ranks give the tokens one gives, in-process and
through `ringllm serve --tp 2`; a rank's death restarts its whole group and no stream changes; a split
the model or the machine cannot take is refused before anything loads."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.conftest import launch, ringllm, wait_for, with_tokenizer
from tests.test_parity import NEAR_TIE
from tests.test_serving import _stream_text, complete_ids
from tests.tiny_models import build
from transport.segment import list_segments, server_prefix

pytestmark = pytest.mark.slow  # groups of rank processes, and a served group whose rank is killed

# Qwen3 with one KV head (replicated on both ranks); Mistral (Llama's layers) with a vocabulary that
# does not halve (the last shard is padded); Qwen2 with q/k/v biases and tied embeddings; Qwen3-MoE with
# experts split by their intermediate rows, dense layers among the sparse (Mixtral's shard alike); Phi-3's fused
# q/k/v and gate/up, split before sharding
OVERRIDES = {"qwen2": {}, "qwen3": {"num_key_value_heads": 1}, "mistral": {"vocab_size": 509}, "qwen3_moe_mixed": {}, "phi3": {}}
SPLIT = dict(dtype="float32", page_size=16, max_prefill_tokens=24)  # prompts of 40-61 tokens take 2-3 chunks
PREFIX = [(7 * i) % 500 + 3 for i in range(40)]
PROMPTS = [PREFIX + [11, 12], PREFIX + [13], [(5 * i) % 500 + 2 for i in range(61)], [9, 8, 7]]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {arch: build(arch, tmp_path_factory.mktemp(arch), **extra) for arch, extra in OVERRIDES.items()}


def assert_same_greedy(ours: list[int], reference: list[int], reference_logprobs: list[dict[int, float]]) -> None:
    """Equal ids, or ids that part at a true near-tie of the reference (the ranks sum in another order)."""
    at = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), len(reference))
    if at < len(reference):
        best, second = sorted(reference_logprobs[at].values(), reverse=True)[:2]
        assert best - second < NEAR_TIE, f"two ranks part from one at token {at} with no near-tie"


@pytest.mark.parametrize("arch", list(OVERRIDES))
def test_two_ranks_give_the_tokens_one_gives(models, arch):
    one = LLM(models[arch], **SPLIT)
    reference = one.generate(PROMPTS, GREEDY)
    del one
    two = LLM(models[arch], tensor_parallel_size=2, **SPLIT)
    try:
        for attempt in range(2):  # the second time the shared prefix comes from the prefix cache
            outputs = two.generate(PROMPTS, GREEDY)
            for ours, theirs in zip(outputs, reference):
                assert_same_greedy(ours.token_ids, theirs.token_ids, theirs.logprobs)
            assert attempt == 0 or all(o.cached_tokens >= 32 for o in outputs[:3]), [o.cached_tokens for o in outputs]
    finally:
        two.close()


def test_tp_2_serves_the_same_tokens_and_a_dead_rank_restarts_its_group(models, smollm2, tmp_path):
    served = with_tokenizer(models["qwen3"], smollm2, tmp_path / "model")
    reference = LLM(served, **SPLIT).generate(PROMPTS, GREEDY)
    server = launch(served, tmp_path / "serve.log", "--tp", "2", "--page-size", "16", "--max-prefill-tokens", "24")
    try:
        names = [row["name"] for row in orjson.loads(ringllm("status", "--json", "--port", str(server.port)).stdout)]
        assert [n for n in names if n.startswith("engine")] == ["engine0", "engine1"]
        ids = asyncio.run(complete_ids(server.base_url, server.model, PROMPTS, max_tokens=GREEDY.max_tokens))
        for ours, theirs in zip(ids, reference):
            assert_same_greedy(ours, theirs.token_ids, theirs.logprobs)

        before, _ = asyncio.run(_stream_text(server))
        status = orjson.loads(ringllm("status", "--json", "--port", str(server.port)).stdout)
        rank1 = next(row["pid"] for row in status if row["name"] == "engine1")
        after, pause = asyncio.run(_stream_text(server, rank1))
        assert after == before and pause < 20
        wait_for(lambda: server.get("/health")["status"] == "ok", 30, "the group to be back")
        rows = orjson.loads(ringllm("status", "--json", "--port", str(server.port)).stdout)
        assert {row["name"]: row["restarts"] for row in rows if row["name"].startswith("engine")} == {"engine0": 1, "engine1": 1}
    finally:
        assert server.stop() < 5
    assert not list_segments(server_prefix(str(server.port)))  # the rendezvous files too


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--tp", "3"), "4 attention heads do not split over tensor_parallel_size 3"),
        (("--tp", "0"), "tensor_parallel_size must be at least 1"),
        (("--tp", "2", "--device", "cuda"), "need 2 GPUs"),
    ],
)
def test_a_split_that_cannot_run_is_refused_before_anything_loads(models, flags, message):
    done = ringllm("serve", "--model", str(models["mistral"]), "--port", "1", *flags, check=False, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
    if "cuda" not in flags:
        with pytest.raises(ValueError, match=message):
            LLM(models["mistral"], tensor_parallel_size=int(flags[1]))
