"""The supervisor's forkserver, and the supervisor's end of it.

The forkserver is a clean process (it never touches CUDA) that imports once what the actors preload
(ActorSpec.preload), so a start or a restart after a crash forks with those modules already imported. It
dies with the supervisor.

An actor is not the forkserver's child: the forkserver forks a middle process that forks the actor and
exits, so the kernel hands the actor to the supervisor, a child subreaper (transport.lifetime). Only then,
its parent the supervisor, does the actor arm its parent-death signal: it dies with the supervisor, never
with the forkserver. A forkserver that dies takes no actor with it; the supervisor starts another, and a
spawn under way is asked again of the new one.

A spawn: the supervisor sends the pickled target and the descriptors it carries (doorbells), the forkserver
answers with the actor's pid once the middle process is gone, and only then lets the actor run. An actor
whose forkserver died before answering never runs (nobody would own it): it exits with ORPHANED.
"""

from __future__ import annotations

import contextlib
import multiprocessing.context as mp_context
import os
import pickle
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait as wait_any
from multiprocessing.reduction import ForkingPickler
from typing import Any

import structlog

from runtime.obs.gc_pauses import freeze_startup_heap
from transport.lifetime import on_parent_death

log = structlog.get_logger()

ORPHANED = 70  # the exit code of an actor that never ran: its forkserver died before the supervisor learnt its pid
_MAX_FDS = 253  # SCM_MAX_FD: what one message may carry
_LENGTH = 8

# in a forked actor, the descriptors its target was sent with (what _Inherited names by index)
_inherited: list[int] = []


class _Inherited:
    """A descriptor of the target, by its index among those sent (multiprocessing's DupFd protocol)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def detach(self) -> int:
        return _inherited[self.index]


class _Collect:
    """Stands in for multiprocessing's spawning Popen while a target is pickled: the descriptors its
    objects reduce with DupFd (doorbells; semaphores need only a spawn under way) are gathered to be sent."""

    DupFd = _Inherited

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return len(self.fds) - 1


def _pickle(target: Callable[[Any], None], arg: Any) -> tuple[bytes, list[int]]:
    collect = _Collect()
    mp_context.set_spawning_popen(collect)  # pyright: ignore[reportArgumentType]  # what pickling asks of a Popen, no more
    try:
        data = bytes(ForkingPickler.dumps((target, arg)))
    finally:
        mp_context.set_spawning_popen(None)
    if len(collect.fds) > _MAX_FDS:
        raise ValueError(f"a spawn may pass at most {_MAX_FDS} descriptors, not {len(collect.fds)}")
    return data, collect.fds


def _read_exactly(read: Callable[[int], bytes], size: int) -> bytes:
    """`size` bytes, or fewer when the other end closed first."""
    data = b""
    while len(data) < size and (chunk := read(size - len(data))):
        data += chunk
    return data


class Child:
    """A child process of the supervisor (an actor, once handed to it, or the forkserver), watched through a
    pidfd: `sentinel` becomes readable when it exits, whoever forked it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        if self.exitcode is None:
            self._reap(os.WNOHANG)
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is None and wait_any([self.sentinel], timeout):
            self._reap(0)

    def kill(self) -> None:
        if self.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # never the supervisor's child: its forkserver died before handing it over
            self.exitcode = ORPHANED
            return
        if pid:
            self.exitcode = os.waitstatus_to_exitcode(status)


