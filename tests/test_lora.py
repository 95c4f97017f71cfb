"""LoRA adapters against peft: a tiny random base model and two random PEFT adapters (one on every projection, one
rsLoRA on a few), whose greedy tokens and log-probabilities equal those of peft's merged models, in batches that mix
the adapters and the base, at page sizes 1 and 16 with chunked prefill, and from the prefix cache, which keeps each
adapter's prefixes apart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import LLM, SamplingParams
from runtime.models.lora import AdapterError
from runtime.scheduler.disaggregated import Disaggregated
from tests.test_parity import CHUNK_BUDGET, LOGPROB_TOLERANCE, NEW_TOKENS, divergence, greedy_matches, prompts_for, reference

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"all": (8, False, ALL), "some": (4, True, ["q_proj", "v_proj", "down_proj"])}  # rank, rsLoRA, targets


def make_adapter(base: Path, folder: Path, rank: int, rslora: bool, targets: list[str], seed: int) -> Path:
    """A PEFT adapter with random A and B (peft's own init leaves B zero, which would test nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    for name, weight in peft_model.named_parameters():
        if "lora_" in name:
            weight.data.normal_(0, 0.3)
    peft_model.save_pretrained(folder)
    return folder


def merged(base: Path, adapter: Path, folder: Path) -> Path:
    """peft's merged model (W + s·BA) as a checkpoint of its own: transformers' reference for the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    PeftModel.from_pretrained(model, adapter).merge_and_unload().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def lora_models(tiny_model, tmp_path_factory) -> tuple[Path, dict[str, Path], dict[str | None, Path]]:
    """(the base, each adapter's folder, the model each adapter name runs as: the base for None)."""
    base, root = tiny_model("llama"), tmp_path_factory.mktemp("lora")
    adapters = {name: make_adapter(base, root / name, *spec, seed) for seed, (name, spec) in enumerate(ADAPTERS.items())}
    references: dict[str | None, Path] = {name: merged(base, path, root / f"{name}-merged") for name, path in adapters.items()}
    references[None] = base
    return base, adapters, references


def check(outputs, names: list[str | None], references: dict[str | None, Path]) -> None:
    for index, (output, name) in enumerate(zip(outputs, names)):
        ref_ids, ref_logprobs = reference(references[name])[index]
        assert len(output.token_ids) == NEW_TOKENS
        for position, top in enumerate(output.logprobs[: divergence(output.token_ids, ref_ids) + 1]):
            for token, logprob in top.items():
                assert abs(logprob - ref_logprobs[position, token].item()) < LOGPROB_TOLERANCE, (name, position, token)
        greedy_matches(output.token_ids, ref_ids, ref_logprobs)


@pytest.mark.parametrize(("page_size", "mixed_chunk", "per_batch"), [(1, False, 1), (16, True, 8)])
def test_mixed_adapter_batches_equal_peft_merged_models(lora_models, page_size, mixed_chunk, per_batch):
    """Every prompt under each of the base and the two adapters, all in one generate call; the second pass reads
    each prompt back from the prefix cache of its own adapter. One adapter a step (`per_batch` 1) holds too."""
    base, adapters, references = lora_models
    llm = LLM(
        base,
        dtype="float32",
        page_size=page_size,
        max_prefill_tokens=CHUNK_BUDGET,
        mixed_chunk=mixed_chunk,
        lora_paths=tuple(f"{name}={path}" for name, path in adapters.items()),
        max_loras_per_batch=per_batch,
    )
    prompts = [list(p) for p in prompts_for(base)]
    names: list[str | None] = [None, *adapters]
    runs = [(prompt, name) for name in names for prompt in prompts]
    runs = runs[::2] + runs[1::2]  # adapters interleaved in the batch
    for attempt in range(2):
        params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5, lora=name) for _, name in runs]
        outputs = llm.generate([prompt for prompt, _ in runs], params)
        for name in names:
            picked = [(o, prompts.index(p)) for o, (p, n) in zip(outputs, runs) if n == name]
            picked.sort(key=lambda pair: pair[1])
            check([o for o, _ in picked], [name] * len(picked), references)
        if attempt:
            assert all(o.cached_tokens >= len(p) - page_size for o, (p, _) in zip(outputs, runs) if len(p) > page_size)


