"""The KV tiers under the device pool, as the engine runs them: the host tier's pages and their index, and
the moves a plan carries between the device, the host tier and disk (runtime.step.KVMove).

The host tier is the device pool's layout (runtime.attention.pool.KVPool) in host memory: a segment the
keeper holds (actors.keeper), so that it outlives the engine, or the engine's own. On CUDA it is pinned,
and the copies run on a stream of their own, layer by layer: stretches of pages in a row as one copy
each (the copy engines', beside the forward's kernels), the pages between them with sgl-kernel's
page-transfer kernels where they are installed (one gather or scatter a layer, reading or writing host
memory directly), else with torch's indexing; the step's forward waits for a layer's copies just before
that layer, as SGLang's HiCache does. On CPU they are torch's indexing, run before the forward.

Ahead of the pages lies the index: what each host page holds (its chain key, the key before it, its place in
the chain and its tokens), set as a store is queued and marked valid once it has run. A new scheduler
rebuilds the host tier's tree from the valid entries (frames.Adopt), so a scheduler's crash keeps the tier.

Disk holds whole pages in files named by their chain key (runtime.scheduler.tiers.page_file), in a folder per
model, weights and KV layout (namespace): a file is written whole under another name and renamed, so a
reader never sees half of one."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from runtime.attention.pool import KVPool
from runtime.scheduler.tiers import KEY_BYTES, HostIndex, page_file
from runtime.step import KVMove


def namespace(model_dir: Path, pool: KVPool, dummy_weights: bool) -> str:
    """The folder name for one model's page files: its config, its weight files (names, sizes, times) or its
    random weights, and the KV layout (dtype, page size, heads, head size, layers)."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update((model_dir / "config.json").read_bytes())
    weights = [] if dummy_weights else sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.gguf"))
    stat = [(path.name, path.stat().st_size, path.stat().st_mtime_ns) for path in weights]
    layout = [str(pool.dtype), pool.page_size, pool.num_kv_heads, pool.head_dim, len(pool.kv), dummy_weights]
    digest.update(json.dumps([stat, layout]).encode())
    return digest.hexdigest()


