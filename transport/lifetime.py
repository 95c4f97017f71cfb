"""Processes that must not outlive their parent: the kernel signals them when it dies (Linux only,
as are the rings)."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}) failed")


def on_parent_death(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies."""
    _prctl(_PR_SET_PDEATHSIG, sig)


def become_subreaper() -> None:
    """Adopt this process's orphaned descendants: a process whose parent dies becomes this one's child (and
    its parent-death signal, armed after that, answers to this process's death)."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
