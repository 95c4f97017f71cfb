"""Processes that must not outlive their parent: the kernel signals them when it dies (Linux only,
as are the rings)."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def on_parent_death(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