class HostTier:
    def __init__(self, device_pool: KVPool, num_pages: int, memory: Tensor | None, disk: Path | None) -> None:
        """`memory`: HostTier.bytes_for(...) bytes to lay the tier in (zero when new, else a tier kept as it was);
        None: its own. `disk`: the folder of this model's page files, or None."""
        self.device_pool, self.num_pages, self.disk = device_pool, num_pages, disk
        pool = device_pool
        page_bytes = KVPool.bytes_per_page(len(pool.kv), pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype)
        index_bytes = HostIndex.bytes_for(num_pages, pool.page_size)
        if memory is None:
            size = HostTier.bytes_for(num_pages, page_bytes, pool.page_size)
            memory = torch.zeros(size, dtype=torch.uint8, pin_memory=pool.device.type == "cuda")
        elif pool.device.type == "cuda":  # pinned in place: the copies read and write it from the device
            cudart = torch.cuda.cudart()
            assert cudart is not None  # CUDA's runtime, on a CUDA device
            cudart.cudaHostRegister(memory.data_ptr(), memory.numel(), 0)
        self.memory = memory
        self.index = HostIndex(memory.numpy(), num_pages, pool.page_size)
        self.pool = KVPool(
            len(pool.kv),
            num_pages,
            pool.page_size,
            pool.num_kv_heads,
            pool.head_dim,
            pool.dtype,
            torch.device("cpu"),
            memory=memory[index_bytes:],
        )
        self.page_bytes = page_bytes
        cuda = pool.device.type == "cuda"
        sgl = _sgl_copier() if cuda else None
        self._copier = RunCopier(sgl or TorchCopier())
        self.copies = "runs + sgl-kernel" if sgl is not None else "runs + torch"  # what moves the pages
        self._stream = torch.cuda.Stream(pool.device) if cuda else None  # CUDA: the copies' own
        self._unfinished: deque[tuple[torch.cuda.Event, list[int]]] = deque()  # CUDA: stores queued, by the event after them
        self.moved_bytes = {"device_to_host": 0, "host_to_device": 0, "host_to_disk": 0, "disk_to_host": 0}
        self._timings: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()  # CUDA: each run's, until read
        self._seconds: list[float] = []

    @staticmethod
    def bytes_for(num_pages: int, page_bytes: int, page_size: int) -> int:
        return HostIndex.bytes_for(num_pages, page_size) + num_pages * page_bytes

    def run(self, moves: list[KVMove]) -> LayerWaits | None:
        """A plan's moves, in order (timed: take_stats). On CUDA they are queued on a copy stream of their own,
        layer after layer, once the work queued before them on the device's stream has run; the step's forward
        waits for each layer's copies before that layer (the LayerWaits returned), so a layer's loads overlap the
        layers before it. On CPU they run here, at once, and None is returned."""
        self.finish_stores(wait=False)
        if self._stream is None:
            started = time.perf_counter()
            waits = self._move(moves)
            self._seconds.append(time.perf_counter() - started)
            return waits
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._stream.wait_stream(torch.cuda.current_stream())  # the forwards before may still write these pages
        with torch.cuda.stream(self._stream):
            start.record()
            waits = self._move(moves)
            end.record()
        self._timings.append((start, end))
        return waits

    def take_stats(self) -> tuple[dict[str, int], list[float]]:
        """Bytes moved in each direction, and the seconds each finished run took, since the last call."""
        while self._timings and self._timings[0][1].query():
            start, end = self._timings.popleft()
            self._seconds.append(start.elapsed_time(end) / 1e3)
        moved, self.moved_bytes = self.moved_bytes, dict.fromkeys(self.moved_bytes, 0)
        seconds, self._seconds = self._seconds, []
        return moved, seconds

    def _move(self, moves: list[KVMove]) -> LayerWaits | None:
        """Each run of stores and loads layer by layer; a save or read between them on the host, after the copies
        queued before it have run (a save reads what a store wrote; a read overwrites what a load may still read)."""
        waits, copies = None, []
        for move in [*moves, None]:
            if move is not None and move.kind in ("store", "load"):
                copies.append(move)
                continue
            if copies:
                waits = self._copy_layers(copies)
                copies = []
            if move is None:
                break
            if self._stream is not None:
                self._stream.synchronize()
            self.finish_stores(wait=True)
            if move.kind == "save":
                self._save(move.host, move.keys)
            else:
                self.index.valid[move.host] = 0  # its entries are for what the pages held before
                self._read(move.keys, move.host)
        return waits

    def _copy_layers(self, moves: list[KVMove]) -> LayerWaits | None:
        """Stores and loads, the first layer of every one before the second of any; on CUDA, an event after each layer."""
        copies = []
        for move in moves:
            store = move.kind == "store"
            if store:
                self._index_pages(move)
            source, target = (self.device_pool, self.pool) if store else (self.pool, self.device_pool)
            copies.append(self._copier.prepare(source, move.device if store else move.host, target, move.host if store else move.device))
            self.moved_bytes["device_to_host" if store else "host_to_device"] += len(move.host) * self.page_bytes
        events = []
        for layer in range(len(self.pool.kv)):
            for copy in copies:
                copy(layer)
            if self._stream is not None:
                events.append(torch.cuda.Event())
                events[-1].record()
        if stored := [page for move in moves if move.kind == "store" for page in move.host]:
            self._mark_stored(stored)
        return LayerWaits(events) if events else None

    def _index_pages(self, move: KVMove) -> None:
        ps = self.device_pool.page_size
        pages = move.host
        self.index.valid[pages] = 0
        self.index.keys[pages] = np.frombuffer(b"".join(move.keys), np.uint8).reshape(-1, KEY_BYTES)
        self.index.parents[pages] = np.frombuffer(b"".join([move.parent, *move.keys[:-1]]), np.uint8).reshape(-1, KEY_BYTES)
        self.index.positions[pages] = np.arange(move.position, move.position + len(pages))
        self.index.tokens[pages] = np.asarray(move.tokens, np.int32).reshape(-1, ps)

    def _mark_stored(self, pages: list[int]) -> None:
        if self._stream is None:
            self.index.valid[pages] = 1
            return
        event = torch.cuda.Event()
        event.record()
        self._unfinished.append((event, pages))

    def finish_stores(self, wait: bool) -> None:
        """Marks valid the index entries of stores that have run (`wait`: waits for every one)."""
        while self._unfinished:
            event, pages = self._unfinished[0]
            if not wait and not event.query():
                return
            event.synchronize()
            self.index.valid[pages] = 1
            self._unfinished.popleft()

    def _page_bytes(self, page: int) -> list[np.ndarray]:
        return [layer[page].view(torch.uint8).numpy().reshape(-1) for layer in self.pool.kv]

    def _save(self, pages: list[int], keys: list[bytes]) -> None:
        assert self.disk is not None
        self.disk.mkdir(parents=True, exist_ok=True)
        for page, key in zip(pages, keys):
            path = page_file(self.disk, key)
            if path.exists():
                continue
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
            with open(partial, "wb") as out:
                for part in self._page_bytes(page):
                    out.write(part.data)
            os.replace(partial, path)
            self.moved_bytes["host_to_disk"] += self.page_bytes

    def _read(self, keys: list[bytes], pages: list[int]) -> None:
        assert self.disk is not None
        for page, key in zip(pages, keys):
            with open(page_file(self.disk, key), "rb") as source:
                for part in self._page_bytes(page):
                    source.readinto(part.data)
            self.moved_bytes["disk_to_host"] += self.page_bytes


