"""One flag, one place: every field of EngineConfig, ServeConfig and SupervisorConfig set to a value other
than its default comes back equal through its flags and the real `ringllm serve` parser; `ringllm bench
offline` and `LLM` build the same EngineConfig from the same flags."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from actors.cli import build_parser
from actors.pipeline import ServeConfig
from actors.supervisor import SupervisorConfig
from benchmarks import offline
from runtime import LLM
from runtime.cli_args import CliConfig
from runtime.config import EngineConfig

ENGINE = {
    "page_size": 32,
    "num_pages": 100,
    "mem_fraction": 0.5,
    "cuda_graph_max_bs": 8,
    "cuda_graph_max_prefill_tokens": 64,
    "max_prefill_tokens": 128,
    "mixed_chunk": True,
    "max_running_requests": 7,
    "enable_prefix_cache": False,
    "schedule_policy": "priority",
    "dtype": "bfloat16",
    "device": "cuda:1",
    "dummy_weights": True,
    "attention_backend": "torch",
    "seed": 7,
    "override_generation_config": (("max_tokens", 64), ("temperature", 0.5), ("top_p", 0.9)),
    "steps_in_flight": 1,
    "tensor_parallel_size": 2,
    "custom_all_reduce": True,
    "kv_cache_dtype": "fp8_e4m3",
    "quantization": "fp8",
    "grammar_compile_timeout": 2.5,
    "speculative_algorithm": "NGRAM",
    "speculative_num_draft_tokens": 6,
    "speculative_num_steps": 6,  # SGLang's depth: sets the draft tokens
    "speculative_eagle_topk": 1,
    "speculative_disable_by_batch_size": 3,
    "speculative_ngram_min_match_window_size": 2,
    "speculative_ngram_max_match_window_size": 5,
    "swa_full_tokens_ratio": 0.5,
}
# deterministic inference runs unquantized on one rank; a standby engine needs one rank, warm spares and a kept pool;
# KV tiers: one rank, over the prefix cache
ALONE = {"deterministic": True, "standby_engine": True, "quantization": None, "kv_cache_dtype": "auto", "tensor_parallel_size": 1}
ALONE |= {"enable_prefix_cache": True, "hierarchical_cache": True, "hicache_ratio": 3.0, "hicache_size": 4.0}
ALONE |= {"hicache_write_policy": "write_back", "hicache_storage_backend": "file", "hicache_storage_dir": "/var/kv"}
ALONE |= {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/models/draft"}
# a second node of a group (a shadow runs beside a server of one node)
NODE = {"data_parallel_size": 1, "nnodes": 2, "node_rank": 1, "dist_init_addr": "10.0.0.1:5000", "shadow_engine": None}
# prefill-decode disaggregation: one replica over kept pools, one rank a side, without speculation
PD = {"pd": True, "tensor_parallel_size": 1, "speculative_algorithm": None, "speculative_num_steps": None}
# LoRA adapters, without speculation
LORA = {"speculative_algorithm": None, "speculative_num_steps": None, "quantization": None, "lora_paths": ("a=/a", "/b")}
LORA |= {"max_loras_per_batch": 3, "max_loaded_loras": 4, "max_lora_rank": 32, "lora_target_modules": ("q_proj", "v_proj")}
SERVE = {
    "served_model_name": "served",
    "host": "0.0.0.0",
    "port": 9123,
    "api_workers": 3,
    "max_queued_requests": 5,
    "request_timeout": 12.5,
    "body_timeout": 4.0,
    "header_timeout": 3.5,
    "write_timeout": 7.0,
    "max_stream_backlog": 100,
    "max_connections": 77,
    "max_client_connections": 11,
    "max_request_sequences": 9,
    "client_share": 0.25,
    "allowed_hosts": ("my.example", "*"),
    "cache_salt_by_key": True,
    "watchdog_timeout": 9.0,
    "stats_interval": 2.5,
    "data_parallel_size": 2,
    "dp_policy": "round_robin",
    "api_keys": ("key-one", "key-two"),
    "tool_call_parser": "llama3_json",
    "reasoning_parser": "qwen3",
    "warm_prefixes": ("a system prompt", [1, 2, 3]),
    "warm_spares": False,
    "shared_kv_pool": False,
    "shadow_engine": "--dtype bfloat16 --override-generation-config '{\"temperature\": 0.5}'",
    "shadow_fraction": 0.5,
}


def configs(model_dir: Path) -> list[ServeConfig]:
    """Servers that between them set every field of ServeConfig and EngineConfig to a value not its default."""
    return [
        ServeConfig(model_dir=str(model_dir), **SERVE, engine=EngineConfig(**ENGINE)),
        ServeConfig(
            model_dir=str(model_dir), **{**SERVE, "warm_spares": True, "shared_kv_pool": True}, engine=EngineConfig(**ENGINE | ALONE)
        ),
        ServeConfig(model_dir=str(model_dir), **{**SERVE, **NODE}, engine=EngineConfig(**ENGINE)),
        ServeConfig(
            model_dir=str(model_dir), **{**SERVE, "data_parallel_size": 1, "shared_kv_pool": True}, engine=EngineConfig(**ENGINE | PD)
        ),
        ServeConfig(model_dir=str(model_dir), **SERVE, engine=EngineConfig(**ENGINE | LORA)),
    ]


def serve_args(flags: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def test_every_field_has_a_value_other_than_its_default_in_the_cases(tmp_path):
    """A field added to a config without a case here fails this test: it would go untested by the round trips."""
    servers = configs(tmp_path)
    for cls, instances in ((ServeConfig, servers), (EngineConfig, [s.engine for s in servers])):
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                assert any(getattr(c, f.name) != f.default for c in instances), f"{cls.__name__}.{f.name} is never set"


def test_every_serve_flag_reaches_its_config_through_ringllm_serve(tmp_path, monkeypatch):
    monkeypatch.delenv("RINGLLM_API_KEY", raising=False)
    supervisor = SupervisorConfig(**{f.name: f.default * 2 + 1 for f in dataclasses.fields(SupervisorConfig)})
    for config in configs(tmp_path):
        args = serve_args([*config.to_cli_args(), *supervisor.to_cli_args()])
        assert ServeConfig.from_cli_args(args) == config
        assert SupervisorConfig.from_cli_args(args) == supervisor


def test_serve_adds_the_environments_api_key_and_resolves_the_served_name(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGLLM_API_KEY", "from-env")
    config = ServeConfig.from_cli_args(serve_args(["--model", str(tmp_path), "--api-key", "from-flag"]))
    assert config.api_keys == ("from-flag", "from-env") and config.served_model_name == str(tmp_path)
    assert "from-" not in str(config.record()) and config.record()["api_keys"] == ["<redacted>"] * 2


def test_warm_prefixes_come_from_a_file_or_inline(tmp_path):
    (tmp_path / "prefixes.json").write_text('["a", [4, 5]]')
    for given in (str(tmp_path / "prefixes.json"), '["a", [4, 5]]'):
        assert ServeConfig.from_cli_args(serve_args(["--model", str(tmp_path), "--warm-prefixes", given])).warm_prefixes == ("a", [4, 5])


def test_bench_offline_passes_the_same_configs_to_its_server(tmp_path):
    """bench offline's flags build the EngineConfig `ringllm serve` builds, and the server it starts gets all of it
    (but a standby engine: the benchmark's server runs without warm spares)."""
    for config in configs(tmp_path):
        wanted = dataclasses.replace(config.engine, standby_engine=False)
        flags = wanted.to_cli_args()
        replicas = 1 if wanted.pd else 2  # --pd plans one replica's two engines
        _, engine, serve = offline.parse_args(["--model", str(tmp_path), "--dp", str(replicas), *flags])
        assert engine == wanted == EngineConfig.from_cli_args(serve_args(flags))
        assert serve is not None and ServeConfig.from_cli_args(serve_args(serve.to_cli_args())) == serve
        assert (serve.engine, serve.data_parallel_size, serve.api_workers, serve.warm_spares) == (engine, replicas, 2, False)


def test_llm_runs_the_config_serve_builds(tiny_model):
    flags = ["--dtype=float32", "--page-size=8", "--num-pages=64", "--seed=3", "--enable-mixed-chunk", "--disable-prefix-cache"]
    config = EngineConfig.from_cli_args(serve_args(flags))
    llm = LLM(tiny_model("llama"), config, max_running_requests=5)
    assert llm.config == dataclasses.replace(config, max_running_requests=5)


def test_a_field_without_a_flag_is_refused():
    @dataclass(frozen=True)
    class Unflagged(CliConfig):
        size: int = field(default=1)

    with pytest.raises(TypeError, match="Unflagged.size declares no flag"):
        Unflagged.add_cli_args(argparse.ArgumentParser())


def test_the_cli_reference_names_every_flag_and_no_other():
    """docs/cli.md is generated from the parser (`make docs`); it is stale once a flag is added, renamed or
    dropped. Flags, not the exact text, are compared: argparse lays out help differently across Pythons."""
    from actors import cli_reference

    written = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", cli_reference.PATH.read_text()))
    parsed = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", "".join(map(cli_reference.command_help, cli_reference.COMMANDS))))
    assert written == parsed, f"docs/cli.md is stale (run `make docs`): {sorted(written ^ parsed)}"


def test_sglang_and_vllm_spellings_of_speculation_reach_the_same_fields(tiny_model):
    """SGLang's --speculative-num-steps sets the chain's draft tokens (its --speculative-num-draft-tokens counts the
    last known token too); tree drafts are refused; LLM takes vLLM's speculative_config."""
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    sglang = ["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
    config = EngineConfig.from_cli_args(parser.parse_args([*sglang, "--speculative-num-draft-tokens", "4"]))
    assert config.speculative_num_draft_tokens == 3
    with pytest.raises(ValueError, match="chains"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_eagle_topk=4)
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 6, "disable_by_batch_size": 8}
    llm = LLM(tiny_model("llama"), speculative_config=spec)
    assert (llm.config.speculative_algorithm, llm.config.speculative_num_draft_tokens) == ("NGRAM", 5)
    assert (llm.config.speculative_ngram_min_match_window_size, llm.config.speculative_ngram_max_match_window_size) == (2, 6)
    assert llm.config.speculative_disable_by_batch_size == 8
    with pytest.raises(ValueError, match="no key 'lookahead'"):
        LLM(tiny_model("llama"), speculative_config={"method": "ngram", "lookahead": 3})


def test_every_router_flag_reaches_sglangs_router_by_name():
    """`ringllm router`'s flags round-trip through its parser, and each reaches SGLang's RouterArgs field of its name."""
    pytest.importorskip("sglang_router")
    from actors.router import RouterConfig

    values = {
        "worker_urls": ("http://a:1", "http://b:2"),
        "policy": "power_of_two",
        "host": "0.0.0.0",
        "api_key": "k",
        "log_level": "debug",
        "service_discovery": True,
        "selector": ("app=ringllm", "tier=gpu"),
        "service_discovery_namespace": "ns",
    }
    config = RouterConfig(
        **{f.name: values[f.name] if f.name in values else (f.default or 0) + 7 for f in dataclasses.fields(RouterConfig)}
    )
    assert all(getattr(config, f.name) != f.default for f in dataclasses.fields(RouterConfig))
    assert RouterConfig.from_cli_args(build_parser().parse_args(["router", *config.to_cli_args()])) == config
    args = config.router_args()
    assert args.selector == {"app": "ringllm", "tier": "gpu"}
    for f in dataclasses.fields(RouterConfig):
        value = getattr(config, f.name)
        if f.name != "selector":
            assert getattr(args, f.name) == (list(value) if isinstance(value, tuple) else value), f.name
