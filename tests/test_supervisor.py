"""The supervisor over real processes: status, restarts under a new epoch after SIGKILL and
SIGSTOP, old-epoch frames discarded, clean stop, stale-segment sweep and idle cost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import psutil
import pytest

from benchmarks.server import stop_with_parent
from tests.conftest import ROOT, RunningSupervisor, log_events, ringllm, wait_for
from tests.probe_actors import report_path
from transport.segment import list_segments, remove_segments, server_prefix

CHAIN = "tests.probe_actors:chain"


def sink_report(server: str, pid: int | None = None) -> dict | None:
    try:
        with open(report_path(server), "rb") as f:
            report = orjson.loads(f.read())
    except FileNotFoundError:
        return None
    return report if pid is None or report["pid"] == pid else None


def accepted_in(report: dict | None, epoch: int) -> int:
    return report["accepted"].get(str(epoch), 0) if report else 0


def restarted(sup, name: str, old_pid: int) -> dict | None:
    row = sup.actor(name)
    return row if row["pid"] != old_pid and row["restarts"] == 1 else None


def test_status_lists_every_actor(start_supervisor, server):
    sup = start_supervisor(CHAIN)
    rows = sup.status()
    assert [r["name"] for r in rows] == ["source", "echo", "sink"]
    keys = ["name", "kind", "pid", "state", "epoch", "restarts", "heartbeat_age_s", "spare_pid", "spare_state"]
    for row in rows:
        assert list(row) == keys
        assert psutil.pid_exists(row["pid"]) and row["epoch"] == 1 and row["restarts"] == 0 and row["state"] == "ready"
        assert 0 <= row["heartbeat_age_s"] < 5
        assert row["spare_pid"] is row["spare_state"] is None  # no actor of the chain has a warm spare
    table = ringllm("status", "--port", server).stdout.splitlines()
    assert table[0].split() == keys
    assert [line.split()[0] for line in table[1:]] == ["source", "echo", "sink"]
    wait_for(lambda: accepted_in(sink_report(server), 1) > 50, 20, "frames to flow")
    assert sink_report(server)["errors"] == []


def test_status_without_a_server(server):
    result = ringllm("status", "--port", server, check=False)
    assert result.returncode == 1 and f"no ringllm server on port {server}" in result.stderr


@pytest.mark.parametrize("victim", ["source", "sink"])
def test_sigkill_restarts_under_new_epoch_and_drops_old_frames(start_supervisor, server, victim):
    sup = start_supervisor(CHAIN)
    wait_for(lambda: accepted_in(sink_report(server), 1) > 50, 20, "frames to flow")
    old_pid = sup.actor(victim)["pid"]
    os.kill(old_pid, signal.SIGKILL)

    row = wait_for(lambda: restarted(sup, victim, old_pid), 20, f"{victim} to restart")
    assert row["epoch"] == 2
    assert not psutil.pid_exists(old_pid)
    new_sink = sup.actor("sink")["pid"]
    report = wait_for(lambda: (r := sink_report(server, new_sink)) and accepted_in(r, 2) > 50 and r, 20, "frames of epoch 2")
    # The rings held a backlog of epoch-1 frames when the victim died: they were dropped, and the
    # epoch-2 stream arrived whole, numbered from 0, checksums intact.
    assert report["stale"] > 0
    assert report["errors"] == []
    assert all(r["epoch"] == 2 for r in sup.status())


def spares(sup: RunningSupervisor, state: str | None = None) -> set[int]:
    """The warm spares `ringllm status` lists (in `state`, if given)."""
    return {row["spare_pid"] for row in sup.status() if row["spare_pid"] is not None and state in (None, row["spare_state"])}


@pytest.mark.slow
def test_a_warm_spare_is_promoted_in_place_of_a_dead_actor_and_replaced(start_supervisor, server):
    """A spare that dies is started again; a killed actor's spare takes its place (its pid, already
    running, in the actor's row) under a new epoch, frames flow again, and a new spare starts. `ringllm
    status` lists each spare, its pid and its state."""
    sup = start_supervisor("tests.probe_actors:spared_chain", "--spare-settle", "0", "--spare-delay", "0.2")
    wait_for(lambda: accepted_in(sink_report(server), 1) > 50, 20, "frames to flow")
    (first,) = wait_for(lambda: spares(sup) or None, 20, "a spare to start")
    assert first in {child.pid for child in psutil.Process(sup.proc.pid).children()}  # a process of the supervisor's
    os.kill(first, signal.SIGKILL)
    (spare,) = wait_for(lambda: (found := spares(sup) - {first}) and found, 20, "the dead spare to be replaced")
    wait_for(lambda: spares(sup, "ready") == {spare}, 20, "the new spare's set-up")  # one still setting up is not promoted
    table = ringllm("status", "--port", server).stdout.splitlines()
    assert [line.split()[-2:] for line in table[1:]] == [["-", "-"], [str(spare), "ready"], ["-", "-"]]
    old_pid = sup.actor("echo")["pid"]
    os.kill(old_pid, signal.SIGKILL)
    row = wait_for(lambda: restarted(sup, "echo", old_pid), 20, "echo to be replaced")
    assert row["pid"] == spare and row["epoch"] == 2
    new_sink = sup.actor("sink")["pid"]
    report = wait_for(lambda: (r := sink_report(server, new_sink)) and accepted_in(r, 2) > 50 and r, 20, "frames of epoch 2")
    assert report["errors"] == []
    assert sup.actor("echo")["spare_state"] in ("waiting", "starting", "ready")
    wait_for(lambda: spares(sup) - {spare} or None, 20, "the next spare")


def hung_lines(sup: RunningSupervisor) -> list[dict]:
    return log_events(sup.log, "actor_hung")


# echo's watchdog (60 s) must not lengthen --hang-timeout: a frozen echo goes after 1.5 s either way
@pytest.mark.slow
@pytest.mark.parametrize("topology", [CHAIN, "tests.probe_actors:watched_chain"], ids=["no-watchdog", "longer-watchdog"])
def test_hung_actor_is_killed_and_restarted(start_supervisor, server, topology):
    sup = start_supervisor(topology, "--hang-timeout", "1.5")
    wait_for(lambda: accepted_in(sink_report(server), 1) > 20, 20, "frames to flow")
    frozen = sup.actor("echo")["pid"]
    os.kill(frozen, signal.SIGSTOP)
    stopped_at = time.monotonic()
    row = wait_for(lambda: restarted(sup, "echo", frozen), 20, "the frozen echo to be replaced")
    assert time.monotonic() - stopped_at < 1.5 + 5
    assert row["epoch"] == 2
    assert [line["limit"] for line in hung_lines(sup)] == ["hang_timeout"]
    wait_for(lambda: accepted_in(sink_report(server), 2) > 20, 20, "frames of epoch 2")
    assert sink_report(server)["errors"] == []


@pytest.mark.slow
def test_watchdog_kills_a_step_without_progress_before_the_hang_timeout(start_supervisor):
    sup = start_supervisor("tests.probe_actors:stalled")  # hang timeout 30 s, watchdog 1.5 s
    # by the row, not by the first pid: on a busy machine the watchdog may fire before a status is read
    wait_for(lambda: (row := sup.actor("stall"))["restarts"] == 1 and row["state"] == "ready", 20, "the stalled actor to be replaced")
    (hung,) = hung_lines(sup)
    assert hung["limit"] == "watchdog" and hung["silent_s"] < 1.5 + 5  # its heartbeat beat all along: only the watchdog fired


def test_sigterm_stops_everything_and_removes_segments(start_supervisor, server):
    sup = start_supervisor(CHAIN)
    pids = [row["pid"] for row in sup.status()]
    assert list_segments(server_prefix(server))
    assert sup.stop(signal.SIGTERM) == 0
    assert not list_segments(server_prefix(server))
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_sigint_stops_like_sigterm(start_supervisor, server):
    sup = start_supervisor(CHAIN)
    assert sup.stop(signal.SIGINT) == 0
    assert not list_segments(server_prefix(server))


@pytest.mark.slow
def test_second_server_on_a_port_is_refused(start_supervisor, server):
    first = start_supervisor(CHAIN)
    second = subprocess.run(
        [sys.executable, "-m", "actors.supervisor", CHAIN, "--port", server], capture_output=True, text=True, timeout=60
    )
    assert second.returncode == 1 and "already runs" in second.stderr
    assert [r["restarts"] for r in first.status()] == [0, 0, 0]  # the running server is untouched


@pytest.mark.slow
def test_crashed_supervisor_leaves_no_orphans_and_is_swept(start_supervisor, server):
    sup = start_supervisor(CHAIN)
    pids = [row["pid"] for row in sup.status()]
    sup.stop(signal.SIGKILL)
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in pids), 10, "actors to die with their supervisor")
    assert list_segments(server_prefix(server))  # nobody was left to unlink them...
    gone = ringllm("status", "--port", server, check=False)
    assert gone.returncode == 1 and "is gone" in gone.stderr
    again = start_supervisor(CHAIN)  # ...so the next server on the port sweeps them
    assert [r["restarts"] for r in again.status()] == [0, 0, 0]
    assert again.stop() == 0
    assert not list_segments(server_prefix(server))


@pytest.mark.slow
def test_idle_actor_uses_under_two_percent_of_a_core(start_supervisor):
    sup = start_supervisor("tests.probe_actors:idle_pair")
    supervisor = psutil.Process(sup.proc.pid)
    procs = [supervisor, *supervisor.children(recursive=True)]  # the forkserver and the resource tracker too
    time.sleep(0.5)  # let start-up work settle
    before = [p.cpu_times() for p in procs]
    started = time.monotonic()
    time.sleep(3)  # 2% of a core is 60 ms of CPU time over this window, six of the kernel's 10 ms ticks
    elapsed = time.monotonic() - started
    usage = {
        p.pid: 100 * ((now.user + now.system) - (then.user + then.system)) / elapsed
        for p, then, now in zip(procs, before, [p.cpu_times() for p in procs])
    }
    print("idle CPU % of a core, by pid (supervisor, then its children):", usage)
    assert all(pct < 2.0 for pct in usage.values()), usage


@pytest.mark.slow
def test_a_stop_whose_log_reader_is_gone_still_kills_and_sweeps(server, tmp_path, monkeypatch):
    """A server's stderr is often a pipe (`| tee`, a parent that captures it). With its reader gone, each
    log line had raised BrokenPipeError: a stop with a hung actor to kill broke off at its log line, before
    the kill and the sweep, and the supervisor then waited on its live actors forever."""
    monkeypatch.setenv("RINGLLM_PROBE_DIR", str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "actors.supervisor", CHAIN, "--port", server, "--stop-timeout", "1"],  # the hung actor's wait
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=stop_with_parent,
    )
    sup = RunningSupervisor(server, proc, Path(os.devnull))
    try:
        seen = b""
        while b'"topology_ready"' not in seen:
            chunk = proc.stderr.read1()
            assert chunk, seen.decode(errors="replace")  # it ended before it was ready
            seen += chunk
        pids = [row["pid"] for row in sup.status()]
        os.kill(sup.actor("echo")["pid"], signal.SIGSTOP)  # hung: the stop must kill it
        proc.stderr.close()
        assert sup.stop(signal.SIGINT, timeout=30) == 0
        wait_for(lambda: not any(psutil.pid_exists(pid) for pid in pids), 10, "every actor to be gone")
        assert not list_segments(server_prefix(server))
    finally:
        if proc.poll() is None:
            proc.kill()
        remove_segments(server_prefix(server))


def test_an_actor_that_dies_during_start_up_is_started_again(start_supervisor, server):
    """Start-up handles a death as the running server does (a new epoch, the restart backoff): an echo whose
    set-up dies twice comes up at its third start, within the default --startup-retries, and frames flow."""
    sup = start_supervisor("tests.probe_actors:twice_flaky_chain")
    row = sup.actor("echo")
    assert row["restarts"] == 2 and row["state"] == "ready" and row["epoch"] == 3
    assert [e["exitcode"] for e in log_events(sup.log.read_bytes(), "actor_restarting")] == [1, 1]
    wait_for(lambda: accepted_in(sink_report(server), 3) > 50, 20, "frames to flow")
    assert sink_report(server)["errors"] == []


def test_an_actor_that_keeps_dying_ends_start_up_with_its_error_and_leaves_nothing(server, tmp_path, monkeypatch):
    """One death more than --startup-retries ends start-up: exit 1, the error names the actor, its exit code and
    how often it died, and no process (the forkserver's included) nor segment is left behind."""
    monkeypatch.setenv("RINGLLM_PROBE_DIR", str(tmp_path))
    command = [sys.executable, "-m", "actors.supervisor", "tests.probe_actors:doomed_chain", "--port", server, "--startup-retries", "2"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, timeout=60, preexec_fn=stop_with_parent)
    assert done.returncode == 1, done.stderr[-3000:]
    (failed,) = log_events(done.stderr, "startup_failed")
    assert failed["error"] == "echo exited with code 1 during start-up, its death number 3 (--startup-retries 2)"
    assert len(log_events(done.stderr, "actor_restarting")) == 2
    assert (tmp_path / f"probe-{server}.json.echo-starts").read_bytes() == b"..."
    pids = [e["pid"] for e in log_events(done.stderr, "actor_started") + log_events(done.stderr, "forkserver_started")]
    assert len(pids) == 3 + 2 + 1
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in pids), 10, "every process to be gone")
    assert not list_segments(server_prefix(server))


def forkservers(sup: RunningSupervisor) -> list[int]:
    return [event["pid"] for event in log_events(sup.log.read_bytes(), "forkserver_started")]


@pytest.mark.slow
def test_a_dead_forkserver_takes_no_actor_with_it(start_supervisor, server):
    """Actors are the supervisor's children, not the forkserver's: a forkserver killed while frames flow
    restarts no actor (the same pids, epoch 1, the stream going on unbroken). Another forkserver starts at
    once and forks the next restart, of an actor killed right after it."""
    sup = start_supervisor(CHAIN)
    wait_for(lambda: accepted_in(sink_report(server), 1) > 50, 20, "frames to flow")
    before = sup.status()
    supervisor = psutil.Process(sup.proc.pid)
    assert {row["pid"] for row in before} <= {child.pid for child in supervisor.children()}
    (forkserver,) = forkservers(sup)
    assert forkserver in {child.pid for child in supervisor.children()}
    accepted = accepted_in(sink_report(server), 1)
    os.kill(forkserver, signal.SIGKILL)
    wait_for(lambda: accepted_in(sink_report(server), 1) > accepted + 200, 20, "frames to flow on")
    assert [(r["pid"], r["epoch"], r["restarts"]) for r in sup.status()] == [(r["pid"], 1, 0) for r in before]
    (_, successor) = wait_for(lambda: len(found := forkservers(sup)) == 2 and found, 20, "another forkserver")
    echo = sup.actor("echo")["pid"]
    os.kill(echo, signal.SIGKILL)
    row = wait_for(lambda: restarted(sup, "echo", echo), 20, "echo to restart")
    assert psutil.Process(row["pid"]).ppid() == sup.proc.pid and psutil.pid_exists(successor)
    wait_for(lambda: accepted_in(sink_report(server), 2) > 50, 20, "frames of epoch 2")
    assert sink_report(server)["errors"] == []
    assert [e["exitcode"] for e in log_events(sup.log.read_bytes(), "forkserver_exited")] == [-signal.SIGKILL]


def test_preloads_a_library_lacks_pass_quietly_and_broken_ones_say_why(tmp_path, monkeypatch, capsys):
    """A preload this version of a library does not have is skipped without a word; one that exists but cannot
    import names what it lacks. torch is told to ask NVML, not the CUDA driver, only while they import."""
    from actors.forkserver import preload_without_cuda

    (tmp_path / "seeing_preload.py").write_text("import os\nSEEN = os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK')\n")
    (tmp_path / "broken_preload.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    preload_without_cuda(["json.no_such_module", "seeing_preload"])
    assert capsys.readouterr().err == ""
    assert sys.modules.pop("seeing_preload").SEEN == "1" and "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    preload_without_cuda(["broken_preload"])
    assert "No module named 'no_such_dependency'" in capsys.readouterr().err
