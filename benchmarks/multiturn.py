"""Multi-turn conversations over a growing prefix: `ringllm bench multiturn`, after SGLang's
benchmark/hicache/bench_multiturn.py.

It measures what a KV cache saves when conversations come back to it: --clients conversations run
at once (client i starts i x --stagger s in), each --rounds rounds. A round's prompt is the whole
conversation so far (every earlier prompt and answer) and --user-tokens new tokens; its answer is
exactly --answer-tokens greedy tokens (ignore_eos). A client sends its next round as soon as its
answer is complete (after --think-time s), and with --max-parallel P at most P rounds are in flight: a
client whose round is ready waits for a free place, and its TTFT counts from sending, as in SGLang's.
Prompts go to /v1/completions as token ids, and answers come back as token ids (return_token_ids), so
each round's prompt extends the one before it token for token. User tokens are random ids in USER_IDS,
drawn from --seed and the client's index.

Each --arm NAME='FLAGS' serves the default model (or --model) with FLAGS and the flags after --,
on a server of its own, one arm after another, so that arms differing in one setting (the pool's
size, a tiered cache) compare in one run. Per arm: the time to the first token chunk (TTFT) over
all rounds and per round (round 1 finds nothing cached; later rounds find their conversation's
prefix if the cache kept it), the share of prompt tokens the server found cached
(usage.prompt_tokens_details.cached_tokens), throughput over the whole load, and the KV pool's
tokens beside the tokens of all conversations' final contexts. Ratios compare each arm with the
first. Loopback only, bounded (--timeout a request, --time-limit of load an arm). The last line
printed is one JSON object; --out writes it too.

    ringllm bench multiturn --arm base='--num-pages 2000' --arm big='--num-pages 8000' -- --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from benchmarks.provenance import machine, provenance
from benchmarks.serve import scrape
from benchmarks.server import API_WORKERS, connector, free_port, server_config, sse_events, start_server, stop_server, wait_healthy

# User tokens are drawn from these ids: above the special tokens of SmolLM2 (0-16) and Mistral (below 1,000), below
# those of Llama-3 and Qwen (128,000 and up), so every supported tokenizer reads them as plain text.
USER_IDS = (1_000, 10_000)
JSON = {"Content-Type": "application/json"}  # POST routes take application/json only


@dataclass
class Turn:
    """One round of one conversation as its client saw it; times in seconds from sending it."""

    client: int
    round: int  # from 1
    ok: bool = False
    ttft: float = 0.0
    prompt_tokens: int = 0  # the server's counts (usage)
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def user_turns(seed: int, client: int, rounds: int, tokens: int) -> list[list[int]]:
    """The user's new tokens of each round of one conversation: the same for a seed and client in every arm."""
    return np.random.default_rng([seed, client]).integers(*USER_IDS, (rounds, tokens)).tolist()


