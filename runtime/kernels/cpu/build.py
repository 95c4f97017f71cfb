"""ringllm's CPU kernels (kernels.cpp) as torch.ops.ringllm_cpu, compiled on first use. They need AVX2,
FMA, a C++ compiler and ninja; without them, or with RINGLLM_CPU_KERNELS=0, torch's ops run instead."""

from __future__ import annotations

import fcntl
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import structlog
import torch

from transport import env

log = structlog.get_logger()

SOURCE = Path(__file__).with_name("kernels.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]


def cpuinfo(field: str) -> str:
    """The first processor's `field` in /proc/cpuinfo, or ''."""
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(field))
    except (OSError, StopIteration):
        return ""
    return line.partition(":")[2].strip()


def build_directory() -> Path:
    """A folder per checkout, source, flags and torch, since ninja rebuilds whenever the command changes."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([str(SOURCE), *FLAGS, torch.__version__]).encode()).hexdigest()[:16]
    folder = env.cache_root() / "cpu_kernels" / key
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """Held by the one process inside torch's load of the kernels: one builds, the others wait. torch's own baton
    (a file named "lock") outlives a build killed midway; a flock does not."""
    with open(folder / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


@cache
def available() -> bool:
    if not env.cpu_kernels():
        return False
    if not {"avx2", "fma"} <= set(cpuinfo("flags").split()):
        return False
    try:
        from torch.utils.cpp_extension import load

        folder = build_directory()
        with build_lock(folder):
            (folder / "lock").unlink(missing_ok=True)
            load(name="ringllm_cpu_kernels", sources=[str(SOURCE)], extra_cflags=FLAGS, is_python_module=False, build_directory=str(folder))
    except Exception as exc:  # no compiler, no ninja, a torch without headers: the torch path still works
        lines = str(exc).splitlines() or [type(exc).__name__]
        log.warning("cpu_kernels_unavailable", error=next((line for line in lines if "error" in line), lines[0])[:300])
        return False
    return True
