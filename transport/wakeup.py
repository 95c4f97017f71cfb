"""Waiting without burning a core: spin briefly, then sleep on an eventfd that the peer rings.

The waiter raises a flag in shared memory before it sleeps; the peer rings the eventfd only when
the flag is up, so a busy pipeline makes no syscalls. Announcing sleep is a store followed by a
load of the peer's index, which x86-64 may reorder (store→load is the one reordering TSO allows)
and Python cannot fence. The first nap after raising the flag is therefore short: a wake-up lost
to that reordering costs at most FIRST_NAP_S, never a hang; later naps last until the bell rings.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import select
import time
from collections.abc import Callable, Generator, Sequence
from multiprocessing.reduction import DupFd

from transport import env

FIRST_NAP_S = 0.001
SPIN_US = 50  # longer spins steal more from the busy actors on the host than they save


def spin_budget_ns(cores: int | None = None) -> int:
    """Spinning only pays when the peer can run meanwhile: none on one core, SPIN_US with more."""
    if (override := env.spin_us()) is not None:
        return int(override * 1000)
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    return 0 if cores < 2 else SPIN_US * 1000


SPIN_NS = spin_budget_ns()


class Doorbell:
    """A non-blocking eventfd; pickling it into a spawned child passes the descriptor along."""

    def __init__(self, fd: int | None = None) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) if fd is None else fd

    def __reduce__(self):  # only valid while multiprocessing spawns a child
        return _rebuild_doorbell, (DupFd(self.fd),)

    def ring(self) -> None:
        os.eventfd_write(self.fd, 1)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    async def sleep_async(self, timeout: float | None) -> None:
        await sleep_any_async((self,), timeout)

    def close(self) -> None:
        os.close(self.fd)


def _rebuild_doorbell(dup) -> Doorbell:
    return Doorbell(dup.detach())


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def ring_if_asleep(flag: ctypes.c_uint32, bell: Doorbell) -> None:
    """The peer's half of the protocol: wake the waiter only if it announced sleep."""
    if flag.value:
        flag.value = 0
        bell.ring()


def _naps(ready: Callable[[], bool], flags: Sequence[ctypes.c_uint32], timeout: float | None) -> Generator[float | None, None, None]:
    """The wait policy shared by the blocking and asyncio waits: yields how long to sleep next
    (None: until rung) and stops once `ready()` holds or the timeout has passed."""
    spin_end = time.perf_counter_ns() + SPIN_NS
    while time.perf_counter_ns() < spin_end:
        if ready():
            return
    deadline = None if timeout is None else time.monotonic() + timeout
    nap: float | None = FIRST_NAP_S
    try:
        while True:
            for flag in flags:
                flag.value = 1
            if ready():
                return
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                nap = left if nap is None else min(nap, left)
            yield nap
            nap = None
    finally:
        for flag in flags:
            flag.value = 0


def wait_until(
    ready: Callable[[], bool], flags: Sequence[ctypes.c_uint32], bells: Sequence[Doorbell], timeout: float | None = None
) -> bool:
    """Wait for `ready()`; each flag asks its peer to ring the matching bell."""
    if ready():
        return True
    poll = _poll_of(bells)  # only built once the spin has failed
    with contextlib.closing(_naps(ready, flags, timeout)) as naps:
        for nap in naps:
            poll.poll(None if nap is None else nap * 1000)
            for bell in bells:
                bell.drain()
    return ready()


async def wait_until_async(
    ready: Callable[[], bool], flags: Sequence[ctypes.c_uint32], bells: Sequence[Doorbell], timeout: float | None = None
) -> bool:
    if ready():
        return True
    with contextlib.closing(_naps(ready, flags, timeout)) as naps:
        for nap in naps:
            await sleep_any_async(bells, nap)
    return ready()


def _poll_of(bells: Sequence[Doorbell]) -> select.poll:
    poll = select.poll()
    for bell in bells:
        poll.register(bell.fd, select.POLLIN)
    return poll


async def sleep_any_async(bells: Sequence[Doorbell], timeout: float | None) -> None:
    """Sleep until any bell rings or the timeout passes, then drain every bell."""
    loop = asyncio.get_running_loop()
    woken = loop.create_future()
    for bell in bells:
        loop.add_reader(bell.fd, _resolve, woken)
    timer = None if timeout is None else loop.call_later(timeout, _resolve, woken)
    try:
        await woken
    finally:
        for bell in bells:
            loop.remove_reader(bell.fd)
        if timer is not None:
            timer.cancel()
    for bell in bells:
        bell.drain()
