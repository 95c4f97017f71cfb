"""Online serving load test of a running server: `ringllm bench serve`, after `vllm bench serve`.

Each request streams (SSE) through one aiohttp session. Requests arrive as a Poisson process at
--request-rate (gamma-distributed gaps with --burstiness, or all at once at inf), at most
--max-concurrency in flight. Per request it measures the time to the first token chunk (TTFT),
the gaps between chunks (ITL; this server sends one chunk per token), the end-to-end latency
(E2EL) and TPOT = (E2EL - TTFT) / (output tokens - 1). Token counts are the server's `usage`
where it reports them, else the tokenizer's count of the prompt and the number of chunks. The
summary is vLLM's block, and --save-result writes vLLM's JSON keys, so its tooling reads the file.
When the server has a Prometheus /metrics, the block adds what it counted over the run (finished
requests, generated tokens, mean TTFT), so the server's own figures can be checked against the
client's; when it reports its configuration (a ringllm server's GET /server_info), the result
holds it as "server_config", so a figure names the settings that made it.

    ringllm bench serve --base-url http://127.0.0.1:8000 --request-rate 4 --num-prompts 64 --save-result
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import shlex
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import orjson
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from actors.topology import DEFAULT_PORT
from benchmarks.server import connector, server_config
from runtime.models.source import load_tokenizer, resolve_model_dir

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
SLOS = ("ttft", "tpot", "e2el")
METRICS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


@dataclass(frozen=True)
class Prompt:
    text: str
    input_len: int  # tokens of the text, by --tokenizer
    output_len: int


@dataclass
class Outcome:
    """One request as the client saw it; times in seconds from sending it."""

    input_len: int
    ok: bool = False
    start: float = 0.0  # when it was sent, from the run's start
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float:
        """0 for a single token, as vLLM counts it toward goodput."""
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


# -- workload -------------------------------------------------------------------------------


def lengths(rng: np.random.Generator, count: int, mean: int, ratio: float) -> list[int]:
    """vLLM's random lengths: integers uniform in [floor(mean*(1-ratio)), ceil(mean*(1+ratio))], at least 1."""
    low, high = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return rng.integers(low, high + 1, count).tolist()


def random_text(tokenizer, rng: np.random.Generator, allowed: np.ndarray, length: int) -> str:
    """About `length` random tokens as text. Decoding and re-encoding can merge or split tokens, so
    the re-encoding is cut or topped up and decoded again, a few times at most (as vLLM does)."""
    ids = rng.choice(allowed, length).tolist()
    for _ in range(10):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            break
        ids = ids[:length] + rng.choice(allowed, max(0, length - len(ids))).tolist()
    return text


def make_prompts(args: argparse.Namespace, tokenizer) -> list[Prompt]:
    """The workload. Every prompt's input_len is its text's own token count, whatever is left of the
    decode round trip's mismatch."""
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    if args.dataset_name == "jsonl":
        rows = [orjson.loads(line) for line in args.dataset_path.read_text().splitlines() if line.strip()]
        return [Prompt(r["prompt"], count(r["prompt"]), int(r.get("output_len", args.random_output_len))) for r in rows[: args.num_prompts]]
    rng = np.random.default_rng(args.seed)
    allowed = np.setdiff1d(np.arange(tokenizer.vocab_size), tokenizer.all_special_ids)
    inputs = lengths(rng, args.num_prompts, args.random_input_len, args.random_range_ratio)
    outputs = lengths(rng, args.num_prompts, args.random_output_len, args.random_range_ratio)
    shared = args.dataset_name == "shared-prefix"
    prefixes = [random_text(tokenizer, rng, allowed, args.shared_prefix_len) for _ in range(args.shared_prefix_groups)] if shared else [""]
    texts = [prefixes[i % len(prefixes)] + random_text(tokenizer, rng, allowed, n) for i, n in enumerate(inputs)]
    return [Prompt(text, count(text), n) for text, n in zip(texts, outputs)]


