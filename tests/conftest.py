"""Shared fixtures: unique server names, real supervisor processes, and a leak guard that fails
any test leaving a ringllm segment in /dev/shm or a child process behind."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import psutil
import pytest

from benchmarks.server import stop_with_parent
from transport.segment import list_segments, remove_segments, server_prefix

if TYPE_CHECKING:
    import torch

    from runtime import LLM

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        if value := predicate():
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def log_events(log: bytes | Path, event: str | None = None, **match: object) -> list[dict]:
    """The structured-log lines of a log (a file or its bytes) with this event and these fields. A line still being
    written (no newline yet) is left for the next read."""
    data = log.read_bytes() if isinstance(log, Path) else log
    lines = (orjson.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines() if line.startswith(b"{"))
    return [e for e in lines if (event is None or e.get("event") == event) and all(e.get(k) == v for k, v in match.items())]


def _our_children() -> list[psutil.Process]:
    """Child processes, less multiprocessing's resource tracker (it lives as long as pytest)."""
    kids = psutil.Process().children(recursive=True)
    return [p for p in kids if "resource_tracker" not in " ".join(_cmdline(p))]


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _descends_from(proc: psutil.Process, pids: set[int]) -> bool:
    try:
        return any(parent.pid in pids for parent in proc.parents())
    except psutil.Error:
        return False


_our_ports: set[str] = set()


def _our_segments() -> set[str]:
    """Segments of servers this pytest process named: a suite running beside it is not ours."""
    return {s for s in list_segments() if any(s.startswith(server_prefix(p)) for p in _our_ports)}


@pytest.fixture(autouse=True)
def leak_guard() -> Iterator[None]:
    """Whatever a test starts (processes, segments) must be gone when it ends; servers shared by
    the session or a module existed before the test (with what they restart under it) and are checked
    when they stop and when the session ends."""
    segments_before = _our_segments()
    children_before = {p.pid for p in _our_children()}

    def new_children() -> list[psutil.Process]:
        return [p for p in _our_children() if p.pid not in children_before and not _descends_from(p, children_before)]

    yield
    try:
        wait_for(lambda: not new_children(), 10, "child processes to exit")
    except AssertionError:
        stray = new_children()
        for proc in stray:
            proc.kill()
        pytest.fail(f"test left child processes: {[(p.pid, _cmdline(p)) for p in stray]}")
    leaked = sorted(_our_segments() - segments_before)
    if leaked:
        for name in leaked:
            remove_segments(name)
        pytest.fail(f"test left shared-memory segments: {leaked}")


_PORTS_PER_WORKER = 2000
_next_port = itertools.count(20000 + _PORTS_PER_WORKER * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]))


def free_port() -> int:
    """A TCP port no other test of this run is handed. Each xdist worker counts up through its own range below the
    kernel's ephemeral ports, so a port a test frees (a killed server it restarts at the same URL) and the segments
    named after it stay that test's; ports in use or with segments left by another run are skipped."""
    while True:
        port = next(_next_port)
        if list_segments(server_prefix(str(port))):
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _our_ports.add(str(port))
        return port


@pytest.fixture
def server() -> str:
    """A free TCP port, used as the server name that prefixes every segment."""
    port = str(free_port())
    assert not list_segments(server_prefix(port))
    return port


