"""What serving LoRA adapters costs: the same load against the base model alone and spread over adapters, in one run.

It writes `--adapters` random PEFT adapters of `--rank` on every projection of --model (A and B drawn at 0.02: a
LoRA's cost does not depend on its values), then serves the model three ways, one after the other:
  - "base": `ringllm serve` without LoRA;
  - "lora, base requests": the same with `--lora-paths` of every adapter, requests naming none (what turning
    LoRA on costs by itself);
  - "lora, spread": requests spread over the adapters in turn.
Each runs `--requests` completions of `--prompt-tokens` random ids and `--output-tokens` tokens (ignore_eos), at
most `--concurrency` at once, for output tokens a second, then one request of `--single-tokens` three times (the
median of its tokens a second). The last line printed is one JSON object with each layout's record (with the config its
server reported) and the ratios to "base"; --out writes it to a file too.

    python -m benchmarks.lora --model DIR [--adapters 8 --rank 16 --requests 256 --concurrency 64] [-- SERVER FLAGS]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import aiohttp
import torch
from safetensors.torch import save_file

from benchmarks.provenance import machine, provenance
from benchmarks.server import bounded, connector, emit, free_port, server_config, start_server, stop_server, wait_healthy
from runtime.config import LORA_TARGETS, ModelConfig

SINGLE_REPEATS = 3
BASE = "base"  # the served model's name


def write_adapters(model_dir: str, folder: Path, count: int, rank: int, seed: int) -> list[tuple[str, Path]]:
    """`count` PEFT adapters of `rank` on every projection of the model, as peft saves them."""
    cfg = ModelConfig.load(Path(model_dir))
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {  # projection -> (in, out)
        "q_proj": (cfg.hidden_size, q),
        "k_proj": (cfg.hidden_size, kv),
        "v_proj": (cfg.hidden_size, kv),
        "o_proj": (q, cfg.hidden_size),
        "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }
    generator = torch.Generator().manual_seed(seed)
    adapters = []
    for index in range(count):
        weights = {}
        for layer in range(cfg.num_layers):
            for projection, (inputs, outputs) in shapes.items():
                part = "self_attn" if projection in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{projection}"
                weights[f"{key}.lora_A.weight"] = torch.randn(rank, inputs, generator=generator).mul_(0.02).bfloat16()
                weights[f"{key}.lora_B.weight"] = torch.randn(outputs, rank, generator=generator).mul_(0.02).bfloat16()
        path = folder / f"adapter{index}"
        path.mkdir(parents=True)
        save_file(weights, path / "adapter_model.safetensors")
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_TARGETS), "bias": "none"}
        (path / "adapter_config.json").write_text(json.dumps(config))
        adapters.append((f"adapter{index}", path))
    return adapters


async def _completion(http: aiohttp.ClientSession, model: str, prompt: list[int], tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    async with http.post("/v1/completions", json=body) as reply:
        answer = await reply.json()
    if reply.status != 200:
        raise RuntimeError(f"a completion failed: {answer}")
    return answer["usage"]["completion_tokens"]


async def _load(http: aiohttp.ClientSession, args: argparse.Namespace, models: list[str]) -> dict:
    """The workload at most --concurrency at once, request i naming models[i % len(models)]; then one request."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 20_000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]

    def jobs(count: int) -> list[Callable[[], Awaitable[int]]]:
        return [partial(_completion, http, models[i % len(models)], prompts[i], args.output_tokens) for i in range(count)]

    await bounded(args.concurrency, jobs(min(args.concurrency, args.requests)))  # warm-up
    started = time.monotonic()
    produced = sum(await bounded(args.concurrency, jobs(args.requests)))
    throughput = produced / (time.monotonic() - started)
    singles = []
    for repeat in range(SINGLE_REPEATS):
        started = time.monotonic()
        tokens = await _completion(http, models[repeat % len(models)], prompts[repeat], args.single_tokens)
        singles.append(tokens / (time.monotonic() - started))
    return {"tokens_per_s": round(throughput, 1), "one_request_tokens_per_s": round(statistics.median(singles), 1)}


async def _layout(args: argparse.Namespace, name: str, flags: list[str], models: list[str]) -> dict:
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="ringllm-bench-lora-")) / "serve.log"
    with open(log, "wb") as out:
        flags = ["--model", args.model, "--served-model-name", BASE, "--port", str(port), *flags, *args.server_flags]
        server = start_server(flags, stdout=out, stderr=out)
    try:
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector(), timeout=timeout) as http:
            await wait_healthy(http, 900, server)
            config = await server_config(http)
            figures = await _load(http, args, models)
    finally:
        stop_server(server)
    print(f"{name}: {figures}", flush=True)
    return {"layout": name, **figures, "server_log": str(log), "config": config}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", required=True, help="a model folder with config.json and a tokenizer")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--single-tokens", type=int, default=512, help="tokens of the one request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the record to this file")
    parser.add_argument("server_flags", nargs="*", help="after --: more `ringllm serve` flags (both layouts)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="ringllm-lora-adapters-"))
    adapters = write_adapters(args.model, folder, args.adapters, args.rank, args.seed)
    names = [name for name, _ in adapters]
    paths = [f"--lora-paths={name}={path}" for name, path in adapters]

    async def run() -> list[dict]:
        return [
            await _layout(args, "base", [], [BASE]),
            await _layout(args, "lora, base requests", paths, [BASE]),
            await _layout(args, "lora, spread", paths, names),
        ]

    layouts = asyncio.run(run())
    base = layouts[0]
    for layout in layouts[1:]:
        layout["ratio"] = {key: round(layout[key] / base[key], 3) for key in ("tokens_per_s", "one_request_tokens_per_s")}
    command = "python -m benchmarks.lora " + shlex.join(argv)
    return emit({**provenance(), "machine": machine(), "command": command, "layouts": layouts}, args.out)


if __name__ == "__main__":
    main()
