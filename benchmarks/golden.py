"""Golden traces: `ringllm golden record` and `ringllm golden check`.

Under deterministic inference a request's tokens and log-probabilities are a function of the model, the server's
configuration and the request (docs/deterministic.md), so a recorded trace is a specification: `record` sends each
request body of a JSONL file to a running server and writes, a line per request, the body as sent, its endpoint, each
choice's token ids, their log-probabilities and finish reason, and the configuration the server reports
(GET /server_info). `check` sends every recorded body again, to the same build or another, and reports each
divergence; its exit status is 1 when any request diverges. Bodies are sent as they are but for what the trace
needs: no streaming, the token ids (vLLM's `return_token_ids`) and the drawn tokens' log-probabilities.

    ringllm golden record --url http://127.0.0.1:8000 --prompts bodies.jsonl --out golden.jsonl
    ringllm golden check golden.jsonl --url http://127.0.0.1:8000 [--json]

It is a client of the HTTP API, like the load tests beside it, and shares their session helpers (benchmarks.server).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from actors.topology import DEFAULT_PORT
from api.traces import Divergence, compare, complete, endpoint, whole
from benchmarks.server import bounded, connector, server_config
from transport import env

DEFAULT_CONCURRENCY = 8
REQUEST_TIMEOUT_S = 600
# A recorded trace is exact under deterministic inference: the same build and configuration give the same bits, and
# JSON carries a float32 log-probability exactly. So by default any difference is a divergence; a looser tolerance
# is for qualifying another build or device, whose kernels may round differently without changing a token.
DEFAULT_TOLERANCE = 0.0


def traced(body: dict[str, Any]) -> dict[str, Any]:
    """The body as sent: whole, with the drawn tokens' log-probabilities asked for; a completion keeps the
    alternatives it asked for (logprobs N), a chat its top_logprobs."""
    sent = whole(body)
    if endpoint(body) == "/v1/chat/completions":
        return sent | {"logprobs": True}
    return sent | {"logprobs": body.get("logprobs") or 0}


def samples_unseeded(body: dict[str, Any]) -> bool:
    """It may sample (its temperature is not 0, or left to the server) without a seed: the server draws one per
    request, so a replay cannot repeat it."""
    return body.get("seed") is None and body.get("temperature") != 0 and body.get("top_k") != 1


def session() -> aiohttp.ClientSession:
    """The benchmarks' client session, with RINGLLM_API_KEY's key where one is set."""
    headers = {"Authorization": f"Bearer {key}"} if (key := env.api_key()) else None
    return aiohttp.ClientSession(connector=connector(), timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S), headers=headers)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A JSON object per non-blank line."""
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def warn(message: str) -> None:
    print(f"ringllm golden: warning: {message}", file=sys.stderr)


async def configuration(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """The server's own report of its configuration; warns unless it runs deterministic inference."""
    if (config := await server_config(http, url)) is None:
        raise RuntimeError(f"{url} reports no configuration (GET /server_info): a trace must name the one it came from")
    if not config.get("engine", {}).get("deterministic"):
        warn(f"{url} does not run deterministic inference (--enable-deterministic-inference): replays may differ by batching alone")
    return config


async def record(args: argparse.Namespace) -> int:
    bodies = [traced(body) for body in read_jsonl(args.prompts)]
    for index, body in enumerate(bodies):
        if samples_unseeded(body):
            warn(f"request {index} may sample without a seed: the server picks one, and a replay cannot repeat it")
    async with session() as http:
        config = await configuration(http, args.url)
        answers = await bounded(args.concurrency, [lambda body=body: complete(http, args.url, body) for body in bodies])
    with open(args.out, "wb") as out:
        for index, (body, choices) in enumerate(zip(bodies, answers)):
            line = {"index": index, "endpoint": endpoint(body), "body": body, "choices": choices, "server_config": config}
            out.write(orjson.dumps(line) + b"\n")
    print(f"recorded {len(bodies)} requests to {args.out}")
    return 0


def config_differences(recorded: Any, served: Any, path: str = "") -> list[str]:
    """The settings (dotted names) where the replaying server's configuration differs from the record's."""
    if isinstance(recorded, dict) and isinstance(served, dict):
        keys = sorted(recorded.keys() | served.keys())
        return [name for key in keys for name in config_differences(recorded.get(key), served.get(key), f"{path}{key}.")]
    return [] if recorded == served else [path.rstrip(".")]


async def _replay(http: aiohttp.ClientSession, url: str, index: int, line: dict[str, Any], tolerance: float) -> list[Divergence]:
    try:
        replayed = await complete(http, url, line["body"])
    except (RuntimeError, ValueError, aiohttp.ClientError, TimeoutError) as exc:  # ValueError: a body that is not JSON
        return [Divergence(index, 0, "error", detail=f"the replay failed: {exc}")]
    return compare(index, line["choices"], replayed, tolerance)


async def check(args: argparse.Namespace) -> int:
    lines = read_jsonl(args.golden)
    async with session() as http:
        config = await configuration(http, args.url)
        jobs = [lambda i=i, line=line: _replay(http, args.url, i, line, args.logprob_tolerance) for i, line in enumerate(lines)]
        found = await bounded(args.concurrency, jobs)
    divergences = [d for per_request in found for d in per_request]
    divergent = sum(1 for per_request in found if per_request)
    changed = sorted({name for line in lines for name in config_differences(line["server_config"], config)})
    if args.json:
        report = {"requests": len(lines), "divergent": divergent, "divergences": [asdict(d) for d in divergences]}
        print(orjson.dumps(report | {"config_differences": changed}).decode())
    else:
        if changed:
            print(f"the server's configuration differs from the record's in: {', '.join(changed)}")
        for divergence in divergences:
            print(divergence.describe())
        print(f"{len(lines)} requests, {divergent} divergent")
    return 1 if divergent else 0


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=f"http://127.0.0.1:{DEFAULT_PORT}", help="the server (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="requests in flight at once (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringllm golden", description="golden traces: record a server's answers, or check a server against them"
    )
    actions = parser.add_subparsers(dest="action", required=True)
    r = actions.add_parser("record", help="send each request body of a JSONL file and record what the server answers")
    _add_server_args(r)
    r.add_argument("--prompts", type=Path, required=True, metavar="FILE.jsonl", help="a request body a line: 'prompt' or 'messages'")
    r.add_argument("--out", type=Path, required=True, metavar="GOLDEN.jsonl", help="where the trace goes, a line per request")
    c = actions.add_parser("check", help="replay a trace against a server and report each divergence (exit status 1 if any)")
    c.add_argument("golden", type=Path, metavar="GOLDEN.jsonl")
    _add_server_args(c)
    c.add_argument(
        "--logprob-tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="where the tokens agree, the largest log-probability difference that is not a divergence (default: %(default)s, "
        "exact, as deterministic inference gives on the same build; loosen it to qualify another build or device)",
    )
    c.add_argument("--json", action="store_true", help="one JSON object: requests, divergent, divergences, config_differences")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    try:
        return asyncio.run(record(args) if args.action == "record" else check(args))
    except (RuntimeError, ValueError, OSError, aiohttp.ClientError) as exc:
        print(f"ringllm golden {args.action}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
