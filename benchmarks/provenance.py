"""Where a benchmark record came from: its date and the commit of the tree that ran it, so that a table
built from records can name both."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str | None:
    """The checkout's short commit, with "-dirty" when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def provenance() -> dict[str, str | None]:
    return {"date": datetime.date.today().isoformat(), "commit": commit()}


def machine(device: str = "cpu") -> str:
    """The processor and its cores, and on CUDA the first GPU's name (nvidia-smi's: the caller makes no CUDA context)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    if not device.startswith("cuda"):
        return f"{cpu}, {os.cpu_count()} cores"
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        gpu = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        gpu = "a GPU nvidia-smi did not name"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}"
