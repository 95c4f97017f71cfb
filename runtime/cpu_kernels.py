"""ringllm's CPU kernels (cpu_kernels.cpp), compiled on first use into ringllm's cache and
loaded as torch ops under torch.ops.ringllm_cpu: skinny_linear (runtime.cpu), paged_decode_attention
(runtime.attention), and rms_norm, add_rms_norm and silu_and_mul (the `ringllm_cpu` op set of
runtime.layers).

They need AVX2 and FMA, a C++ compiler and ninja. Where any is missing, or RINGLLM_CPU_KERNELS=0
asks for the torch path (side-by-side measurements, or a build that misbehaves), `available()` is
False and the CPU path runs on torch's ops alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from functools import cache
from pathlib import Path

import structlog
import torch

log = structlog.get_logger()

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]


def build_directory() -> Path:
    """A folder per checkout, source, flags and torch: ninja rebuilds whenever its compile command
    changes, so two of them sharing a folder would take turns rebuilding it."""
    from runtime.model_source import cache_root

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([str(SOURCE), *FLAGS, torch.__version__]).encode()).hexdigest()[:16]
    folder = cache_root() / "cpu_kernels" / key
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@cache
def available() -> bool:
    from runtime.cpu import cpuinfo

    if os.environ.get("RINGLLM_CPU_KERNELS", "1") == "0":
        return False
    if not {"avx2", "fma"} <= set(cpuinfo("flags").split()):
        return False
    try:
        from torch.utils.cpp_extension import load

        folder = build_directory()
        # one process of many builds it, the others wait, then load it. torch's own baton (a file named
        # "lock") outlives a build that was killed, and every later start had waited on it forever; a
        # flock goes with its process, so under one any baton left in the folder is stale
        with open(folder / "build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)
            load(name="ringllm_cpu_kernels", sources=[str(SOURCE)], extra_cflags=FLAGS, is_python_module=False,
                 build_directory=str(folder))
    except Exception as exc:  # no compiler, no ninja, a torch without headers: the torch path still works
        lines = str(exc).splitlines() or [type(exc).__name__]
        log.warning("cpu_kernels_unavailable", error=next((line for line in lines if "error" in line), lines[0])[:300])
        return False
    return True

