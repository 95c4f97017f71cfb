"""Shared fixtures: unique server names, real supervisor processes, and a leak guard that fails
any test leaving a ringllm segment in /dev/shm or a child process behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import psutil
import pytest

from transport.segment import list_segments, remove_segments, server_prefix

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        if value := predicate():
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def _our_children() -> list[psutil.Process]:
    """Child processes, less multiprocessing's resource tracker (it lives as long as pytest)."""
    kids = psutil.Process().children(recursive=True)
    return [p for p in kids if "resource_tracker" not in " ".join(_cmdline(p))]


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


@pytest.fixture(autouse=True)
def leak_guard() -> Iterator[None]:
    before = set(list_segments())
    yield
    try:
        wait_for(lambda: not _our_children(), 10, "child processes to exit")
    except AssertionError:
        stray = _our_children()
        for proc in stray:
            proc.kill()
        pytest.fail(f"test left child processes: {[(p.pid, _cmdline(p)) for p in stray]}")
    leaked = sorted(set(list_segments()) - before)
    if leaked:
        for name in leaked:
            remove_segments(name)
        pytest.fail(f"test left shared-memory segments: {leaked}")


@pytest.fixture
def server() -> str:
    """A free TCP port, used as the server name that prefixes every segment."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    assert not list_segments(server_prefix(port))
    return port


def ringllm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the real `ringllm` command line."""
    result = subprocess.run([sys.executable, "-m", "runtime.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if check and result.returncode:
        raise AssertionError(f"ringllm {' '.join(args)} failed: {result.stderr}")
    return result


@dataclass
class RunningSupervisor:
    server: str
    proc: subprocess.Popen
    log: Path

    def status(self) -> list[dict]:
        return orjson.loads(ringllm("status", "--json", "--port", self.server).stdout)

    def actor(self, name: str) -> dict:
        return next(row for row in self.status() if row["name"] == name)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"supervisor ignored signal {sig} for {timeout} s")


@pytest.fixture
def start_supervisor(server: str, tmp_path: Path, monkeypatch) -> Iterator[Callable[..., RunningSupervisor]]:
    """Start `python -m actors.supervisor TOPOLOGY` as a real process and wait until it is ready."""
    monkeypatch.setenv("RINGLLM_PROBE_DIR", str(tmp_path))
    started: list[RunningSupervisor] = []

    def start(topology: str, *args: str) -> RunningSupervisor:
        log = tmp_path / f"supervisor-{len(started)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "actors.supervisor", topology, "--port", server, *args],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy(),
            )
        running = RunningSupervisor(server, proc, log)
        started.append(running)
        wait_for(lambda: proc.poll() is not None or b'"topology_ready"' in log.read_bytes(), 60, "the topology to be ready")
        assert proc.poll() is None, log.read_text()
        return running

    yield start
    for running in started:
        if running.proc.poll() is None:
            running.stop()
        if running.proc.returncode not in (0, -signal.SIGKILL):
            print(running.log.read_text())


def pytest_sessionfinish(session, exitstatus) -> None:
    """After the whole suite: no ringllm segment in /dev/shm and no child process may remain."""
    leftovers = list_segments()
    stray = _our_children()
    if leftovers or stray:
        print(f"\nleft behind after the suite: segments {leftovers}, processes {[p.pid for p in stray]}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Callable[[str], Path]:
    """A folder per architecture, built once per session."""
    from tests.tiny_models import build

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from runtime.default_model import default_model_dir

    return default_model_dir()