class Forkserver:
    """The supervisor's end: starts the forkserver, has it fork actors, and starts another when it dies.
    The supervisor must be a child subreaper (transport.lifetime.become_subreaper) before the first spawn."""

    def __init__(self, preload: list[str]) -> None:
        self.preload = preload
        self.proc: Child | None = None
        self._sock: socket.socket | None = None

    def start(self) -> None:
        """A new forkserver (the old one reaped); it imports the preloaded modules while the supervisor goes on."""
        self.stop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        run = f"main({theirs.fileno()}, {os.getpid()}, {self.preload!r})"
        code = f"import sys; sys.path[:] = {sys.path!r}; from actors.forkserver import main; {run}"
        argv = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", code]  # pyright: ignore[reportAttributeAccessIssue]
        theirs.set_inheritable(True)
        try:
            pid = os.posix_spawn(sys.executable, argv, os.environ, file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)])
        finally:
            theirs.close()
        self.proc, self._sock = Child(pid), ours
        log.info("forkserver_started", pid=pid)

    def stop(self) -> None:
        """Close its socket and kill it: it holds nothing of its own (the actors are the supervisor's children, and
        no spawn is under way at a stop), and one still importing its preloads would take seconds to notice."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.proc.close()
            self.proc = None

    def spawn(self, target: Callable[[Any], None], arg: Any) -> Child:
        """A new process, the supervisor's child, that runs target(arg). A forkserver that dies before it
        answers is replaced and asked again, once."""
        data, fds = _pickle(target, arg)
        for attempt in range(2):
            if attempt or self.proc is None or not self.proc.is_alive():
                self.start()
            assert self._sock is not None
            try:
                socket.send_fds(self._sock, [len(data).to_bytes(_LENGTH, "little")], fds)
                self._sock.sendall(data)
                reply = _read_exactly(self._sock.recv, _LENGTH)
            except OSError:
                continue  # it died
            if len(reply) < _LENGTH:
                continue  # it died
            if (pid := int.from_bytes(reply, "little", signed=True)) < 0:
                raise OSError(-pid, f"the forkserver could not fork: {os.strerror(-pid)}")
            return Child(pid)
        raise RuntimeError("the forkserver died twice during one spawn")


# -- in the forkserver ------------------------------------------------------------------------------


def preload_without_cuda(preload: list[str]) -> None:
    """Import the preloads. An import that asks torch.cuda.is_available() (transformers does where flash-attn is
    installed) would start the CUDA driver here and every forked engine would fail to use it: while they import,
    torch asks NVML instead."""
    held = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        for module in preload:
            try:
                __import__(module)
            except ModuleNotFoundError as exc:
                if exc.name != module:  # not a preload this version of a library lacks, but one that is broken
                    traceback.print_exc()
            except Exception:  # the actor that needs it meets the error again, and reports it as its own
                traceback.print_exc()
    finally:
        if held is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = held


def main(fd: int, supervisor: int, preload: list[str]) -> None:
    """The forkserver: fork an actor per request on the socket `fd`, until the supervisor closes it."""
    on_parent_death()
    if os.getppid() != supervisor:  # it died before the signal was armed
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the supervisor stops us
    preload_without_cuda(preload)
    freeze_startup_heap()  # each actor's own freeze then collects only what it made after the fork
    with socket.socket(fileno=fd) as sock:
        while True:
            header, fds, _, _ = socket.recv_fds(sock, _LENGTH, _MAX_FDS)
            if not header:  # the supervisor closed its end
                os._exit(0)  # nothing to release: skip the interpreter's slow teardown of torch and friends
            header += _read_exactly(sock.recv, _LENGTH - len(header))
            data = _read_exactly(sock.recv, int.from_bytes(header, "little"))
            try:
                pid, go = _fork(sock, data, fds, supervisor)
            finally:
                for each in fds:
                    os.close(each)
            sock.sendall(pid.to_bytes(_LENGTH, "little", signed=True))
            if go is not None:  # the supervisor knows the actor now: let it run
                with contextlib.suppress(OSError):
                    os.write(go, b"g")
                os.close(go)


def _fork(sock: socket.socket, data: bytes, fds: list[int], supervisor: int) -> tuple[int, int | None]:
    """Fork the actor through a middle process, which exits: the actor's pid (or -errno) and the pipe end
    that lets it run. On return the middle process is reaped, so the actor is the supervisor's child."""
    pid_r, pid_w = os.pipe()
    go_r, go_w = os.pipe()
    try:
        middle = os.fork()
    except OSError as exc:
        for each in (pid_r, pid_w, go_r, go_w):
            os.close(each)
        return -(exc.errno or 1), None
    if middle == 0:
        code = 1
        try:
            os.close(pid_r)
            os.close(go_w)
            actor = os.fork()
            if actor == 0:
                os.close(pid_w)
                sock.close()
                _become_actor(data, fds, go_r, supervisor)
            os.write(pid_w, actor.to_bytes(_LENGTH, "little", signed=True))
            code = 0
        finally:
            os._exit(code)
    os.close(pid_w)
    os.close(go_r)
    reply = _read_exactly(lambda n: os.read(pid_r, n), _LENGTH)
    os.close(pid_r)
    os.waitpid(middle, 0)
    if len(reply) < _LENGTH:  # the middle process failed to fork
        os.close(go_w)
        return -1, None
    return int.from_bytes(reply, "little", signed=True), go_w


def _become_actor(data: bytes, fds: list[int], go: int, supervisor: int) -> None:
    """In the forked actor: wait until the supervisor knows this pid, tie this life to the supervisor's, then
    run the target. Never returns."""
    code = 1
    try:
        if os.read(go, 1) != b"g":  # the forkserver died before the supervisor learnt this pid
            code = ORPHANED
            return
        os.close(go)
        on_parent_death()  # the parent is the supervisor now: the middle process is gone
        if os.getppid() != supervisor:  # not a subreaper, or it died before the signal was armed
            return
        _inherited[:] = fds
        target, arg = pickle.loads(data)  # what ForkingPickler.loads is
        target(arg)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