def test_a_prefix_cached_under_one_adapter_is_not_served_to_another(lora_models):
    base, adapters, references = lora_models
    llm = LLM(base, dtype="float32", page_size=1, lora_paths=tuple(f"{name}={path}" for name, path in adapters.items()))
    prompt = list(prompts_for(base)[6])  # 90 tokens

    def run(name: str | None):
        (output,) = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, lora=name))
        return output

    first = run("all")
    assert first.cached_tokens == 0
    for name in ("some", None):
        output = run(name)
        assert output.cached_tokens == 0, name
        assert output.token_ids == reference(references[name])[6][0]
    assert run("all").cached_tokens == len(prompt) - 1
    assert run("all").token_ids == first.token_ids


def test_adapters_split_across_tensor_parallel_ranks_as_their_projections(lora_models):
    """--tp 2: B split by rows under q/k/v and gate/up, A by columns under o and down; the same tokens as peft's."""
    base, adapters, references = lora_models
    llm = LLM(base, dtype="float32", page_size=16, tensor_parallel_size=2, lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()))
    try:
        prompts = [list(p) for p in prompts_for(base)[:4]]
        names: list[str | None] = ["all", "some", None, "all"]
        params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5, lora=name) for name in names]
        outputs = llm.generate(prompts, params)
        for index, (output, name) in enumerate(zip(outputs, names)):
            ref_ids, ref_logprobs = reference(references[name])[index]
            greedy_matches(output.token_ids, ref_ids, ref_logprobs)
    finally:
        llm.close()


def test_adapters_load_unload_and_reload_in_process(lora_models):
    """LLM's load and unload: a request may name only a loaded adapter; a name loaded again with other weights
    serves those, not KV cached under the old ones."""
    base, adapters, references = lora_models
    llm = LLM(base, dtype="float32", page_size=1, enable_lora=True, max_lora_rank=8)
    prompt = list(prompts_for(base)[3])
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, lora="x")
    with pytest.raises(ValueError, match="no LoRA adapter named x"):
        llm.generate([prompt], greedy)
    llm.load_lora_adapter("x", adapters["all"])
    assert llm.generate([prompt], greedy)[0].token_ids == reference(references["all"])[3][0]
    llm.load_lora_adapter("x", adapters["some"])
    reloaded = llm.generate([prompt], greedy)[0]
    assert reloaded.cached_tokens == 0 and reloaded.token_ids == reference(references["some"])[3][0]
    llm.unload_lora_adapter("x")
    with pytest.raises(ValueError, match="no LoRA adapter named x"):
        llm.generate([prompt], greedy)
    with pytest.raises(AdapterError, match="no adapter named x"):
        llm.unload_lora_adapter("x")


