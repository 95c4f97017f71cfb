"""`ringllm trace RID`: one request's timeline across actors, from the server's JSON logs. A stage
runs from the first event of its start to its end, since a replayed request repeats events."""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Iterable

import orjson

# stage: (start (actor kind, event), end (actor kind, event)); kind "api" matches api0, api1, ... (and "scheduler" each replica's)
STAGES = {
    "tokenize": (("api", "received"), ("tokenizer", "tokenized")),
    "queue": (("scheduler", "queued"), ("scheduler", "scheduled")),
    "prefill": (("scheduler", "scheduled"), ("scheduler", "prefill_done")),
    "decode": (("scheduler", "prefill_done"), ("scheduler", "finished")),
    "detokenize": (("scheduler", "finished"), ("api", "finished")),
    "ttft": (("api", "received"), ("api", "first_token")),
    "e2e": (("api", "received"), ("api", "finished")),
}
REQUEST_EVENTS = {"received", "tokenized", "queued", "scheduled", "prefill_done", "first_token", "finished", "aborted", "failed"}


def read_events(lines: Iterable[bytes], rid: str) -> list[dict]:
    """The request's events (its choices' too), oldest first."""
    events = []
    for line in lines:
        if not line.startswith(b"{"):
            continue
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        own = event.get("rid")
        if isinstance(own, str) and (own == rid or own.startswith(rid + "/")) and event.get("event") in REQUEST_EVENTS:
            event["t"] = datetime.datetime.fromisoformat(event["timestamp"]).timestamp()
            events.append(event)
    return sorted(events, key=lambda e: e["t"])


def _kind(actor: str) -> str:
    """api0 -> api, scheduler1 -> scheduler, engine1.0 -> engine."""
    return actor.rstrip("0123456789.")


def stages(events: list[dict]) -> dict[str, float]:
    """Seconds of each stage whose two ends were logged."""
    first: dict[tuple[str, str], float] = {}
    for event in events:
        first.setdefault((_kind(event.get("actor", "")), event["event"]), event["t"])
    return {name: first[end] - first[start] for name, (start, end) in STAGES.items() if start in first and end in first}


def render(rid: str, events: list[dict]) -> str:
    t0 = events[0]["t"]
    lines = [f"request {rid}: {len(events)} events"]
    skip = {"event", "timestamp", "t", "actor", "pid", "epoch", "level", "rid"}
    for event in events:
        fields = " ".join(f"{k}={v}" for k, v in event.items() if k not in skip)
        lines.append(
            f"  +{(event['t'] - t0) * 1e3:10.3f} ms  {event.get('actor', '?'):<11} pid {event.get('pid', '?'):<7} "
            f"epoch {event.get('epoch', '?'):<3} {event['event']:<13} {fields}"
        )
    lines.append("stages: " + " | ".join(f"{name} {seconds * 1e3:.3f} ms" for name, seconds in stages(events).items()))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rid", help="the request id: the client's X-Request-Id, or the response's id")
    parser.add_argument("--log", default="-", help="the server's log file (its stderr); '-' reads standard input")
    parser.add_argument("--json", action="store_true", help="print {events, stages} as JSON")


def run(args: argparse.Namespace) -> int:
    if args.log == "-":
        events = read_events(sys.stdin.buffer, args.rid)
    else:
        with open(args.log, "rb") as log:
            events = read_events(log, args.rid)
    if not events:
        print(f"no events of request {args.rid!r} in {args.log}", file=sys.stderr)
        return 1
    if args.json:
        print(orjson.dumps({"events": events, "stages": stages(events)}).decode())
    else:
        print(render(args.rid, events))
    return 0
