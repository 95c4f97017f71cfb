"""ringllm against a plain transformers streaming server on the same model: the "Nx over HF" figure.

Workload, the same on both sides: streamed chat requests, 4 in flight at once (a closed loop: the
next starts when one ends). For each prompt size, a user message of about 16, 128 or 512 tokens
of seeded random common words in the model's chat template (its default system prompt included),
8 requests, each generating exactly 128 greedy tokens (ignore_eos on ringllm, min_new_tokens on
HF; 128 is a short chat answer, and the per-turn output of the concurrent suite behind
mini-sglang's 2.10x). Every repeat and the warm-up draw fresh words, so ringllm's prefix cache
shares the template only, never a prompt from an earlier round. Tokens are counted, not
estimated: the token ids ringllm streams, and the length of what HF's generate returns; a request
that did not produce exactly max_tokens fails the run. Throughput is generated tokens over the
wall time of a size's requests; a side's figure is all its tokens over the sum of those times,
the median of 3 repeats. Each repeat runs ringllm's round, then HF's on the same prompts.

ringllm: a real `ringllm serve` with its default flags, fed over HTTP by aiohttp. Chat, not
completions: it is what the README's users send, and it makes the server do the templating,
tokenizing and detokenizing that the HF side does too. It idles, its actors asleep, during HF's
rounds. HF: AutoModelForCausalLM + model.generate(streamer=TextIteratorStreamer), one generate
thread per request and a thread consuming its stream, torch's default thread count (what a user
runs). Both use `--dtype` (auto: bfloat16 on CPUs with AMX bf16 tiles, else float32).

    python -m benchmarks.vs_hf [--quick] [--model DIR] [--device cpu] [--dtype auto] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from benchmarks import write_result
from benchmarks.offline import versions
from benchmarks.provenance import provenance
from benchmarks.server import bounded, connector, free_port, sse_events, start_server, stop_server, wait_healthy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer

DEFAULT_OUT = Path(__file__).parent / "results" / "vs-hf-cpu.json"
SIZES = {"short": 16, "medium": 128, "long": 512}  # user-message tokens
CONCURRENCY = 4
WARMUP_TOKENS = 8
WORDS = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history party result"
).split()

Messages = list[dict[str, str]]
OneRequest = Callable[[Messages, int], Awaitable[tuple[int, int]]]  # -> (prompt tokens, generated tokens)


def prompts(tokenizer: Tokenizer, count: int, seed: int) -> dict[str, list[Messages]]:
    """`count` chat prompts per size; the user text is cut at the size in tokens."""
    rng, out = random.Random(seed), {}
    for size, length in SIZES.items():
        texts = [" ".join(rng.choices(WORDS, k=2 * length)) for _ in range(count)]
        # transformers types decode's result as str | list[str]: one sequence's is a str
        out[size] = [[{"role": "user", "content": tokenizer.decode(tokenizer.encode(t)[:length]).strip()}] for t in texts]  # pyright: ignore[reportAttributeAccessIssue]
    return out


async def size_round(one: OneRequest, batch: list[Messages], max_tokens: int) -> tuple[float, int, float]:
    """`batch` at CONCURRENCY (a closed loop); -> (mean prompt tokens, tokens generated, seconds)."""
    started = time.perf_counter()
    counts = await bounded(CONCURRENCY, [partial(one, messages, max_tokens) for messages in batch])
    seconds = time.perf_counter() - started
    if wrong := [n for _, n in counts if n != max_tokens]:
        raise RuntimeError(f"asked {max_tokens} tokens per request, got {wrong}")
    return statistics.mean(p for p, _ in counts), sum(n for _, n in counts), seconds


async def measure(sides: dict[str, OneRequest], tokenizer: Tokenizer, args: argparse.Namespace) -> dict[str, dict]:
    """A warm-up of each side, then `repeats` rounds in which every side runs every size on the
    same fresh prompts, one side after the other: a drift in the machine's speed (seen here at
    +-30% over minutes) then weighs on both sides alike. Per side: per-size and overall tok/s."""
    for one in sides.values():
        for batch in prompts(tokenizer, min(CONCURRENCY, args.requests), seed=-1).values():
            await size_round(one, batch, WARMUP_TOKENS)
    rounds: dict[str, list[dict]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        workload = prompts(tokenizer, args.requests, seed=repeat)
        for name, one in sides.items():
            print(f"repeat {repeat + 1}/{args.repeats}: {name}", flush=True)
            rounds[name].append({size: await size_round(one, batch, args.max_tokens) for size, batch in workload.items()})
    return {name: summary(side_rounds) for name, side_rounds in rounds.items()}


def summary(rounds: list[dict]) -> dict:
    def figure(tokens: int, seconds: float) -> float:
        return round(tokens / seconds, 2)

    per_size = {
        size: {
            "mean_prompt_tokens": statistics.mean(r[size][0] for r in rounds),
            "tok_per_s": statistics.median(figure(*r[size][1:]) for r in rounds),
        }
        for size in SIZES
    }
    totals = [figure(sum(r[s][1] for s in SIZES), sum(r[s][2] for s in SIZES)) for r in rounds]
    return {
        "tok_per_s": statistics.median(totals),
        "repeats_tok_per_s": totals,
        "per_size": per_size,
        "generated_tokens": [sum(r[s][1] for s in SIZES) for r in rounds],
    }


def ringllm_request(http: aiohttp.ClientSession, model: str) -> OneRequest:
    async def one(messages: Messages, max_tokens: int) -> tuple[int, int]:
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        generated, prompt_tokens = 0, 0
        async with http.post("/v1/chat/completions", json=body) as reply:
            if reply.status != 200:
                raise RuntimeError(f"the server answered {reply.status}: {await reply.text()}")
            async for event in sse_events(reply):
                if "error" in event:
                    raise RuntimeError(f"the stream failed: {event['error']}")
                generated += sum(len(c.get("token_ids") or []) for c in event["choices"])
                prompt_tokens = (event.get("usage") or {}).get("prompt_tokens", prompt_tokens)
        return prompt_tokens, generated

    return one


def hf_request(model_dir: Path, tokenizer: Tokenizer, args: argparse.Namespace) -> OneRequest:
    """The naive HF streaming server: a generate thread per request, its streamer read by another."""
    import torch
    from transformers import AutoModelForCausalLM, TextIteratorStreamer

    from runtime.engine.engine import resolve_dtype

    device = torch.device(args.device)
    # the `pyright: ignore`s in this function: transformers' annotations of from_pretrained, apply_chat_template
    # (with return_dict, a BatchEncoding) and generate do not fit what they return and accept
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(args.dtype, device)).to(device).eval()  # pyright: ignore[reportArgumentType]

    def generate(messages: Messages, max_tokens: int) -> tuple[int, int]:
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True).to(device)  # pyright: ignore[reportAttributeAccessIssue]
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        result: dict = {}

        def work() -> None:
            try:
                result["ids"] = model.generate(  # pyright: ignore[reportAttributeAccessIssue]
                    **inputs, streamer=streamer, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
                )
            except BaseException as exc:
                result["error"] = exc
                streamer.end()

        thread = threading.Thread(target=work)
        thread.start()
        for _ in streamer:  # what a server would write to its client, piece by piece
            pass
        thread.join()
        if "error" in result:
            raise result["error"]
        prompt_tokens = inputs["input_ids"].shape[1]
        return prompt_tokens, result["ids"].shape[1] - prompt_tokens

    async def one(messages: Messages, max_tokens: int) -> tuple[int, int]:
        return await asyncio.to_thread(generate, messages, max_tokens)

    return one


async def both_sides(base_url: str, model: str, model_dir: Path, tokenizer: Tokenizer, args: argparse.Namespace) -> dict[str, dict]:
    async with aiohttp.ClientSession(base_url, connector=connector(), timeout=aiohttp.ClientTimeout(total=1800)) as http:
        await wait_healthy(http, 300)
        sides = {"ringllm": ringllm_request(http, model), "hf": hf_request(model_dir, tokenizer, args)}
        return await measure(sides, tokenizer, args)


def run(model_dir: Path, tokenizer: Tokenizer, args: argparse.Namespace) -> dict[str, dict]:
    """Both sides, against --base-url or a server of its own."""
    import torch

    if args.base_url:
        figures = asyncio.run(both_sides(args.base_url, args.served_model, model_dir, tokenizer, args))
    else:
        figures = with_own_server(model_dir, tokenizer, args)
    figures["hf"]["torch_threads"] = torch.get_num_threads()
    return figures


def with_own_server(model_dir: Path, tokenizer: Tokenizer, args: argparse.Namespace) -> dict[str, dict]:
    """A real server for the whole run (idle, its actors sleep while HF works), stopped and its
    segments removed in the finally."""
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="ringllm-vs-hf-")) / "serve.log"
    print(f"ringllm: serving on port {port}, log {log}", flush=True)
    with open(log, "wb") as out:
        server = start_server(
            [
                "--model",
                str(model_dir),
                "--served-model-name",
                "bench",
                "--port",
                str(port),
                "--device",
                args.device,
                "--dtype",
                args.dtype,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        figures = asyncio.run(both_sides(f"http://127.0.0.1:{port}", "bench", model_dir, tokenizer, args))
    finally:
        stop_server(server)
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vs_hf", description=__doc__.splitlines()[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--model", help="a model folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype", default="auto", help="as `ringllm serve --dtype`: auto is bf16 on CUDA and on CPUs with AMX bf16 tiles, else fp32"
    )
    parser.add_argument("--requests", type=int, default=8, help="requests per prompt size")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens generated by every request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 request per size, 16 tokens, 1 repeat (the test's run)")
    parser.add_argument("--base-url", help="measure a server that already serves --model instead of starting one")
    parser.add_argument("--served-model", default="bench", help="with --base-url: the name it serves the model as")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.repeats = 1, 16, 1

    import torch

    from runtime.engine.engine import resolve_dtype
    from runtime.kernels.cpu.build import cpuinfo
    from runtime.models.source import load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir, required=True)
    started = time.monotonic()
    figures = run(model_dir, tokenizer, args)
    ringllm, hf = figures["ringllm"], figures["hf"]
    result = {
        "speedup": round(ringllm["tok_per_s"] / hf["tok_per_s"], 2),
        "ringllm_tok_per_s": ringllm["tok_per_s"],
        "hf_tok_per_s": hf["tok_per_s"],
        "model": model_dir.name,
        "command": " ".join(["python -m benchmarks.vs_hf", *(sys.argv[1:] if argv is None else argv)]),
        **provenance(),
        "device": args.device,
        "dtype": args.dtype,
        "cpu_count": os.cpu_count(),
        # the ratio moves with the processor: 4.99x on a Sapphire Rapids (bf16 on AMX), 2.90x on an AVX2-only EPYC (fp32)
        "cpu_model": cpuinfo("model name"),
        "resolved_dtype": str(resolve_dtype(args.dtype, torch.device(args.device))),
        "workload": {
            "concurrency": CONCURRENCY,
            "user_prompt_tokens": SIZES,
            "requests_per_size": args.requests,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "figure": "median of repeats",
        },
        "ringllm": ringllm,
        "hf": hf,
        "bench_seconds": round(time.monotonic() - started, 1),
        "versions": versions(),
    }
    print(f"{'':8}{'ringllm tok/s':>15}{'HF tok/s':>11}{'ratio':>8}")
    for size in SIZES:
        mine, theirs = ringllm["per_size"][size]["tok_per_s"], hf["per_size"][size]["tok_per_s"]
        print(f"{size:8}{mine:15.1f}{theirs:11.1f}{mine / theirs:8.2f}")
    print(f"{'all':8}{ringllm['tok_per_s']:15.1f}{hf['tok_per_s']:11.1f}{result['speedup']:8.2f}")
    write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