def test_adapters_the_engine_cannot_serve_are_refused_with_why(lora_models, tmp_path):
    base, adapters, _ = lora_models
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=4, max_loaded_loras=1)
    with pytest.raises(AdapterError, match="rank 8; this server serves ranks up to 4"):
        llm.load_lora_adapter("big", adapters["all"])
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters["some"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        llm.load_lora_adapter("dora", dora)
    with pytest.raises(AdapterError, match="not a PEFT LoRA adapter folder"):
        llm.load_lora_adapter("none", tmp_path)
    foreign = tmp_path / "foreign"  # trained on a base of other widths
    foreign.mkdir()
    (foreign / "adapter_config.json").write_text((adapters["some"] / "adapter_config.json").read_text())
    weights = load_file(adapters["some"] / "adapter_model.safetensors")
    save_file({key: torch.cat([tensor, tensor], dim=1) if ".lora_A." in key else tensor for key, tensor in weights.items()},
              foreign / "adapter_model.safetensors")  # fmt: skip
    with pytest.raises(AdapterError, match="an adapter of another base model"):
        llm.load_lora_adapter("foreign", foreign)
    (foreign / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(AdapterError, match="could not be read"):
        llm.load_lora_adapter("foreign", foreign)
    llm.load_lora_adapter("some", adapters["some"])
    with pytest.raises(AdapterError, match="--max-loaded-loras"):
        llm.load_lora_adapter("other", adapters["some"])


def test_a_request_whose_adapter_is_unloaded_while_it_runs_fails_and_the_engine_goes_on(lora_models):
    """An unload that reaches the engine while a request still runs with the adapter (the server refuses it when
    it knows; across replicas it may not): that request ends with why, the others go on."""
    base, adapters, references = lora_models
    llm = LLM(base, dtype="float32", page_size=1, lora_paths=(f"all={adapters['all']}",))
    prompt = list(prompts_for(base)[1])
    scheduler, engine = llm.scheduler, llm.engine
    assert not isinstance(scheduler, Disaggregated)
    lost = scheduler.add(0, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, lora="all"))
    kept = scheduler.add(1, prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    plan = scheduler.schedule()
    scheduler.update(plan.step, engine.launch(plan).result())
    engine.adapters.unload("all")  # pyright: ignore[reportOptionalMemberAccess]  # lora_paths turn LoRA on
    while scheduler.has_work():
        if plan := scheduler.schedule():
            scheduler.update(plan.step, engine.launch(plan).result())
    assert lost.finish_reason == "abort" and lost.error is not None and "unloaded while the request ran" in lost.error
    assert kept.output_ids == reference(references[None])[1][0]


def peft_greedy(model_dir: Path, prompt: list[int], tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False, pad_token_id=0)[0, len(prompt) :].tolist()


@pytest.mark.slow
def test_a_server_serves_its_adapters_by_model_name(tiny_smol, tmp_path):
    """`ringllm serve --lora-paths`: /v1/models lists each adapter with the base as its parent; a request names one as
    its model (vLLM) or in lora_path (SGLang), streamed or not, and gets the tokens of peft's merged model; an unknown
    one is a 404."""
    import openai

    from tests.conftest import launch

    adapters = {name: make_adapter(tiny_smol, tmp_path / name, *spec, seed) for seed, (name, spec) in enumerate(ADAPTERS.items())}
    prompt = list(range(100, 140))
    references = {name: merged(tiny_smol, path, tmp_path / f"{name}-merged") for name, path in adapters.items()}
    paths = [f"--lora-paths={name}={path}" for name, path in adapters.items()]
    server = launch(tiny_smol, tmp_path / "serve.log", *paths, "--max-loras-per-batch", "1")
    try:
        listed = {card["id"]: card for card in server.get("/v1/models")["data"]}
        assert listed["model"]["parent"] is None
        assert {name: (card["parent"], card["root"]) for name, card in listed.items() if name != "model"} == {
            name: ("model", str(path)) for name, path in adapters.items()
        }
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        greedy = {"max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
        for name in adapters:
            expected = peft_greedy(references[name], prompt, 16)
            answer = client.completions.create(model=name, prompt=prompt, **greedy)
            assert answer.model == name and answer.choices[0].model_extra["token_ids"] == expected
            stream = client.completions.create(model=name, prompt=prompt, stream=True, **greedy)
            assert [t for chunk in stream if chunk.choices for t in chunk.choices[0].model_extra.get("token_ids") or []] == expected
            body = {"model": "model", "prompt": prompt, "lora_path": name, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            assert server.call("POST", "/v1/completions", {**body, "return_token_ids": True})["choices"][0]["token_ids"] == expected
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="other", prompt=prompt, max_tokens=2)
        refused = server.call("POST", "/v1/completions", {"prompt": prompt, "lora_path": "other", "max_tokens": 2})
        assert refused["error"]["code"] == "model_not_found" and "no LoRA adapter named 'other'" in refused["error"]["message"]
        assert server.get("/health")["status"] == "ok"
    finally:
        server.stop()


@pytest.mark.slow
def test_adapters_load_and_unload_on_a_running_server_and_outlive_an_engine(tiny_smol, tmp_path):
    """POST /load_lora_adapter (and vLLM's /v1/ spelling) loads on every engine, and a name loaded again serves its
    new weights; a SIGKILLed engine's replacement serves what was loaded at run time; /unload_lora_adapter ends it;
    bad asks are 4xx with why, and the server stays up."""
    import os
    import signal

    import orjson

    from tests.conftest import launch, ringllm, wait_for

    adapters = {name: make_adapter(tiny_smol, tmp_path / name, *spec, seed) for seed, (name, spec) in enumerate(ADAPTERS.items())}
    prompt = list(range(200, 230))
    expected = {name: peft_greedy(merged(tiny_smol, path, tmp_path / f"{name}-merged"), prompt, 12) for name, path in adapters.items()}
    server = launch(tiny_smol, tmp_path / "serve.log", "--enable-lora", "--max-lora-rank", "8")

    def tokens(model: str) -> list[int] | dict:
        body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        answer = server.call("POST", "/v1/completions", body)
        return answer["choices"][0]["token_ids"] if "choices" in answer else answer

    try:
        assert [card["id"] for card in server.get("/v1/models")["data"]] == ["model"]
        loaded = server.call("POST", "/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["all"])})
        assert loaded == {"success": True, "loaded_adapters": {"x": str(adapters["all"])}}
        assert [card["id"] for card in server.get("/v1/models")["data"]] == ["model", "x"]
        assert tokens("x") == expected["all"]
        server.call("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["some"])})
        assert tokens("x") == expected["some"]  # not the prefix cached under the old weights
        rows = orjson.loads(ringllm("status", "--json", "--port", str(server.port)).stdout)
        os.kill(next(row["pid"] for row in rows if row["name"] == "engine"), signal.SIGKILL)
        wait_for(lambda: server.get("/health")["status"] == "ok", 120, "the engine's replacement")
        assert tokens("x") == expected["some"]
        assert server.call("POST", "/unload_lora_adapter", {"lora_name": "x"}) == {"success": True, "loaded_adapters": {}}
        assert tokens("x")["error"]["code"] == "model_not_found"
        refused = server.call("POST", "/v1/unload_lora_adapter", {"lora_name": "x"})
        assert refused["error"]["code"] == "model_not_found"
        bad = server.call("POST", "/load_lora_adapter", {"lora_name": "y", "lora_path": str(tmp_path)})
        assert "not a PEFT LoRA adapter folder" in bad["error"]["message"]
        assert "'lora_path' must be a non-empty string" in server.call("POST", "/load_lora_adapter", {"lora_name": "y"})["error"]["message"]
        assert [card["id"] for card in server.get("/v1/models")["data"]] == ["model"]
        assert server.get("/health")["status"] == "ok"
    finally:
        server.stop()


@pytest.mark.slow
def test_a_tensor_parallel_server_loads_an_adapter_on_every_rank(tiny_smol, tmp_path):
    """--tp 2: the load reaches both ranks, which answer together through rank 0; each serves its shard."""
    adapter = make_adapter(tiny_smol, tmp_path / "all", *ADAPTERS["all"], 0)
    prompt = list(range(300, 320))
    expected = peft_greedy(merged(tiny_smol, adapter, tmp_path / "merged"), prompt, 8)
    from tests.conftest import launch

    server = launch(tiny_smol, tmp_path / "serve.log", "--tp", "2", "--enable-lora", "--max-lora-rank", "8")
    try:
        assert server.call("POST", "/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter)})["success"] is True
        body = {"model": "x", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        assert server.call("POST", "/v1/completions", body)["choices"][0]["token_ids"] == expected
    finally:
        server.stop()