async def ask(http: aiohttp.ClientSession, prompt: list[int], answer_tokens: int, turn: Turn) -> list[int]:
    """Stream one round into `turn`; the answer's token ids, or [] when the round failed (`turn.error` says why)."""
    body = {
        "prompt": prompt,
        "max_tokens": answer_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    answer: list[int] = []
    usage: dict[str, Any] | None = None
    sent = time.perf_counter()
    try:
        async with http.post("/v1/completions", data=orjson.dumps(body), headers=JSON) as reply:
            if reply.status != 200:
                turn.error = f"HTTP {reply.status}: {(await reply.text())[:300]}"
                return []
            async for event in sse_events(reply):
                if "error" in event:
                    turn.error = f"error event: {event['error'].get('message')}"
                    return []
                if choices := event.get("choices"):
                    turn.ttft = turn.ttft or time.perf_counter() - sent
                    answer += choices[0].get("token_ids") or []
                usage = event.get("usage") or usage
    except (TimeoutError, aiohttp.ClientError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
        return []
    if usage is None or len(answer) != answer_tokens:
        turn.error = f"an answer of {len(answer)} token ids, not {answer_tokens}{'' if usage else ', and no usage'}"
        return []
    turn.ok, turn.prompt_tokens, turn.output_tokens = True, usage["prompt_tokens"], usage["completion_tokens"]
    turn.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    return answer


async def converse(
    http: aiohttp.ClientSession, client: int, users: list[list[int]], args: argparse.Namespace, turns: list[Turn], places: asyncio.Semaphore
) -> None:
    """One client's rounds, each sent once the one before it has its whole answer and a place is free; a failed
    round ends the conversation."""
    await asyncio.sleep(client * args.stagger)
    context: list[int] = []
    for number, user in enumerate(users, 1):
        if number > 1:
            await asyncio.sleep(args.think_time)
        context += user
        async with places:
            turn = Turn(client, number)
            turns.append(turn)
            answer = await ask(http, context, args.answer_tokens, turn)
        if not turn.ok:
            return
        context += answer


async def server_info(http: aiohttp.ClientSession) -> dict[str, Any]:
    async with http.get("/server_info") as reply:
        reply.raise_for_status()
        return await reply.json(loads=orjson.loads)


async def drive(server: subprocess.Popen, launched: float, port: int, args: argparse.Namespace) -> dict[str, Any]:
    """One arm's load on the server at `port`: a warm-up round, an emptied prefix cache, then every conversation,
    for --time-limit s at most. The arm's figures."""
    users = [user_turns(args.seed, client, args.rounds, args.user_tokens) for client in range(args.clients)]
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector(), timeout=timeout) as http:
        await wait_healthy(http, args.startup_timeout, server)
        startup_s = time.perf_counter() - launched
        if (config := await server_config(http)) is None:
            raise RuntimeError("the server reports no configuration (GET /server_info)")
        if (longest := args.rounds * (args.user_tokens + args.answer_tokens)) > (limit := (await server_info(http))["max_model_len"]):
            raise RuntimeError(f"a conversation's final context ({longest} tokens) outgrows the model's context ({limit} tokens)")
        warm = Turn(-1, 0)
        await ask(http, list(range(*USER_IDS))[:64], args.answer_tokens, warm)
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        fits = None
        if args.fits_clients:  # the small load first, on its own conversations
            small = [user_turns(args.seed + 1, client, args.fits_rounds, args.user_tokens) for client in range(args.fits_clients)]
            fits = summarize(*await load(http, small, args), args.fits_clients, args.fits_rounds)
        before = await scrape(http, "")
        turns, wall_s = await load(http, users, args)
        after = await scrape(http, "")
        kv_tokens = (await server_info(http))["kv_tokens"]  # reported once the engines run
    figures = {"startup_s": round(startup_s, 1), **summarize(turns, wall_s, args.clients, args.rounds), "kv_pool_tokens": kv_tokens}
    figures["server"] = server_times(before or {}, after or {})
    return figures | ({"fits": fits} if fits is not None else {}) | {"config": config}


async def load(http: aiohttp.ClientSession, users: list[list[list[int]]], args: argparse.Namespace) -> tuple[list[Turn], float]:
    """The conversations of `users` (a client each) from an emptied prefix cache, for --time-limit s at most: every
    round's turn, and the load's seconds."""
    async with http.post("/flush_cache", json={}) as reply:
        reply.raise_for_status()
    turns: list[Turn] = []
    started = time.perf_counter()
    places = asyncio.Semaphore(args.max_parallel or len(users))
    tasks = [asyncio.create_task(converse(http, client, user, args, turns, places)) for client, user in enumerate(users)]
    done, pending = await asyncio.wait(tasks, timeout=args.time_limit)
    wall_s = time.perf_counter() - started
    for task in pending:  # a round still in flight counts as unfinished
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()  # a bug in the client, not a failed round: raised
    return turns, wall_s


def server_times(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Where the server's time went over the load (its /metrics): steps, the tiers' copies, the requests' queueing."""
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    queued = delta("vllm:request_queue_time_seconds_count")
    return {
        "steps": int(delta("ringllm:step_duration_seconds_count")),
        "step_s": round(delta("ringllm:step_duration_seconds_sum"), 2),
        "tier_copy_runs": int(delta("ringllm:hicache_load_seconds_count")),
        "tier_copy_s": round(delta("ringllm:hicache_load_seconds_sum"), 2),
        "tier_moved_gb": round(delta("ringllm:hicache_moved_bytes_total") / 1e9, 2),
        "queue_ms_mean": round(1e3 * delta("vllm:request_queue_time_seconds_sum") / queued, 1) if queued else None,
    }


def _ms(values: list[float], q: float | None = None) -> float | None:
    """The q-th percentile of `values` in ms (their mean without q); None for none."""
    if not values:
        return None
    return round(1e3 * float(np.mean(values) if q is None else np.percentile(values, q)), 1)


def summarize(turns: list[Turn], wall_s: float, clients: int, rounds: int) -> dict[str, Any]:
    """Latencies over the rounds that completed; throughputs over the whole load, whose tokens are the server's counts."""
    ok = [t for t in turns if t.ok]
    failed = [t for t in turns if t.error]
    by_round = [[t for t in ok if t.round == number] for number in range(1, rounds + 1)]
    prompt, cached, output = (sum(getattr(t, name) for t in ok) for name in ("prompt_tokens", "cached_tokens", "output_tokens"))
    ttfts = [t.ttft for t in ok]
    return {
        "requests": len(ok),
        "failed": len(failed),
        "unfinished": clients * rounds - len(ok) - len(failed),
        "errors": sorted({t.error for t in failed})[:5],
        "ttft_ms": {"mean": _ms(ttfts), "p50": _ms(ttfts, 50), "p90": _ms(ttfts, 90), "p99": _ms(ttfts, 99)},
        "ttft_ms_p50_by_round": [_ms([t.ttft for t in group], 50) for group in by_round],
        "ttft_ms_p50_later_rounds": _ms([t.ttft for t in ok if t.round > 1], 50),
        "cache_hit_rate": round(cached / prompt, 4) if prompt else None,
        "cache_hit_rate_by_round": [_hit_rate(group) for group in by_round],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "output_tokens": output,
        "wall_s": round(wall_s, 2),
        "tok_per_s": round((prompt + output) / wall_s, 1),
        "output_tok_per_s": round(output / wall_s, 1),
        "req_per_s": round(len(ok) / wall_s, 3),
    }


def _hit_rate(turns: list[Turn]) -> float | None:
    prompt = sum(t.prompt_tokens for t in turns)
    return round(sum(t.cached_tokens for t in turns) / prompt, 4) if prompt else None


def run_arm(name: str, flags: str, args: argparse.Namespace) -> dict[str, Any]:
    """Serve, load and stop one arm's server (stopped however the load ends); its record. The arm's flags come after
    the shared ones, so that an arm overrides them."""
    port = free_port()
    serve = ["--model", args.model, "--port", str(port), "--api-workers", str(API_WORKERS), "--no-warm-spares"]
    serve += [*args.server_flags, *shlex.split(flags)]
    log = Path(tempfile.mkdtemp(prefix="ringllm-multiturn-")) / "serve.log"
    print(f"multiturn: arm {name}: ringllm serve {shlex.join(serve)} (log: {log})", file=sys.stderr, flush=True)
    launched = time.perf_counter()
    with open(log, "wb") as out:
        server = start_server(serve, stdout=out, stderr=out)
    try:
        figures = asyncio.run(drive(server, launched, port, args))
    finally:
        stop_server(server)
    return {"name": name, "flags": flags, "server_command": "ringllm serve " + shlex.join(serve), **figures}


def _ratio(arm: float | None, first: float | None) -> float | None:
    return round(arm / first, 3) if arm is not None and first else None


def ratios(arms: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each arm after the first against the first: TTFT p50 (all rounds, and rounds 2 on) and total throughput."""
    first = arms[0]
    return {
        arm["name"]: {
            "ttft_p50": _ratio(arm["ttft_ms"]["p50"], first["ttft_ms"]["p50"]),
            "ttft_p50_later_rounds": _ratio(arm["ttft_ms_p50_later_rounds"], first["ttft_ms_p50_later_rounds"]),
            "tok_per_s": _ratio(arm["tok_per_s"], first["tok_per_s"]),
        }
        | ({"fits_tok_per_s": _ratio(arm["fits"]["tok_per_s"], first["fits"]["tok_per_s"])} if "fits" in first else {})
        for arm in arms[1:]
    }


_RATIO_ROWS = (("ttft_p50", "TTFT p50"), ("ttft_p50_later_rounds", "TTFT p50 rounds 2+"), ("tok_per_s", "throughput"))


def table(record: dict[str, Any]) -> str:
    """The arms side by side, a column each."""
    arms, load = record["arms"], record["workload"]
    rows: list[tuple[str, list[Any]]] = [
        ("requests ok / failed / unfinished", [f"{a['requests']} / {a['failed']} / {a['unfinished']}" for a in arms]),
        *((f"TTFT {key} (ms)", [a["ttft_ms"][key] for a in arms]) for key in ("mean", "p50", "p90", "p99")),
        *((f"TTFT p50 round {i + 1} (ms)", [a["ttft_ms_p50_by_round"][i] for a in arms]) for i in range(load["rounds"])),
        ("TTFT p50 rounds 2+ (ms)", [a["ttft_ms_p50_later_rounds"] for a in arms]),
        ("cache hit rate (cached / prompt tokens)", [a["cache_hit_rate"] for a in arms]),
        ("throughput in+out (tok/s)", [a["tok_per_s"] for a in arms]),
        ("output throughput (tok/s)", [a["output_tok_per_s"] for a in arms]),
        ("requests/s", [a["req_per_s"] for a in arms]),
        ("wall (s)", [a["wall_s"] for a in arms]),
        ("KV pool (tokens)", [a["kv_pool_tokens"] for a in arms]),
        ("start-up (s)", [a["startup_s"] for a in arms]),
        *(
            (f"server: {key}", [a.get("server", {}).get(key) for a in arms])
            for key in ("steps", "step_s", "tier_copy_s", "tier_moved_gb", "queue_ms_mean")
        ),
    ]
    ratio_rows = list(_RATIO_ROWS)
    if "fits" in arms[0]:  # the small load's figures, then its throughput's ratio
        rows += [
            ("fits: cache hit rate", [a["fits"]["cache_hit_rate"] for a in arms]),
            ("fits: TTFT p50 (ms)", [a["fits"]["ttft_ms"]["p50"] for a in arms]),
            ("fits: throughput in+out (tok/s)", [a["fits"]["tok_per_s"] for a in arms]),
        ]
        ratio_rows.append(("fits_tok_per_s", "fits: throughput"))
    rows += [(f"{label} vs {arms[0]['name']}", ["-", *(r[key] for r in record["ratios"].values())]) for key, label in ratio_rows]
    cells = [["", *(a["name"] for a in arms)], *([label, *("-" if v is None else str(v) for v in values)] for label, values in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    head = (
        f"{load['clients']} conversations ({load.get('max_parallel', load['clients'])} rounds in flight at most) x {load['rounds']} "
        f"rounds of {load['user_tokens']} user + {load['answer_tokens']} answer "
        f"tokens; final contexts: {load['context_tokens']:,} tokens in all"
    )
    return "\n".join([head, *("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in cells)])


def _arm(text: str) -> tuple[str, str]:
    name, equals, flags = text.partition("=")
    if not name or not equals:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME='SERVER FLAGS'")
    return name, flags


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ringllm bench multiturn", description=__doc__.split("\n\n")[0])  # pyright: ignore[reportOptionalMemberAccess]
    p.add_argument(
        "--arm", type=_arm, action="append", metavar="NAME='FLAGS'", help="a server to measure (repeatable; default: one, as is)"
    )
    p.add_argument("--model", help="a model folder or hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--clients", type=int, default=16, help="conversations")
    p.add_argument("--rounds", type=int, default=5, help="of each conversation")
    p.add_argument("--max-parallel", type=int, default=0, help="rounds in flight at most, over all clients (default: no limit)")
    p.add_argument("--user-tokens", type=int, default=2000, help="new tokens of user text a round")
    p.add_argument("--answer-tokens", type=int, default=256, help="tokens of each answer, exactly")
    p.add_argument("--think-time", type=float, default=0.0, help="seconds a client waits after an answer before its next round")
    p.add_argument("--stagger", type=float, default=0.25, help="seconds between two clients' first rounds")
    p.add_argument("--seed", type=int, default=0, help="of the user tokens")
    p.add_argument(
        "--fits-clients", type=int, default=0, help="first, a load of this many conversations (of --fits-rounds) that the pool holds"
    )
    p.add_argument("--fits-rounds", type=int, default=3, help="rounds of each conversation of the --fits-clients load")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument(
        "--time-limit", type=float, default=1800.0, help="seconds of load an arm at most; rounds not done by then are unfinished"
    )
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to answer /health")
    p.add_argument("--out", type=Path, help="also write the record to this file")
    p.add_argument("server_flags", nargs="*", help="after --: `ringllm serve` flags for every arm")
    args = p.parse_args(argv)
    args.arm = args.arm or [("default", "")]
    if len({name for name, _ in args.arm}) < len(args.arm):
        p.error("two arms with one name")
    if args.max_parallel < 0:
        p.error("--max-parallel must be at least 1 (0: no limit)")
    if min(args.clients, args.rounds, args.user_tokens, args.answer_tokens) < 1:
        p.error("--clients, --rounds, --user-tokens and --answer-tokens must be at least 1")
    if args.model is None:
        from runtime.models.source import default_model_dir

        args.model = str(default_model_dir())
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    arms = [run_arm(name, flags, args) for name, flags in args.arm]
    record = {
        **provenance(),
        "machine": machine(arms[0]["config"]["engine"]["device"]),
        "command": shlex.join(["ringllm", "bench", "multiturn", *argv]),
        "model": args.model,
        "workload": {
            "clients": args.clients,
            "rounds": args.rounds,
            "max_parallel": args.max_parallel or args.clients,
            "user_tokens": args.user_tokens,
            "answer_tokens": args.answer_tokens,
            "think_time_s": args.think_time,
            "stagger_s": args.stagger,
            "seed": args.seed,
            "context_tokens": args.clients * args.rounds * (args.user_tokens + args.answer_tokens),
            "fits_clients": args.fits_clients,
            "fits_rounds": args.fits_rounds,
            "fits_context_tokens": args.fits_clients * args.fits_rounds * (args.user_tokens + args.answer_tokens),
        },
        "arms": arms,
        "ratios": ratios(arms),
    }
    print(table(record))
    line = orjson.dumps(record).decode()
    if args.out:
        args.out.write_text(line + "\n")
    print(line)
    return record


if __name__ == "__main__":
    main()