class LayerWaits:
    """What a step's forward waits for on CUDA: the events after each layer's copies on the copy stream."""

    def __init__(self, events: list[torch.cuda.Event]) -> None:
        self.events = events

    def layer(self, index: int) -> None:
        """The device's stream waits for layer `index`'s copies (and every copy queued before them)."""
        torch.cuda.current_stream().wait_event(self.events[min(index, len(self.events) - 1)])

    def all(self) -> None:
        torch.cuda.current_stream().wait_event(self.events[-1])


LayerCopy = Callable[[int], None]


class Copier(Protocol):
    def prepare(self, source: KVPool, from_pages: list[int], target: KVPool, to_pages: list[int]) -> LayerCopy:
        """A copy of whole pages from one pool to the other, a layer a call, on the current stream."""
        ...


def _indices(pages: list[int], device: torch.device) -> Tensor:
    """Page ids on `device`; to a GPU through pinned memory, so that the host does not wait for the stream."""
    host = torch.tensor(pages, dtype=torch.int64)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


class TorchCopier:
    """torch's indexing, as bytes: float8 has no indexing kernels on every device."""

    def prepare(self, source: KVPool, from_pages: list[int], target: KVPool, to_pages: list[int]) -> LayerCopy:
        src, dst = _indices(from_pages, source.device), _indices(to_pages, target.device)

        def copy(layer: int) -> None:
            pages = source.kv[layer].view(torch.uint8).index_select(0, src).to(target.device, non_blocking=target.device.type != "cpu")
            target.kv[layer].view(torch.uint8).index_copy_(0, dst, pages)

        return copy


MIN_RUN = 4  # pages in a row on both sides worth a copy of their own; shorter stretches are gathered and scattered


def page_runs(from_pages: list[int], to_pages: list[int]) -> list[tuple[int, int, int]]:
    """(first source page, first target page, pages) of each stretch where both sides count up by one."""
    runs: list[list[int]] = []
    for src, dst in zip(from_pages, to_pages):
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [(src, dst, count) for src, dst, count in runs]