def arrival_times(count: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the start: gamma gaps of mean 1/rate and shape `burstiness` (1 is
    Poisson), rescaled so the last lands at count/rate, as vLLM does, so that a seed's luck does not
    change the offered load. An infinite rate sends everything at once."""
    if math.isinf(rate):
        return np.zeros(count)
    times = np.cumsum(rng.gamma(burstiness, 1 / (rate * burstiness), count))
    return times * (count / rate / times[-1])


# -- requests -------------------------------------------------------------------------------


async def send(http: aiohttp.ClientSession, url: str, body: dict, chat: bool, outcome: Outcome) -> None:
    """Stream one request into `outcome`. Every chunk with a choice is a token's arrival, its text
    possibly empty (a special token, or bytes the server holds back until a character is whole)."""
    started = last = time.perf_counter()
    chunks, texts, usage, done = 0, [], None, False
    try:
        async with http.post(url, json=body) as reply:
            if reply.status != 200:
                outcome.error = f"HTTP {reply.status}: {(await reply.text())[:500]}"
                return
            async for line in reply.content:
                data = line.strip().removeprefix(b"data:").strip()
                if not data or data.startswith(b":"):
                    continue
                if data == b"[DONE]":
                    done = True
                    break
                event = orjson.loads(data)
                if "error" in event:
                    outcome.error = f"error event after {chunks} chunks: {event['error'].get('message')}"
                    return
                if choices := event.get("choices"):
                    now = time.perf_counter()
                    if chunks:
                        outcome.itl.append(now - last)
                    else:
                        outcome.ttft = now - started
                    last, chunks = now, chunks + 1
                    texts.append((choices[0]["delta"].get("content") if chat else choices[0].get("text")) or "")
                usage = event.get("usage") or usage
            outcome.e2el = time.perf_counter() - started
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return
    finally:
        outcome.text = "".join(texts)
    if not done or not chunks:
        outcome.error = f"the stream ended after {chunks} chunks{' without [DONE]' if not done else ''}"
        return
    outcome.ok, outcome.output_len = True, chunks
    if usage:  # the server's counts: the prompt as it tokenized it, chat template included
        outcome.input_len, outcome.output_len = usage["prompt_tokens"], usage["completion_tokens"]


def request_body(args: argparse.Namespace, model: str, prompt: Prompt) -> dict:
    body = {
        "model": model,
        "max_tokens": prompt.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_body)
    if args.endpoint == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt.text}]}
    return {**body, "prompt": prompt.text}


async def scrape(http: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
    """Every sample of the server's /metrics summed over labels, and also per data-parallel replica
    (as NAME@REPLICA); None if it has no /metrics."""
    try:
        async with http.get(f"{base_url}/metrics") as reply:
            if reply.status != 200:
                return None
            text = await reply.text()
    except aiohttp.ClientError:
        return None
    totals: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
            if "replica" in sample.labels:
                totals[f"{sample.name}@{sample.labels['replica']}"] += sample.value
    return totals


def server_counts(before: dict[str, float], after: dict[str, float]) -> dict:
    """What the server counted between two scrapes, under the harness's names."""
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    ttft_count, queries = delta("vllm:time_to_first_token_seconds_count"), delta("vllm:prefix_cache_queries_total")
    scheduled = "vllm:request_queue_time_seconds_count@"  # one per request a replica scheduled
    replicas = sorted(name.removeprefix(scheduled) for name in after if name.startswith(scheduled))
    return {
        "server_completed": int(delta("vllm:request_success_total")),
        "server_output_tokens": int(delta("vllm:generation_tokens_total")),
        "server_mean_ttft_ms": delta("vllm:time_to_first_token_seconds_sum") / ttft_count * 1000 if ttft_count else None,
        "server_prefix_hit_rate": delta("vllm:prefix_cache_hits_total") / queries if queries else None,
        "server_requests_per_replica": [int(delta(scheduled + replica)) for replica in replicas],
    }


async def first_model(http: aiohttp.ClientSession, base_url: str) -> str:
    async with http.get(f"{base_url}/v1/models") as reply:
        reply.raise_for_status()
        return (await reply.json(loads=orjson.loads, content_type=None))["data"][0]["id"]  # SGLang's router says text/plain


# -- the run --------------------------------------------------------------------------------


def summarize(outcomes: list[Outcome], duration: float, goodput: dict[str, float]) -> dict:
    """vLLM's figures: throughputs over the whole run; latency statistics over completed requests."""
    done = [o for o in outcomes if o.ok]
    total_in, total_out = sum(o.input_len for o in done), sum(o.output_len for o in done)
    result = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    if goodput:
        good = sum(all(getattr(o, name) <= ms / 1000 for name, ms in goodput.items()) for o in done)
        result["request_goodput"] = good / duration
    samples = {
        "ttft": [o.ttft for o in done],
        "tpot": [o.tpot for o in done if o.output_len > 1],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.e2el for o in done],
    }
    for name, values in samples.items():
        ms = np.asarray(values or [0.0]) * 1000
        result.update(
            {
                f"mean_{name}_ms": float(ms.mean()),
                f"median_{name}_ms": float(np.median(ms)),
                f"std_{name}_ms": float(ms.std()),
                f"p99_{name}_ms": float(np.percentile(ms, 99)),
            }
        )
    return result | {
        "input_lens": [o.input_len for o in outcomes],
        "output_lens": [o.output_len for o in outcomes],
        "start_times": [o.start for o in outcomes],
        "ttfts": [o.ttft for o in outcomes],
        "itls": [o.itl for o in outcomes],
        "e2els": [o.e2el for o in outcomes],
        "generated_texts": [o.text for o in outcomes],
        "errors": [o.error for o in outcomes],
    }


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Run the load and return vLLM's result dict (what --save-result writes)."""
    tokenizer_dir = resolve_model_dir(args.tokenizer)
    prompts = make_prompts(args, load_tokenizer(tokenizer_dir, required=True))
    times = arrival_times(len(prompts), args.request_rate, args.burstiness, np.random.default_rng(args.seed + 1))
    outcomes = [Outcome(p.input_len) for p in prompts]
    base_url = args.base_url.rstrip("/")
    url = base_url + ENDPOINTS[args.endpoint]
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    async with aiohttp.ClientSession(connector=connector(), timeout=aiohttp.ClientTimeout(total=6 * 3600)) as http:
        model = args.model or await first_model(http, base_url)
        config = await server_config(http, base_url)
        before = await scrape(http, base_url)
        progress = tqdm(total=len(prompts), disable=args.disable_tqdm)

        async def one(prompt: Prompt, outcome: Outcome, at: float) -> None:
            await asyncio.sleep(at - (time.perf_counter() - start))
            async with limit:
                outcome.start = time.perf_counter() - start
                await send(http, url, request_body(args, model, prompt), args.endpoint == "chat", outcome)
            progress.update()

        start = time.perf_counter()
        await asyncio.gather(*(one(p, o, t) for p, o, t in zip(prompts, outcomes, times)))
        duration = time.perf_counter() - start
        progress.close()
        after = await scrape(http, base_url) if before is not None else None
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    return {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "ringllm",
        "model_id": model,
        "tokenizer_id": args.tokenizer or str(tokenizer_dir),
        "endpoint": ENDPOINTS[args.endpoint],
        "dataset_name": args.dataset_name,
        "num_prompts": len(prompts),
        "request_rate": rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "command": args.command,
        **({"server_config": config} if config is not None else {}),
        **(server_counts(before, after) if before is not None and after is not None else {}),
        **summarize(outcomes, duration, dict(args.goodput or [])),
    }


