"""The KV tiers under the device pool, as the scheduler keeps them (SGLang's HiCache): the host tier's page
ids, the write policy, and where disk keeps page files.

A page is named by its chain key: a hash of the key before it and its own tokens, starting from its
tree's root key (the shared tree's, or a cache salt's). The key names the page's file on disk, so a
restarted server, or another replica of the same model on the host, finds the pages a prompt's prefix
left there; the engine writes and reads the files in the folder of its model and KV layout
(runtime.engine.kv_tiers.namespace), which it names when it answers a new scheduler (frames.Adopt).

The host tier's memory starts with its index (HostIndex): what each host page holds, written by the engine
as it stores pages, and read by a new scheduler, which maps the keeper's segment, to rebuild the tier's tree."""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.scheduler.pages import PageAllocator
from runtime.step import HostEntry

KEY_BYTES = 16
INDEX_ALIGN = 4096  # the host tier's pages start on a boundary of this many bytes after its index
WRITE_POLICIES = ("write_through", "write_back")
STORAGE_BACKENDS = ("file",)
TIER_NAMES = ("device", "host", "disk")  # where a cached prompt token was found


def root_key(salt: str | None) -> bytes:
    """The key a tree's chains start from: the shared tree's, or a cache salt's."""
    seed = b"ringllm:shared" if salt is None else b"ringllm:salt:" + salt.encode()
    return hashlib.blake2b(seed, digest_size=KEY_BYTES).digest()


def chain_keys(parent: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """The chain key of each whole page of `tokens`, which follow the page whose key is `parent`."""
    keys = []
    for start in range(0, len(tokens) - len(tokens) % page_size, page_size):
        parent = hashlib.blake2b(parent + array("i", tokens[start : start + page_size]).tobytes(), digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys


def page_file(folder: Path, key: bytes) -> Path:
    return folder / f"{key.hex()}.kv"


def count_pages(folder: Path) -> int:
    """The page files in a disk tier's folder."""
    try:
        with os.scandir(folder) as entries:
            return sum(entry.name.endswith(".kv") for entry in entries)
    except FileNotFoundError:  # none written yet
        return 0


@dataclass
class Tiers:
    host: PageAllocator  # the host tier's pages
    write_through: bool  # store a page to the host tier (and disk) as it enters the tree; else as it leaves the device
    disk: Path | None = None  # the folder of this model's page files, once the engine has named it

    def on_disk(self, key: bytes) -> bool:
        return self.disk is not None and page_file(self.disk, key).exists()


class HostIndex:
    """Per host page, in the tier's first bytes: valid, its chain key, the key before it, its place in the chain
    and its tokens. An entry is valid once the store that wrote its page has run."""

    def __init__(self, memory: np.ndarray, num_pages: int, page_size: int) -> None:
        """`memory`: the tier's bytes (uint8), at least HostIndex.bytes_for of them."""
        at = 0

        def take(shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
            nonlocal at
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            array = memory[at : at + size].view(dtype).reshape(shape)
            at += size
            return array

        self.positions = take((num_pages,), np.int64)
        self.tokens = take((num_pages, page_size), np.int32)
        self.keys = take((num_pages, KEY_BYTES), np.uint8)
        self.parents = take((num_pages, KEY_BYTES), np.uint8)
        self.valid = take((num_pages,), np.uint8)

    @staticmethod
    def bytes_for(num_pages: int, page_size: int) -> int:
        """The index's bytes, rounded up to INDEX_ALIGN: where the tier's pages start."""
        size = num_pages * (8 + 4 * page_size + 2 * KEY_BYTES + 1)
        return -(-size // INDEX_ALIGN) * INDEX_ALIGN

    def entries(self) -> list[HostEntry]:
        return [
            (int(page), self.keys[page].tobytes(), self.parents[page].tobytes(), int(self.positions[page]), self.tokens[page].tolist())
            for page in np.flatnonzero(self.valid)
        ]
