"""Tensor parallelism's process group: a rank's place among N, and the two collectives the sharded
model calls (torch.distributed: NCCL on CUDA, gloo on CPU). A group of one does no communication.

With EngineConfig.custom_all_reduce on CUDA, an all-reduce of up to ONE_SHOT_MAX_BYTES (a decode
step's) goes through torch's symmetric-memory one-shot kernel instead: each rank copies its rows
into a buffer every peer maps, then reads and sums the peers' over NVLink in one kernel. Alone it
takes half NCCL's time at those sizes (benchmarks/allreduce.py); inside the engine's graphs it
did not beat NCCL, so it is opt-in."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import FileStore, PrefixStore, Store, TCPStore  # pyright: ignore[reportPrivateImportUsage]  (no __all__)

from runtime.cli_args import split_address
from runtime.config import EngineConfig, ModelConfig

# ranks' tensors stacked by rows into one; torch renamed it (2.13 deprecates the old name)
_all_gather_rows = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
ONE_SHOT_MAX_BYTES = 4 << 20


class OneShotAllReduce:
    """A symmetric-memory buffer of `max_bytes` on every rank of the default group, and the one-shot
    all-reduce through it, in place."""

    def __init__(self, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = dist.group.WORLD.group_name  # pyright: ignore[reportOptionalMemberAccess]  # set: the group is initialized
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.11, a no-op since
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(self.group)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group)

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and x.numel() * x.element_size() <= self.buffer.numel()

    def __call__(self, x: torch.Tensor) -> None:
        shared = self.buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        shared.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(shared, "sum", self.group, x)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    host_group: Any = None  # gloo, for Python objects, where the default group is NCCL
    one_shot: OneShotAllReduce | None = None  # CUDA with EngineConfig.custom_all_reduce

    @staticmethod
    def join(rank: int, config: EngineConfig, rendezvous: str | None, device: torch.device) -> TensorParallel:
        """Join the group of config.tensor_parallel_size ranks that meets at `rendezvous` (see
        `meeting_store`; None for a single rank, which meets no one). On CPU the ranks share the cores:
        each computes with its share of them."""
        size = config.tensor_parallel_size
        if dist.is_initialized():  # a closed LLM's group, its other ranks gone
            dist.destroy_process_group()
        if size == 1:
            return SINGLE
        assert rendezvous is not None
        store = meeting_store(rendezvous, size)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", store=store, rank=rank, world_size=size, device_id=device)
            one_shot = OneShotAllReduce(device) if config.custom_all_reduce else None
            return TensorParallel(rank, size, dist.new_group(backend="gloo"), one_shot)
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size)
        return TensorParallel(rank, size)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.host_group)
        return out

    def split(self, total: int) -> tuple[int, int]:
        """This rank's (start, count) of `total` units split evenly; a count below one unit per rank
        (KV heads fewer than ranks) gives each rank one unit, shared by size // total ranks."""
        if total >= self.size:
            count = total // self.size
            return self.rank * count, count
        return self.rank * total // self.size, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_shot is not None and self.one_shot.fits(x):
            self.one_shot(x)
        elif self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols] on each rank -> [rows, size·cols] on every rank, rank 0's columns first."""
        if self.size == 1:
            return x
        out = torch.empty((self.size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        _all_gather_rows(out, x.contiguous())
        return out.view(self.size, *x.shape).permute(1, 0, 2).reshape(x.shape[0], -1)

    def min(self, value: int) -> int:
        """The smallest `value` over the ranks (each rank sizes its KV pool from its own device)."""
        if self.size == 1:
            return value
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        held = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(held, op=dist.ReduceOp.MIN)
        return int(held.item())


SINGLE = TensorParallel()
MEETING_TIMEOUT = timedelta(minutes=10)  # how long a rank waits for the others of its group (a peer may load weights)


def meeting_store(rendezvous: str, size: int) -> Store:
    """Where a group's ranks meet: a file every rank opens (torch's FileStore), or, across nodes,
    "tcp://HOST:PORT/NAME", the keys under NAME of the TCPStore that node 0 serves at HOST:PORT."""
    if not rendezvous.startswith("tcp://"):
        return FileStore(rendezvous, size)
    address, _, name = rendezvous.removeprefix("tcp://").partition("/")
    host, port = split_address(address)
    return PrefixStore(name, TCPStore(host, port, is_master=False, timeout=MEETING_TIMEOUT))


def rank_device(device: str, index: int) -> torch.device:
    """The device of the index-th engine process: CUDA ones take consecutive devices from `device`'s."""
    base = torch.device(device)
    return torch.device("cuda", (base.index or 0) + index) if base.type == "cuda" else base


def check_parallel(cfg: ModelConfig, config: EngineConfig, replicas: int = 1, nodes: int = 1) -> None:
    """Refuse, before anything loads, a split the model or the machine cannot take (`replicas` engines
    of tensor_parallel_size ranks each, spread over `nodes` machines)."""
    size = config.tensor_parallel_size
    if config.pd and cfg.window:
        raise ValueError("prefill-decode disaggregation does not serve models with sliding windows yet")
    if cfg.num_heads % size:
        raise ValueError(f"the model's {cfg.num_heads} attention heads do not split over tensor_parallel_size {size}")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ValueError(f"the model's {cfg.num_kv_heads} KV heads neither split over nor replicate across {size} ranks")
    if cfg.intermediate_size % size:
        raise ValueError(f"the model's intermediate size {cfg.intermediate_size} does not split over tensor_parallel_size {size}")
    if cfg.moe is not None and cfg.moe.intermediate_size % size:
        raise ValueError(f"the experts' intermediate size {cfg.moe.intermediate_size} does not split over tensor_parallel_size {size}")
    cuda = config.device.startswith("cuda")
    if cuda:
        first, devices = torch.device(config.device).index or 0, replicas * size // nodes
        if first + devices > (have := torch.cuda.device_count()):
            what = f"{replicas} replicas of {size} tensor-parallel ranks" if replicas > 1 else f"{devices} tensor-parallel ranks"
            raise ValueError(
                f"{what} need {devices} GPUs from cuda:{first}; "
                f"{have} visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
            )
    if size > 1 and not (dist.is_available() and (dist.is_nccl_available() if cuda else dist.is_gloo_available())):
        raise ValueError(f"tensor_parallel_size {size} needs torch.distributed with {'NCCL' if cuda else 'gloo'}")
