"""Shadow mode: a candidate configuration beside the live server, on a sample of its traffic.

`ringllm serve ... --shadow-engine FLAGS` starts a second, complete server: `ringllm serve` with the live server's
own flags and FLAGS on top, on a free port of 127.0.0.1, without API keys, with one api worker (plan). The
supervisor runs it (ShadowProcess): it starts it once its own actors are ready, so the live server serves while
the shadow loads, and stops it with them; the kernel stops it too if the supervisor dies (a parent-death signal).
A shadow that exits is logged (`shadow_failed`) and not started again: the live server never depends on it.

Each api worker sends a share of its answered requests (--shadow-fraction, picked by a hash of the request id, so
the same ids are picked every time) to the shadow again (Mirror): after the live answer has gone out, off the
request's path, whole, with the seed the live request sampled with. It compares the shadow's token ids and finish
reasons with those the client got, logs each divergence (`shadow_divergence`) and counts every outcome in
ringllm:shadow_requests_total. Nothing the shadow answers ever reaches a client."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import structlog

from actors.control import ActorState, ControlBlock, ShadowState
from actors.pipeline import ServeConfig
from actors.topology import ShadowSpec
from api.traces import compare, complete, whole
from runtime.obs.metrics import MULTIPROC_ENV, metrics
from transport import env
from transport.lifetime import on_parent_death
from transport.segment import remove_segments, server_prefix

log = structlog.get_logger()
MIRRORS_IN_FLIGHT = 4  # an api worker's requests to the shadow at once; a sampled request beyond them is skipped
SHADOW_TIMEOUT_S = 600.0  # the longest a mirrored request may take (a candidate may be slower than the live server)
OUTCOMES = ("match", "diverged", "failed", "skipped")
LOG_TAIL_BYTES = 2000  # of the shadow's output, logged when it fails


def plan(config: ServeConfig, supervisor_flags: list[str]) -> ShadowSpec:
    """The shadow of a server: its flags (`supervisor_flags`: the supervisor's and the log format) with
    --shadow-engine's on top, on a free port of 127.0.0.1, without keys, with one api worker; its output goes to a
    file named after the live server's port."""
    assert config.shadow_engine is not None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # no keys: cache_salt_by_key would have no tenants to tell apart
    alone = {"port": port, "host": "127.0.0.1", "api_keys": (), "api_workers": 1, "allowed_hosts": (), "cache_salt_by_key": False}
    base = dataclasses.replace(config, shadow_engine=None, **alone)
    command = (sys.executable, "-m", "actors.cli", "serve", *base.to_cli_args(), *supervisor_flags, *shlex.split(config.shadow_engine))
    return ShadowSpec(command, port, str(Path(tempfile.gettempdir()) / f"ringllm-shadow-{config.port}.log"))


class ShadowProcess:
    """The supervisor's handle on its shadow server; its state goes in the control block (ControlBlock.shadow)."""

    def __init__(self, spec: ShadowSpec, control: ControlBlock) -> None:
        self.spec, self.control = spec, control
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """In its own session (a terminal's Ctrl-C is the live server's to pass on), without the live server's key
        and metrics folder, stopped by SIGINT if this process dies."""
        hidden = (env.API_KEY, MULTIPROC_ENV)
        try:
            with open(self.spec.log, "wb") as out:
                self.proc = subprocess.Popen(
                    self.spec.command,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={key: value for key, value in os.environ.items() if key not in hidden},
                    start_new_session=True,
                    preexec_fn=functools.partial(on_parent_death, signal.SIGINT),
                )
        except OSError as exc:  # its log not writable (another user's, say): the live server runs on without it
            self.control.shadow = ShadowState.FAILED
            log.error("shadow_failed", error=str(exc), log=self.spec.log)
            return
        self.control.shadow = ShadowState.STARTING
        log.info("shadow_starting", pid=self.proc.pid, url=self.spec.url, log=self.spec.log, command=shlex.join(self.spec.command))

    @property
    def pid(self) -> int | None:
        """Its process while it runs (not yet reaped)."""
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    def poll(self) -> None:
        """Note its exit (a failure: the live server runs on without it) or that it has become ready."""
        if self.proc is None or self.proc.returncode is not None:
            return
        if (code := self.proc.poll()) is not None:
            self.control.shadow = ShadowState.FAILED
            remove_segments(server_prefix(str(self.spec.port)))  # what a shadow that died uncleanly left in /dev/shm
            log.error("shadow_failed", exitcode=code, log=self.spec.log, output=_tail(Path(self.spec.log)))
        elif self.control.shadow == ShadowState.STARTING and self._ready():
            self.control.shadow = ShadowState.READY
            log.info("shadow_ready", url=self.spec.url)

    def _ready(self) -> bool:
        """Whether every actor of its topology is ready, read from its control block."""
        assert self.proc is not None
        try:
            block = ControlBlock.attach(str(self.spec.port))
        except (FileNotFoundError, ValueError):  # not made yet, or made and not yet filled in
            return False
        try:
            return block.supervisor_pid == self.proc.pid and bool((block.slots["state"] == ActorState.READY).all())
        finally:
            block.close()

    def interrupt(self) -> None:
        """Ask it to stop now (SIGINT: it stops its actors and removes its segments)."""
        if self.pid is not None:
            self.proc.send_signal(signal.SIGINT)  # type: ignore[union-attr]

    def join(self, timeout: float) -> None:
        """Wait for it to have stopped; kill it after `timeout` seconds."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("shadow_killed_at_stop", pid=self.proc.pid)
            self.proc.kill()
            self.proc.wait()
        remove_segments(server_prefix(str(self.spec.port)))  # none where it stopped cleanly


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as out:
            out.seek(max(0, out.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            return out.read().decode(errors="replace")
    except OSError as exc:  # removed meanwhile
        return f"(its log cannot be read: {exc})"


class Mirror:
    """An api worker's side of shadow mode: which answered requests go to the shadow again, and what it answers."""

    def __init__(self, spec: ShadowSpec, flags: str, fraction: float, state: Callable[[], ShadowState]) -> None:
        self.spec, self.flags, self.fraction, self.state = spec, flags, fraction, state
        self.outcomes = metrics().shadow_requests
        for outcome in OUTCOMES:  # exported at 0 from the start, as Prometheus advises
            self.outcomes.labels(outcome)
        self._tasks: set[asyncio.Task] = set()
        self._http: aiohttp.ClientSession | None = None
        self._config: dict | None = None  # the shadow's own report of its settings, once it has answered
        self._asked_config = False

    def sampled(self, rid: str) -> bool:
        """Whether the request `rid` is in the sample: by a hash of its id, the same on every run and worker."""
        digest = hashlib.blake2b(rid.encode(), digest_size=8).digest()
        return int.from_bytes(digest) < self.fraction * 2**64

    def offer(self, rid: str, body: dict, choices: list[dict]) -> None:
        """A request answered in full: `body` as a copy of it is sent (its seed given), `choices` each choice's token
        ids and finish reason as the client got them. A sampled one goes to the shadow unless it is not ready or
        MIRRORS_IN_FLIGHT are under way (then it counts as skipped)."""
        if not self.sampled(rid):
            return
        if self.state() != ShadowState.READY or len(self._tasks) >= MIRRORS_IN_FLIGHT:
            self.outcomes.labels("skipped").inc()
            return
        self._spawn(self._check(rid, whole(body), choices))

    async def _check(self, rid: str, body: dict, live: list[dict]) -> None:
        try:
            answer = await complete(self._session(), self.spec.url, body)
        except (RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
            log.warning("shadow_request_failed", rid=rid, error=str(exc) or type(exc).__name__)
            self.outcomes.labels("failed").inc()
            return
        # a chat whose text parses as tool calls reports "tool_calls" for a stop: the live record holds the stop
        answer = [c | {"finish_reason": "stop"} if c["finish_reason"] == "tool_calls" else c for c in answer]
        # token ids and finish reasons only: a candidate's kernels may round a log-probability otherwise
        found = compare(0, live, answer, math.inf)
        self.outcomes.labels("diverged" if found else "match").inc()
        for d in found:
            lengths = (
                {}
                if d.kind == "choices"
                else {"live_tokens": len(live[d.choice]["token_ids"]), "shadow_tokens": len(answer[d.choice]["token_ids"])}
            )
            where = {"position": d.position, "live_token": d.recorded, "shadow_token": d.replayed}
            log.warning("shadow_divergence", rid=rid, choice=d.choice, kind=d.kind, **where, **lengths, detail=d.detail or None)

    def report(self) -> dict[str, Any]:
        """What /server_info says of the shadow: its flags, URL, state, sample and log, and the settings it reports
        (asked for once it is ready; null until it has answered)."""
        state = self.state()
        if state == ShadowState.READY and not self._asked_config:
            self._asked_config = True
            self._spawn(self._ask_config())
        return {
            "flags": self.flags,
            "url": self.spec.url,
            "state": state.name.lower(),
            "fraction": self.fraction,
            "log": self.spec.log,
            "config": self._config,
        }

    async def _ask_config(self) -> None:
        try:
            async with self._session().get(self.spec.url + "/server_info") as reply:
                self._config = orjson.loads(await reply.read())["config"]
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
            log.warning("shadow_server_info_failed", error=str(exc) or type(exc).__name__)
            self._asked_config = False  # asked again at the next /server_info

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SHADOW_TIMEOUT_S))
        return self._http

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Drop the mirrors under way and the connections to the shadow."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
