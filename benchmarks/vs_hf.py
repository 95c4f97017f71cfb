"""ringllm against a plain transformers streaming server on the same model: the "Nx over HF" figure.

Workload, the same on both sides: streamed chat requests, 4 in flight at once (a closed loop: the
next starts when one ends). For each prompt size, a user message of about 16, 128 or 512 tokens
of seeded random common words in the model's chat template (its default system prompt included),
8 requests, each generating exactly 64 greedy tokens (ignore_eos on ringllm, min_new_tokens on
HF). Every repeat and the warm-up draw fresh words, so ringllm's prefix cache shares the template
only, never a prompt from an earlier round. Tokens are counted, not estimated: the token ids
ringllm streams, and the length of what HF's generate returns; a request that did not produce
exactly 64 fails the run. Throughput is generated tokens over the wall time of a size's requests;
a side's figure is all its tokens over the sum of those times, the median of 3 repeats.

ringllm: a real `ringllm serve` with its default flags, fed over HTTP by aiohttp. Chat, not
completions: it is what the README's users send, and it makes the server do the templating,
tokenizing and detokenizing that the HF side does too. The server is stopped before HF loads.
HF: AutoModelForCausalLM + model.generate(streamer=TextIteratorStreamer), one generate thread
per request and a thread consuming its stream, torch's default thread count (what a user runs).

    python -m benchmarks.vs_hf [--quick] [--model DIR] [--device cpu] [--dtype auto] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import orjson

from benchmarks.offline import versions
from benchmarks.server import free_port, start_server, stop_server, wait_healthy

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer

DEFAULT_OUT = Path(__file__).parent / "results" / "vs-hf-cpu.json"
SIZES = {"short": 16, "medium": 128, "long": 512}  # user-message tokens
CONCURRENCY = 4
WARMUP_TOKENS = 8
WORDS = ("time year people way day man thing woman life child world school state family student group country problem "
         "hand part place case week company system program question work government number night point home water room "
         "mother area money story fact month lot right study book eye job word business issue side kind head house "
         "service friend father power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war history party result").split()

Messages = list[dict[str, str]]
OneRequest = Callable[[Messages, int], Awaitable[tuple[int, int]]]  # -> (prompt tokens, generated tokens)


def prompts(tokenizer: Tokenizer, count: int, seed: int) -> dict[str, list[Messages]]:
    """`count` chat prompts per size; the user text is cut at the size in tokens."""
    rng, out = random.Random(seed), {}
    for size, length in SIZES.items():
        texts = [" ".join(rng.choices(WORDS, k=2 * length)) for _ in range(count)]
        out[size] = [[{"role": "user", "content": tokenizer.decode(tokenizer.encode(t)[:length]).strip()}] for t in texts]
    return out


async def measure(one: OneRequest, tokenizer: Tokenizer, args: argparse.Namespace) -> dict:
    """A warm-up, then `repeats` rounds of every size at CONCURRENCY; per-size and overall tok/s."""
    gate = asyncio.Semaphore(CONCURRENCY)

    async def size_round(batch: list[Messages], max_tokens: int) -> tuple[float, int, float]:
        async def gated(messages: Messages) -> tuple[int, int]:
            async with gate:
                return await one(messages, max_tokens)

        started = time.perf_counter()
        counts = await asyncio.gather(*(gated(m) for m in batch))
        seconds = time.perf_counter() - started
        if wrong := [n for _, n in counts if n != max_tokens]:
            raise RuntimeError(f"asked {max_tokens} tokens per request, got {wrong}")
        return statistics.mean(p for p, _ in counts), sum(n for _, n in counts), seconds

    for batch in prompts(tokenizer, CONCURRENCY, seed=-1).values():
        await size_round(batch, WARMUP_TOKENS)
    rounds = []
    for repeat in range(args.repeats):
        workload = prompts(tokenizer, args.requests, seed=repeat)
        rounds.append({size: await size_round(batch, args.max_tokens) for size, batch in workload.items()})

    def figure(tokens: int, seconds: float) -> float:
        return round(tokens / seconds, 2)

    per_size = {size: {"mean_prompt_tokens": statistics.mean(r[size][0] for r in rounds),
                       "tok_per_s": statistics.median(figure(*r[size][1:]) for r in rounds)} for size in SIZES}
    totals = [figure(sum(r[s][1] for s in SIZES), sum(r[s][2] for s in SIZES)) for r in rounds]
    return {"tok_per_s": statistics.median(totals), "repeats_tok_per_s": totals, "per_size": per_size,
            "generated_tokens": [sum(r[s][1] for s in SIZES) for r in rounds]}


async def ringllm_side(base_url: str, tokenizer: Tokenizer, args: argparse.Namespace) -> dict:
    async with aiohttp.ClientSession(base_url, connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as http:
        await wait_healthy(http, 300)

        async def one(messages: Messages, max_tokens: int) -> tuple[int, int]:
            body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
            generated, prompt_tokens = 0, 0
            async with http.post("/v1/chat/completions", json=body) as reply:
                if reply.status != 200:
                    raise RuntimeError(f"the server answered {reply.status}: {await reply.text()}")
                async for line in reply.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = orjson.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"the stream failed: {event['error']}")
                    generated += sum(len(c.get("token_ids") or []) for c in event["choices"])
                    prompt_tokens = (event.get("usage") or {}).get("prompt_tokens", prompt_tokens)
            return prompt_tokens, generated

        return await measure(one, tokenizer, args)


def run_ringllm(model_dir: Path, tokenizer: Tokenizer, args: argparse.Namespace) -> dict:
    """A real server for the ringllm phase only, stopped (and its segments removed) in the finally."""
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="ringllm-vs-hf-")) / "serve.log"
    print(f"ringllm: serving on port {port}, log {log}", flush=True)
    with open(log, "wb") as out:
        server = start_server(["--model", str(model_dir), "--served-model-name", "bench", "--port", str(port),
                               "--device", args.device, "--dtype", args.dtype], stdout=out, stderr=subprocess.STDOUT)
    try:
        return asyncio.run(ringllm_side(f"http://127.0.0.1:{port}", tokenizer, args))
    finally:
        stop_server(server)


def run_hf(model_dir: Path, tokenizer: Tokenizer, args: argparse.Namespace) -> dict:
    """The naive HF streaming server: a generate thread per request, its streamer read by another."""
    import torch
    from transformers import AutoModelForCausalLM, TextIteratorStreamer

    from runtime.engine import resolve_dtype

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(args.dtype, device)).to(device).eval()

    def generate(messages: Messages, max_tokens: int) -> tuple[int, int]:
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True).to(device)
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        result: dict = {}

        def work() -> None:
            try:
                result["ids"] = model.generate(**inputs, streamer=streamer, max_new_tokens=max_tokens,
                                               min_new_tokens=max_tokens, do_sample=False)
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

    return {**asyncio.run(measure(one, tokenizer, args)), "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vs_hf", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="as `ringllm serve --dtype`: auto is fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--requests", type=int, default=8, help="requests per prompt size")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated by every request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4 requests per size, 16 tokens, 1 repeat (the test's run)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.repeats = CONCURRENCY, 16, 1

    from runtime.model_source import load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir, required=True)
    started = time.monotonic()
    ringllm = run_ringllm(model_dir, tokenizer, args)
    hf = run_hf(model_dir, tokenizer, args)
    result = {
        "speedup": round(ringllm["tok_per_s"] / hf["tok_per_s"], 2), "ringllm_tok_per_s": ringllm["tok_per_s"],
        "hf_tok_per_s": hf["tok_per_s"], "model": model_dir.name,
        "command": " ".join(["python -m benchmarks.vs_hf", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.date.today().isoformat(), "device": args.device, "dtype": args.dtype, "cpu_count": os.cpu_count(),
        "workload": {"concurrency": CONCURRENCY, "user_prompt_tokens": SIZES, "requests_per_size": args.requests,
                     "max_tokens": args.max_tokens, "repeats": args.repeats, "figure": "median of repeats"},
        "ringllm": ringllm, "hf": hf, "bench_seconds": round(time.monotonic() - started, 1), "versions": versions(),
    }
    print(f"{'':8}{'ringllm tok/s':>15}{'HF tok/s':>11}{'ratio':>8}")
    for size in SIZES:
        mine, theirs = ringllm["per_size"][size]["tok_per_s"], hf["per_size"][size]["tok_per_s"]
        print(f"{size:8}{mine:15.1f}{theirs:11.1f}{mine / theirs:8.2f}")
    print(f"{'all':8}{ringllm['tok_per_s']:15.1f}{hf['tok_per_s']:11.1f}{result['speedup']:8.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
    return result


if __name__ == "__main__":
    main()