def ringllm(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the real `ringllm` command line."""
    result = subprocess.run([sys.executable, "-m", "actors.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
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
            raise AssertionError(f"supervisor ignored signal {sig} for {timeout} s") from None


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
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=os.environ.copy(),
                preexec_fn=stop_with_parent,
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


def pytest_configure(config) -> None:
    """Under pytest-xdist (`make test` runs a worker a core), each worker and the servers it starts keep to
    their own share of the cores: a CPU engine sizes its threads to its cores, and two engines whose
    threads share cores stall at every barrier for each other."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if worker is not None and len(cores) >= count:
        os.sched_setaffinity(0, cores[int(worker.removeprefix("gw")) :: count])


# The files whose servers, kills and waits take longest, longest first. `make test` hands whole files to its
# workers in collection order (--dist loadfile --no-loadscope-reorder): these go first, so that the short files
# fill in at the end and no worker is left running a long file alone.
LONGEST_FILES = (
    "test_recovery.py",
    "test_serving.py",
    "test_speculative.py",
    "test_supervisor.py",
    "test_structured_output.py",
    "test_tensor_parallel.py",
    "test_router_workers.py",
    "test_disaggregation.py",
    "test_multi_node.py",
    "test_bench.py",
    "test_kv_tiers.py",
    "test_parity.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_sessionfinish(session, exitstatus) -> None:
    """After the whole suite: none of its ringllm segments in /dev/shm and no child process may remain."""
    leftovers = sorted(_our_segments())
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
def tiny_smol(smollm2: Path, tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's whole vocabulary and tokenizer: any text it is sent, or a
    benchmark's ids below 10,000, are its own tokens, at a fraction of SmolLM2's load and step time."""
    from tests.tiny_models import build

    folder = tmp_path_factory.mktemp("tiny-smol")
    return with_tokenizer(build("llama", folder / "weights", vocab_size=49152), smollm2, folder / "model")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    from runtime.models.source import default_model_dir

    return default_model_dir()


@dataclass
class Server:
    """A real `ringllm serve` process."""

    port: int
    model: str
    proc: subprocess.Popen
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, headers: dict[str, str] | None = None) -> dict:
        """The JSON body of a GET, whatever its status (a 503 from /health is an answer too)."""
        return self.call("GET", path, headers=headers)

    def call(self, method: str, path: str, body: object = None, headers: dict[str, str] | None = None) -> dict:
        """The JSON body of any request (a JSON body, if given), whatever its status."""
        import urllib.error
        import urllib.request

        data = None if body is None else orjson.dumps(body)
        headers = {**(headers or {}), **({"Content-Type": "application/json"} if data is not None else {})}
        request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return orjson.loads(reply.read())
        except urllib.error.HTTPError as reply:
            return orjson.loads(reply.read())

    def used_pages(self) -> int:
        return self.get("/server_info")["scheduler"]["used_pages"]

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> float:
        """Signal it and wait; returns the seconds it took to exit."""
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"ringllm serve ignored signal {sig} for {timeout} s") from None
        return time.monotonic() - started


def launch(model_dir: Path, log: Path, *args: str, model: str = "model", ready: bool = True, port: int | None = None) -> Server:
    """`ringllm serve`, in float32 unless args say otherwise: tests compare with fp32 transformers. No warm
    spares unless asked for: on the 2-core machine their set-up would compete with each test's load
    (benchmarks.chaos, run by tests/test_recovery.py, and tests/test_supervisor.py cover them). `ready`:
    return once it is ready, else at once. `port`: a free one unless given."""
    port = port or free_port()
    if "--dtype" not in args:
        args = (*args, "--dtype", "float32")
    if "--warm-spares" not in args:
        args = (*args, "--no-warm-spares")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "actors.cli",
                "serve",
                "--model",
                str(model_dir),
                "--served-model-name",
                model,
                "--port",
                str(port),
                *args,
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=stop_with_parent,
        )
    server = Server(port, model, proc, log)
    if not ready:
        return server
    try:
        wait_for(lambda: proc.poll() is not None or b'"topology_ready"' in log.read_bytes(), 180, "the server to be ready")
        assert proc.poll() is None, log.read_text()[-5000:]
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


@pytest.fixture(scope="session")
def smol_server(smollm2: Path, tmp_path_factory) -> Iterator[Server]:
    """SmolLM2-135M-Instruct behind two api workers, shared by the whole session."""
    server = launch(smollm2, tmp_path_factory.mktemp("smol") / "serve.log", "--api-workers", "2", "--body-timeout", "3", model="smollm2")
    yield server
    server.stop()
    assert not list_segments(server_prefix(str(server.port)))


def with_tokenizer(model_dir: Path, tokenizer_dir: Path, into: Path) -> Path:
    """A copy of a tokenizer-less tiny model that borrows SmolLM2's tokenizer and chat template, for serving."""
    import shutil

    into.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        shutil.copy(item, into / item.name)
    for item in [*tokenizer_dir.glob("tokenizer*"), *tokenizer_dir.glob("chat_template*")]:
        shutil.copy(item, into / item.name)
    return into


class KeptPool:
    """Engines over a KV pool whose bytes outlive them, as a keeper actor holds them (`kv_memory`; by
    default a tensor of this process), and one scheduler: `revive` is a dead engine's replacement over
    the same bytes."""

    def __init__(
        self,
        llm: LLM,
        kv_memory: Callable[[int, int], torch.Tensor] | None = None,
        host_memory: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        """`host_memory`: where the host KV tier lives across engines (--enable-hierarchical-cache)."""
        from runtime.scheduler.scheduler import Scheduler

        self.llm, self.memory, self.kv_memory, self.host_memory = llm, None, kv_memory or self._bytes, host_memory
        self.engine = self.revive()
        cfg, tiers = self.engine.model_config, self.engine.tiers
        host_pages, disk = (tiers.num_pages, tiers.disk) if tiers else (0, None)
        self.scheduler = Scheduler(
            llm.config, self.engine.num_pages, cfg.eos_token_ids, cfg.max_position, host_pages, disk, window=cfg.window
        )

    def _bytes(self, size: int, pages: int = 0) -> torch.Tensor:
        import torch

        if self.memory is None:
            self.memory = torch.zeros(size, dtype=torch.uint8)
        return self.memory

    def revive(self):
        from runtime.engine.engine import Engine

        self.engine = Engine(self.llm.model_dir, self.llm.config, kv_memory=self.kv_memory, host_memory=self.host_memory)
        return self.engine

    def step(self) -> None:
        plan = self.scheduler.schedule()
        self.scheduler.update(plan.step, self.engine.launch(plan).result())

    def run(self) -> None:
        while self.scheduler.has_work():
            self.step()
