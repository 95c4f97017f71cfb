"""Prefill-decode disaggregation on CPU: a prefill engine and a decode engine, each with its own KV pool, under one
scheduler give the tokens colocated serving gives, greedy and seeded, in-process (LLM) and through `ringllm serve
--pd` (two engine processes); SIGKILL of either engine mid-stream loses nothing and changes no stream."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from runtime.scheduler.disaggregated import Disaggregated
from tests.conftest import launch, ringllm, with_tokenizer
from tests.test_serving import _stream_text, complete_ids
from tests.test_tensor_parallel import PROMPTS, SPLIT
from tests.tiny_models import build

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_prefill_and_a_decode_engine_give_the_tokens_one_engine_gives(model, params):
    reference = LLM(model, **SPLIT).generate(PROMPTS, params)
    pd = LLM(model, pd=True, **SPLIT)
    decode = pd.engines[1]
    for attempt in range(2):  # the second time the shared prefix comes from the prefill side's prefix cache
        copied = decode.imported_bytes
        outputs = pd.generate(PROMPTS, params)
        assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
        assert decode.imported_bytes > copied  # the decode engine took the prompts' KV from the prefill engine's pool
        assert attempt == 0 or all(o.cached_tokens >= 32 for o in outputs[:3]), [o.cached_tokens for o in outputs]
    pair = pd.scheduler
    assert isinstance(pair, Disaggregated) and pair.prefill.cache is not None
    assert not pair.prefill.handed and pair.prefill.used_pages() == pair.prefill.cache.cached_pages  # only the cache's
    assert pair.decode.used_pages() == 0 and not pair.decode.incoming


def server_metrics(server) -> dict[str, float]:
    """The server's unlabelled Prometheus samples, by name."""
    import urllib.request

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return {
        name: float(value) for name, _, value in (line.partition(" ") for line in lines) if not name.startswith("#") and "{" not in name
    }


@pytest.mark.slow
def test_serve_pd_gives_colocated_tokens_and_survives_either_engines_death(model, smollm2, tmp_path):
    served = with_tokenizer(model, smollm2, tmp_path / "model")
    colocated = LLM(served, **SPLIT)
    server = launch(served, tmp_path / "serve.log", "--pd", "--page-size", "16", "--max-prefill-tokens", "24")
    try:
        names = [row["name"] for row in orjson.loads(ringllm("status", "--json", "--port", str(server.port)).stdout)]
        assert {"prefill", "decode", "keeper0", "keeper1"} <= set(names)
        for params in (GREEDY, SEEDED):
            sampling = {"temperature": params.temperature, "seed": params.seed}
            ours = asyncio.run(complete_ids(server.base_url, server.model, PROMPTS, 16, sampling))
            assert ours == [o.token_ids for o in colocated.generate(PROMPTS, params)]
        metrics = server_metrics(server)
        assert metrics["ringllm:pd_transfer_bytes_total"] > 0 and metrics["ringllm:pd_transfer_seconds_count"] == 2 * len(PROMPTS)
        before, _ = asyncio.run(_stream_text(server))
        for victim in ("prefill", "decode"):
            pid = next(
                row["pid"] for row in orjson.loads(ringllm("status", "--json", "--port", str(server.port)).stdout) if row["name"] == victim
            )
            after, pause = asyncio.run(_stream_text(server, pid))
            assert after == before and pause < 20, victim
    finally:
        assert server.stop() < 10


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--pd", "--tp", "2"), "prefill-decode disaggregation runs one rank a side"),
        (("--pd", "--dp", "2"), "prefill-decode disaggregation runs one replica,"),
        (("--pd", "--no-shared-kv-pool"), "prefill-decode disaggregation runs one replica, over kept KV pools"),
        (("--pd", "--device", "cuda"), "need 2 GPUs"),
    ],
)
def test_a_disaggregation_that_cannot_run_is_refused_before_anything_starts(model, flags, message):
    done = ringllm("serve", "--model", str(model), "--port", "1", *flags, check=False, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_a_model_with_sliding_windows_is_refused(tiny_model):
    with pytest.raises(ValueError, match="sliding windows"):
        LLM(tiny_model("mistral_window"), pd=True)


@pytest.mark.slow
def test_a_grammar_holds_across_the_handover(smollm2):
    """A request held to a schema draws its first token under the grammar on the prefill engine and the rest on the
    decode engine, whose grammar goes on from that token: the same JSON as one engine gives."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=3, guide=("json_schema", orjson.dumps(schema).decode()))
    prompts = ["Give JSON:", "Some object please:"]
    reference = LLM(smollm2, dtype="float32").generate(prompts, params)
    outputs = LLM(smollm2, dtype="float32", pd=True).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert all(o.text.startswith("{") for o in outputs)
