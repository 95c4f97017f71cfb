"""Chaos: kill or freeze actors under streaming load and check that every stream is unchanged.

It starts a `ringllm serve`, runs a fault-free load of streaming completions (greedy and seeded
sampling) and records every stream's text and token ids. Then, for each chosen actor kind, it
repeats the load while SIGKILLing (or SIGSTOPping) that actor at random moments, and compares
every stream with the reference. The last line printed is one JSON object:

    requests, completed, mismatched, mismatched_by_kind{kind: n}, lost, kills{kind: n},
    promoted{kind: kills answered by a warm spare},
    replays{kind: kills that started a new epoch, where every stream in flight is recomputed},
    recovery_ms_p50, recovery_ms_max, longest_pause_ms{kind: the longest a stream in flight waited across a kill},
    recovery_ms{kind: [p50, max]}, leaked_pages (-1: requests still running after the load),
    leaked_segments, orphans, server_config (the settings the server reports), with --guided
    invalid_json (constrained streams that do not open with an object of GUIDE_SCHEMA), and with
    --control control_mismatched (the streams a second fault-free load changes: on a GPU in bf16
    batches form by arrival time and round by their size)

recovery_ms runs from a kill to the next token of a stream that was in flight at the kill.

    python -m benchmarks.chaos --quick                 # SmolLM2, one kill per backend kind
    python -m benchmarks.chaos --kills 5 --signal stop # five freezes per kind
    python -m benchmarks.chaos --quick --kinds tokenizer engine engine:stop   # a death of each, and an engine hang
    python -m benchmarks.chaos --quick --kinds engine:twice --startup-kill engine   # two engine deaths 0.5 s apart
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
import psutil

from actors.control import SPARE_STARTING, ControlBlock
from benchmarks.provenance import provenance
from benchmarks.server import API_WORKERS, ServerExited, connector, free_port, server_config, sse_events, start_server, wait_healthy
from transport.segment import list_segments, server_prefix

BACKEND_KINDS = ("tokenizer", "scheduler", "engine", "detokenizer")
KINDS = (*BACKEND_KINDS, "keeper")  # a keeper's death takes its KV pool (and its engine) with it: not among the defaults
MAX_ROUNDS_PER_KILL = 10  # loads tried per kill, should kills keep landing too late in them
PROMPT_VOCAB = 512  # prompt token ids stay below this, so that tiny test models serve them too
# --guided: every third stream is held to this schema (and goes on past it, as ignore_eos asks)
GUIDE_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}, "tag": {"enum": ["a", "b", "c"]}},
    "required": ["id", "ok", "tag"],
    "additionalProperties": False,
}


@dataclass
class Stream:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish: str | None = None
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each event
    error: str | None = None
    sent: float = 0.0


def _bodies(count: int, max_tokens: int, model: str = "chaos", guided: bool = False) -> list[dict]:
    """Half greedy, half seeded sampling; prompts of different lengths as token ids; `guided`: every
    third held to GUIDE_SCHEMA."""
    rng = random.Random(0)
    bodies = []
    for i in range(count):
        body = {
            "model": model,
            "prompt": [rng.randrange(PROMPT_VOCAB) for _ in range(rng.randint(4, 48))],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        body.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i})
        if guided and i % 3 == 0:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "chaos", "schema": GUIDE_SCHEMA}}
        bodies.append(body)
    return bodies


def _opens_with_a_guided_object(text: str) -> bool:
    """Does the text begin with an object GUIDE_SCHEMA allows (what follows it is ignore_eos's)?"""
    try:
        value, _ = json.JSONDecoder().raw_decode(text)
    except json.JSONDecodeError:
        return False
    properties = GUIDE_SCHEMA["properties"]
    return (
        isinstance(value, dict)
        and list(value) == list(properties)
        and type(value["id"]) is int
        and 0 <= value["id"] <= 999
        and type(value["ok"]) is bool
        and value["tag"] in properties["tag"]["enum"]
    )


class Server:
    def __init__(self, model: str, port: int, log: Path, extra: list[str]) -> None:
        self.port, self.base_url, self.log = port, f"http://127.0.0.1:{port}", log
        with open(log, "wb") as out:
            self.proc = start_server(
                ["--model", model, "--served-model-name", "chaos", "--port", str(port), *extra], stdout=out, stderr=subprocess.STDOUT
            )
        self.descendants: set[int] = set()

    def last_errors(self, lines: int = 5) -> str:
        """The last error lines of the server's log (all of its tail where none is marked an error)."""
        tail = self.log.read_text(errors="replace").splitlines()[-200:]
        return "\n".join(([line for line in tail if "error" in line.lower()] or tail)[-lines:])

    @contextlib.contextmanager
    def _control(self) -> Iterator[ControlBlock]:
        """The server's control block, attached for one look."""
        control = ControlBlock.attach(str(self.port))
        try:
            yield control
        finally:
            control.close()

    def actors(self) -> dict[str, list[int]]:
        """Live pids by actor kind, from the control block."""
        pids: dict[str, list[int]] = {}
        with self._control() as control:
            for (_, kind), slot in zip(control.actors, control.slots):
                pids.setdefault(kind, []).append(int(slot["pid"]))
        return pids

    def spares_set_up(self, kind: str) -> bool:
        """No warm spare of `kind` is on its way (a kill meanwhile would find none ready and start cold)."""
        with self._control() as control:
            return not any(k == kind and slot["spare_pid"] == SPARE_STARTING for (_, k), slot in zip(control.actors, control.slots))

    def epoch(self) -> int:
        with self._control() as control:
            return int(control.epoch)

    def restarts(self, kind: str) -> int:
        """Restarts of `kind`'s actors so far (a restart that keeps the epoch counts too)."""
        with self._control() as control:
            return sum(int(slot["restarts"]) for (_, k), slot in zip(control.actors, control.slots) if k == kind)

    def remember_processes(self) -> None:
        try:
            self.descendants |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def stop(self) -> int:
        """SIGINT, then what is left: orphaned processes."""
        self.remember_processes()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

        def alive() -> int:
            count = 0
            for pid in self.descendants:
                try:
                    count += psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    pass
            return count

        deadline = time.monotonic() + 10  # multiprocessing's resource tracker leaves a moment after the supervisor
        while alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return alive()


async def _stream(http: aiohttp.ClientSession, body: dict, out: Stream) -> Stream:
    """Fills `out` as events arrive, so that a watcher sees the stream progress."""
    out.sent = time.monotonic()
    try:
        async with http.post("/v1/completions", json=body) as reply:
            if reply.status != 200:
                out.error = f"HTTP {reply.status}: {await reply.text()}"
                return out
            async for event in sse_events(reply):
                if "error" in event:
                    out.error = event["error"]["message"]
                    return out
                out.arrivals.append(time.monotonic())
                choice = event["choices"][0]
                out.text += choice["text"]
                out.token_ids += choice.get("token_ids") or []
                out.finish = choice["finish_reason"] or out.finish
    except aiohttp.ClientError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _load(http: aiohttp.ClientSession, bodies: list[dict], streams: list[Stream] | None = None) -> list[Stream]:
    streams = streams if streams is not None else [Stream() for _ in bodies]
    return await asyncio.gather(*(_stream(http, body, out) for body, out in zip(bodies, streams)))


async def _chaos_round(
    server: Server,
    http: aiohttp.ClientSession,
    bodies: list[dict],
    kind: str,
    kills: int,
    sig: signal.Signals,
    rng: random.Random,
    burst_gap: float | None = None,
) -> tuple[list[Stream], list[tuple[float, float]], int, int]:
    """One load while `kills` signals hit `kind`; returns the streams, and for each kill when it
    happened and when the supervisor had noticed it (the actor's restart count moved on), how many of the kills
    were answered by promoting a warm spare (a process already running at the kill), and how many started a
    new epoch (a replay that recomputes every stream). Each kill comes after the
    previous one has recovered (the pipeline is healthy and a stream in flight has had a token since
    the restart), at a random point of generation: once the furthest unfinished stream has 5-40% of
    its tokens. A random delay in seconds instead let a fast machine finish the whole load first.
    A kill lands only while streams still have half their tokens to come, so that every kill
    interrupts generation; otherwise the round ends early. `burst_gap`: each kill is a double one, the
    replacement killed that many seconds after the first death (its own successor is not set up yet); the kill's
    times then run from the first death to the supervisor's notice of the second."""
    streams = [Stream() for _ in bodies]
    await _spares_set_up(server, kind)
    load = asyncio.create_task(_load(http, bodies, streams))
    kill_times: list[tuple[float, float]] = []
    promoted = replays = 0
    for _ in range(kills):
        await wait_healthy(http, 120, server.proc)
        await _spares_set_up(server, kind)
        while kill_times and not load.done() and _recovery_ms(streams, *kill_times[-1]) is None:
            await asyncio.sleep(0.01)
        target = rng.uniform(0.05, 0.4) * bodies[0]["max_tokens"]
        while not load.done() and not any(s.finish is None and len(s.token_ids) >= target for s in streams):
            await asyncio.sleep(0.002)
        if not any(s.finish is None and len(s.token_ids) < body["max_tokens"] // 2 for s, body in zip(streams, bodies)):
            break
        before, restarts, epoch = server.actors()[kind], server.restarts(kind), server.epoch()
        pid = rng.choice(before)
        server.remember_processes()
        running = set(server.descendants)
        os.kill(pid, sig)
        killed_at = time.monotonic()
        while server.restarts(kind) == restarts:
            await asyncio.sleep(0.005)
        if burst_gap is not None:  # the replacement dies too, `burst_gap` s after the first death
            await asyncio.sleep(max(0.0, killed_at + burst_gap - time.monotonic()))
            while not (replacements := [p for p in server.actors()[kind] if p not in before and p > 0]):  # a cold start's pid
                await asyncio.sleep(0.005)
            os.kill(replacements[0], sig)
            while server.restarts(kind) == restarts + 1:
                await asyncio.sleep(0.005)
        kill_times.append((killed_at, time.monotonic()))
        replays += server.epoch() != epoch  # the supervisor moves the epoch on before it counts the restart
        while pid in (now := server.actors()[kind]) and time.monotonic() < killed_at + 5:
            await asyncio.sleep(0.005)
        promoted += bool((set(now) - set(before)) & running)  # the replacement was already running: a spare
    return await load, kill_times, promoted, replays


def _longest_pause_ms(streams: list[Stream], killed_at: float, noticed_at: float) -> float | None:
    """The longest wait, over the streams streaming at a kill, between two of its tokens from its last one
    before the kill to its first one after the pipeline's recovery (the first token after the restart
    began, _recovery_ms): tokens already on their way can arrive between the kill and the stall."""
    recovery = _recovery_ms(streams, killed_at, noticed_at)
    if recovery is None:
        return None
    recovered_at = killed_at + recovery / 1e3
    pauses = []
    for s in streams:
        if s.arrivals and s.arrivals[0] <= killed_at and s.arrivals[-1] >= recovered_at:
            window = [t for t in s.arrivals if max(t for t in s.arrivals if t <= killed_at) <= t <= recovered_at]
            window.append(next(t for t in s.arrivals if t >= recovered_at) if window[-1] < recovered_at else window[-1])
            pauses.append(max((b - a for a, b in zip(window, window[1:])), default=0.0))
    return max(pauses) * 1e3 if pauses else None


async def _kill_in_start_up(server: Server, kind: str) -> dict:
    """SIGKILL the first actor of `kind` once, as soon as it runs during the server's start-up (the control
    block lists its pid); returns when it was killed and how long the server then took to be healthy."""
    started = time.monotonic()
    while True:
        if server.proc.poll() is not None:
            raise ServerExited(f"the server exited with code {server.proc.returncode} during start-up")
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):  # no control block yet, or not filled
            if pids := [p for p in server.actors().get(kind, []) if p > 0]:
                os.kill(pids[0], signal.SIGKILL)
                return {"kind": kind, "killed_at_s": round(time.monotonic() - started, 2)}
        await asyncio.sleep(0.01)


async def _spares_set_up(server: Server, kind: str) -> None:
    """Crashes in service come long after start-up and after each other: a kill waits for the warm
    spares of its kind to be set up, as they would be by then."""
    while not server.spares_set_up(kind):
        await asyncio.sleep(0.01)


def _recovery_ms(streams: list[Stream], killed_at: float, noticed_at: float) -> float | None:
    """From a kill to the next token, after the restart began, of a stream in flight at the kill."""
    nexts = [
        next(t for t in s.arrivals if t > noticed_at) for s in streams if s.sent < killed_at and s.arrivals and s.arrivals[-1] > noticed_at
    ]
    return (min(nexts) - killed_at) * 1e3 if nexts else None


def _leaked_pages(info: dict) -> int:
    gauges = info["scheduler"]
    return gauges["used_pages"] - gauges["cached_pages"] if gauges["running"] == gauges["waiting"] == 0 else -1


async def run(args: argparse.Namespace) -> dict:
    port = free_port()
    # float32 unless told otherwise: a replayed stream runs in other batches than its reference, and
    # only fp32 keeps batch-shape rounding below what flips a greedy or seeded draw
    dtype = [] if "--dtype" in args.serve_args else ["--dtype", "float32"]
    extra = [
        "--api-workers",
        str(args.api_workers),
        "--hang-timeout",
        str(args.hang_timeout),
        "--watchdog-timeout",
        str(args.hang_timeout),
        *dtype,
        *args.serve_args,
    ]
    server = Server(args.model, port, Path(tempfile.mkdtemp(prefix="ringllm-chaos-")) / "serve.log", extra)
    rng = random.Random(args.seed)
    summary: dict = {"requests": 0, "completed": 0, "mismatched": 0, "lost": 0, "kills": {}, "promoted": {}, "replays": {}}
    summary["recovery_ms"] = {}
    summary["longest_pause_ms"] = {}
    recoveries: list[float] = []
    try:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(server.base_url, timeout=timeout, connector=connector()) as http:
            try:
                if args.startup_kill:
                    summary["startup_kill"] = await _kill_in_start_up(server, args.startup_kill)
                await wait_healthy(http, 300, server.proc)
            except ServerExited as exc:
                raise SystemExit(f"{exc}; its log ({server.log}) ends:\n{server.last_errors()}") from None
            summary["server_config"] = await server_config(http)
            bodies = _bodies(args.requests, args.max_tokens, guided=args.guided)
            reference = await _load(http, bodies)
            if failed := [s.error for s in reference if s.error or s.finish is None]:
                raise RuntimeError(f"the fault-free load failed: {failed[:3]}")
            if args.control:  # what a fault-free load changes by itself (where batches round by their size: bf16 on a GPU)
                summary["control_mismatched"] = sum(_changed(got, want) for got, want in zip(await _load(http, bodies), reference))
            summary["mismatched_by_kind"] = {}
            if args.guided:
                summary["invalid_json"] = 0
            for entry in args.kinds:  # KIND, or KIND:stop / KIND:kill to override --signal for it
                kind, _, how = entry.partition(":")
                sig = signal.SIGSTOP if (how or args.signal) == "stop" else signal.SIGKILL
                burst_gap = args.burst_gap if how == "twice" else None
                done, kind_recoveries, kind_pauses = 0, [], []
                for _ in range(MAX_ROUNDS_PER_KILL * args.kills):
                    if done == args.kills:
                        break
                    streams, kill_times, promoted, replays = await _chaos_round(
                        server, http, bodies, kind, args.kills - done, sig, rng, burst_gap
                    )
                    done += len(kill_times)
                    summary["promoted"][entry] = summary["promoted"].get(entry, 0) + promoted
                    summary["replays"][entry] = summary["replays"].get(entry, 0) + replays
                    kind_recoveries += [ms for at in kill_times if (ms := _recovery_ms(streams, *at)) is not None]
                    kind_pauses += [ms for at in kill_times if (ms := _longest_pause_ms(streams, *at)) is not None]
                    for got, want, body in zip(streams, reference, bodies):
                        summary["requests"] += 1
                        if got.error or got.finish is None:
                            summary["lost"] += 1
                        elif _changed(got, want):
                            summary["mismatched"] += 1
                            summary["mismatched_by_kind"][entry] = summary["mismatched_by_kind"].get(entry, 0) + 1
                        else:
                            summary["completed"] += 1
                        if "response_format" in body and not _opens_with_a_guided_object(got.text):
                            summary["invalid_json"] += 1
                    await wait_healthy(http, 120, server.proc)
                summary["kills"][entry] = done
                recoveries += kind_recoveries
                summary["longest_pause_ms"][entry] = round(max(kind_pauses)) if kind_pauses else None
                summary["recovery_ms"][entry] = (
                    [round(statistics.median(kind_recoveries)), round(max(kind_recoveries))] if kind_recoveries else None
                )
            for _ in range(100):  # the last aborts and finishes settle
                async with http.get("/server_info") as reply:
                    if (leaked := _leaked_pages(await reply.json())) >= 0:
                        break
                await asyncio.sleep(0.1)
            summary["leaked_pages"] = leaked
    finally:
        summary["orphans"] = server.stop()
        summary["leaked_segments"] = len(list_segments(server_prefix(str(port))))
    summary["recovery_ms_p50"] = round(statistics.median(recoveries)) if recoveries else None
    summary["recovery_ms_max"] = round(max(recoveries)) if recoveries else None
    return summary


def _changed(got: Stream, want: Stream) -> bool:
    return (got.text, got.token_ids, got.finish) != (want.text, want.token_ids, want.finish)


def _kind_entry(entry: str) -> str:
    kind, _, how = entry.partition(":")
    if kind not in KINDS or how not in ("", "stop", "kill", "twice"):
        raise argparse.ArgumentTypeError(f"{entry!r} is not KIND or KIND:stop|kill|twice with KIND among {', '.join(KINDS)}")
    return entry


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.splitlines()[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--model", help="a model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--quick", action="store_true", help="one kill per kind, 64 short streams: minutes, not more")
    parser.add_argument(
        "--kinds",
        nargs="+",
        type=_kind_entry,
        default=list(BACKEND_KINDS),
        help="actor kinds, each KIND or KIND:stop / KIND:kill to give it its own signal, or KIND:twice for a SIGKILL of it and "
        "another of its replacement --burst-gap later (the summary keys them as given)",
    )
    parser.add_argument("--kills", type=int, default=5, help="kills per actor kind")
    parser.add_argument("--signal", choices=["kill", "stop"], default="kill", help="SIGKILL, or SIGSTOP (a hang)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--api-workers", type=int, default=API_WORKERS)
    parser.add_argument("--hang-timeout", type=float, default=3.0, help="also the engine's watchdog timeout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--burst-gap", type=float, default=0.5, help="with KIND:twice, the seconds from the first death to the replacement's kill"
    )
    parser.add_argument("--startup-kill", choices=KINDS, help="also SIGKILL this kind's actor once while the server starts up")
    parser.add_argument("--control", action="store_true", help="one more fault-free load first: control_mismatched, its changed streams")
    parser.add_argument("--guided", action="store_true", help="hold every third stream to a JSON schema (structured output)")
    parser.add_argument("--out", type=Path, help="also append the summary, with the command, to this JSON file")
    parser.add_argument("serve_args", nargs="*", help="more `ringllm serve` flags, after --")
    args = parser.parse_args(argv)
    if args.quick:
        args.kills = 1
    if args.model is None:
        from runtime.models.source import default_model_dir

        args.model = str(default_model_dir())
    summary = asyncio.run(run(args))
    if args.out is not None:
        runs = orjson.loads(args.out.read_bytes())["runs"] if args.out.exists() else []
        command = " ".join(["python -m benchmarks.chaos", *(sys.argv[1:] if argv is None else argv)])
        runs.append({"command": command, **provenance(), "summary": summary})
        args.out.write_bytes(orjson.dumps({"runs": runs}, option=orjson.OPT_INDENT_2) + b"\n")
    print(orjson.dumps(summary).decode())
    return summary


if __name__ == "__main__":
    main()