def report(result: dict) -> str:
    """vLLM's printed block."""

    def row(label: str, value: int | float | str) -> str:
        return (f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}").rstrip()

    lines = [
        f"{' Serving Benchmark Result ':=^50}",
        row("Successful requests:", result["completed"]),
        row("Failed requests:", result["failed"]),
    ]
    if result["max_concurrency"]:
        lines.append(row("Maximum request concurrency:", result["max_concurrency"]))
    if result["request_rate"] != "inf":
        lines.append(row("Request rate configured (RPS):", float(result["request_rate"])))
    lines += [
        row("Benchmark duration (s):", result["duration"]),
        row("Total input tokens:", result["total_input_tokens"]),
        row("Total generated tokens:", result["total_output_tokens"]),
        row("Request throughput (req/s):", result["request_throughput"]),
    ]
    if "request_goodput" in result:
        lines.append(row("Request goodput (req/s):", result["request_goodput"]))
    lines += [
        row("Output token throughput (tok/s):", result["output_throughput"]),
        row("Total Token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for key, name, header in METRICS:
        lines += [
            f"{header:-^50}",
            row(f"Mean {name} (ms):", result[f"mean_{key}_ms"]),
            row(f"Median {name} (ms):", result[f"median_{key}_ms"]),
            row(f"P99 {name} (ms):", result[f"p99_{key}_ms"]),
        ]
    if "server_completed" in result:
        lines += [
            f"{' Server /metrics over the run ':-^50}",
            row("Requests finished:", result["server_completed"]),
            row("Generated tokens:", result["server_output_tokens"]),
        ]
        if result["server_mean_ttft_ms"] is not None:
            lines.append(row("Mean TTFT (ms):", result["server_mean_ttft_ms"]))
        if result["server_prefix_hit_rate"] is not None:
            lines.append(row("Prefix cache hit rate:", result["server_prefix_hit_rate"]))
        if len(result["server_requests_per_replica"]) > 1:
            lines.append(row("Requests per replica:", " ".join(map(str, result["server_requests_per_replica"]))))
    return "\n".join([*lines, "=" * 50])


def result_path(args: argparse.Namespace, result: dict) -> Path:
    """vLLM's default name, BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json, in --result-dir or here."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = args.result_file or f"ringllm-{args.request_rate}qps{concurrency}-{result['model_id'].split('/')[-1]}-{result['date']}.json"
    return Path(args.result_dir or ".") / name


def slo(text: str) -> tuple[str, float]:
    name, _, ms = text.partition(":")
    if name not in SLOS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:MS with NAME one of {', '.join(SLOS)}")
    return name, float(ms)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="ringllm bench serve", description=__doc__.split("\n\n")[0])  # pyright: ignore[reportOptionalMemberAccess]
    p.add_argument("--base-url", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="the server's root URL")
    p.add_argument(
        "--endpoint",
        default="completions",
        choices=list(ENDPOINTS),
        type=lambda s: {path: name for name, path in ENDPOINTS.items()}.get(s, s),
        help="completions or chat (or their paths, /v1/completions and /v1/chat/completions)",
    )
    p.add_argument("--model", help="the model name to send (default: the first of GET /v1/models)")
    p.add_argument(
        "--tokenizer",
        help="folder or hub id of the tokenizer that makes and counts prompts (default: the "
        "default model's, SmolLM2-135M-Instruct; the client cannot see the server's folder)",
    )
    p.add_argument(
        "--dataset-name",
        default="random",
        choices=["random", "shared-prefix", "jsonl"],
        help="random: random tokens as text; shared-prefix: as random, each prompt after its group's random "
        "prefix (sglang's generated-shared-prefix); jsonl: --dataset-path",
    )
    p.add_argument(
        "--dataset-path",
        type=Path,
        help='JSONL, one {"prompt": str, "output_len": int (optional, default '
        "--random-output-len)} a line; the first --num-prompts lines are sent",
    )
    p.add_argument("--num-prompts", type=int, default=64, help="(default: 64; vLLM's: 1000)")
    p.add_argument(
        "--random-input-len",
        type=int,
        default=128,
        help="prompt tokens, after the prefix with shared-prefix (default: 128, and 32 out: the default 135M model "
        "on 2 CPU cores serves 4 requests/s of that without a growing queue; vLLM's 1024 and 128 saturate it "
        "below 1 request/s and take minutes)",
    )
    p.add_argument("--random-output-len", type=int, default=32, help="max_tokens (default: 32)")
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="vLLM's: lengths uniform in [L*(1-R), L*(1+R)], 0 <= R < 1")
    p.add_argument("--shared-prefix-len", type=int, default=512, help="shared-prefix: tokens of each group's prefix")
    p.add_argument("--shared-prefix-groups", type=int, default=4, help="shared-prefix: prompt i is in group i mod this")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos, so every request makes its output length")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    p.add_argument(
        "--extra-body",
        type=orjson.loads,
        default={},
        help="a JSON object of fields added to every request, e.g. a response_format (as vLLM's --extra-body)",
    )
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (default: inf, all at once)")
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps between arrivals (mean 1/rate): 1 is Poisson, below 1 burstier, above 1 steadier",
    )
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight (a client-side semaphore)")
    p.add_argument(
        "--goodput",
        nargs="+",
        type=slo,
        metavar="NAME:MS",
        help="SLOs among ttft, tpot, e2el in ms; goodput counts the requests meeting all of them per second",
    )
    p.add_argument("--save-result", action="store_true", help="write the result as JSON (vLLM's keys)")
    p.add_argument(
        "--result-file",
        "--result-filename",
        help="the JSON's name (implies --save-result; default: ringllm-RATEqps[-concurrencyN]-MODEL-DATE.json)",
    )
    p.add_argument("--result-dir", help="where the JSON goes (default: the current directory)")
    p.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if args.dataset_name == "jsonl" and args.dataset_path is None:
        p.error("--dataset-name jsonl needs --dataset-path")
    if not 0 <= args.random_range_ratio < 1 or not 0 < args.burstiness < math.inf or args.request_rate <= 0:
        p.error("need 0 <= --random-range-ratio < 1, a finite --burstiness > 0 and --request-rate > 0")
    args.command = shlex.join(["ringllm", "bench", "serve", *argv])
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = asyncio.run(run_benchmark(args))
    for error in sorted({e for e in result["errors"] if e})[:10]:
        print(f"failed: {error}", file=sys.stderr)
    print(report(result))
    if args.save_result or args.result_file:
        path = result_path(args, result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
        print(f"saved {path}")


if __name__ == "__main__":
    main()