class RunCopier:
    """Each stretch of at least MIN_RUN pages in a row on both sides as one copy a layer (a page's K and V of a
    layer lie together, so a stretch is one block of bytes): on CUDA a cudaMemcpyAsync, which the copy engines run
    beside the forward's kernels; the pages between them with `scattered`, one gather and scatter a layer. The
    allocators hand out pages in order (runtime.scheduler.pages), so a node's pages mostly lie in stretches."""

    def __init__(self, scattered: Copier) -> None:
        self.scattered = scattered

    def prepare(self, source: KVPool, from_pages: list[int], target: KVPool, to_pages: list[int]) -> LayerCopy:
        runs = page_runs(from_pages, to_pages)
        whole = [run for run in runs if run[2] >= MIN_RUN]
        short = [(src + i, dst + i) for src, dst, count in runs if count < MIN_RUN for i in range(count)]
        rest = self.scattered.prepare(source, [s for s, _ in short], target, [d for _, d in short]) if short else None

        def copy(layer: int) -> None:
            src, dst = source.kv[layer], target.kv[layer]
            for first, to, count in whole:
                dst[to : to + count].copy_(src[first : first + count], non_blocking=True)
            if rest is not None:
                rest(layer)

        return copy


class SglCopier:
    """sgl-kernel's per-layer page transfer between a device pool and pinned host memory: one kernel a layer
    that gathers and scatters token rows, reading or writing host memory directly."""

    def __init__(self, transfer: Callable[..., None]) -> None:
        self.transfer = transfer

    def prepare(self, source: KVPool, from_pages: list[int], target: KVPool, to_pages: list[int]) -> LayerCopy:
        device = source.device if source.device.type == "cuda" else target.device
        ps = source.page_size
        # each page's K rows start at page·2·ps and its V rows ps after: one row index a token, K and V views ps apart
        offsets = torch.arange(ps, device=device)
        src_rows = (_indices(from_pages, device)[:, None] * 2 * ps + offsets).reshape(-1)
        dst_rows = (_indices(to_pages, device)[:, None] * 2 * ps + offsets).reshape(-1)
        row_bytes = source.num_kv_heads * source.head_dim * source.dtype.itemsize

        def copy(layer: int) -> None:
            src, dst = source.rows(layer).view(torch.uint8), target.rows(layer).view(torch.uint8)
            self.transfer(src, dst, src[ps:], dst[ps:], src_rows, dst_rows, row_bytes)

        return copy


def _sgl_copier() -> SglCopier | None:
    """An SglCopier where sgl-kernel is installed with the signature this was written for and copies a page there
    and back intact; else None (torch's indexing moves the pages)."""
    try:
        from sgl_kernel.kvcacheio import transfer_kv_per_layer
    except ImportError:
        return None
    expected = ["src_k", "dst_k", "src_v", "dst_v", "src_indices", "dst_indices", "item_size"]
    if list(inspect.signature(transfer_kv_per_layer).parameters)[:7] != expected:
        return None
    copier = SglCopier(transfer_kv_per_layer)
    device = torch.device("cuda", torch.cuda.current_device())
    on_device = KVPool(1, 2, 4, 2, 64, torch.bfloat16, device)
    pinned = torch.zeros(KVPool.bytes_per_page(1, 4, 2, 64, torch.bfloat16) * 2, dtype=torch.uint8).pin_memory()
    on_host = KVPool(1, 2, 4, 2, 64, torch.bfloat16, torch.device("cpu"), memory=pinned)
    on_device.kv[0].normal_()
    copier.prepare(on_device, [1], on_host, [1])(0)
    back = KVPool(1, 2, 4, 2, 64, torch.bfloat16, device)
    copier.prepare(on_host, [1], back, [1])(0)
    torch.cuda.synchronize(device)
    intact = torch.equal(back.kv[0][1], on_device.kv[0][1]) and torch.equal(on_host.kv[0][1], on_device.kv[0][1].cpu())
    return copier if intact else None
