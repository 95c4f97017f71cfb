"""LoRA adapters over the decoder family's projections, many in one batch.

An adapter is a PEFT checkpoint as it ships (adapter_config.json and adapter_model.safetensors): for each
targeted projection of each layer, A [rank, in] and B [out, rank], applied as y = W x + s · B (A x) with
s = alpha / rank (alpha / sqrt(rank) under rsLoRA). It is read once into host memory, this rank's shard only
(B split as a column-parallel projection's rows, A as a row-parallel one's columns: the all-reduce that sums the
base's partial outputs sums the adapter's too), with s folded into B.

On the device each fused projection (qkv, o, gate_up, down) holds a stack of `slots` adapters: A [slots,
parts · R, in] and B [slots, out, parts · R], B block-diagonal over the fused parts (q, k, v), R the largest rank
served, smaller ranks zero-padded; slot 0 stays zero, the rows with no adapter. A step's rows are grouped by
their slot (LoraRows), and each group adds its (x A^T) B^T to the projection's output: one pair of matmuls a
group, on CPU and GPU alike. Adapters move into slots as steps need them, the least recently used out
(Adapters.place)."""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from runtime.config import DEFAULT_MAX_LORA_RANK, LORA_TARGETS, EngineConfig, ModelConfig
from runtime.distributed import TensorParallel
from runtime.models.sharding import read_shard

Tensor = torch.Tensor

# a checkpoint's projection -> (the fused module it is part of, its part there)
PLACES = (("qkv_proj", 0), ("qkv_proj", 1), ("qkv_proj", 2), ("o_proj", 0), ("gate_up_proj", 0), ("gate_up_proj", 1), ("down_proj", 0))
TARGETS: dict[str, tuple[str, int]] = dict(zip(LORA_TARGETS, PLACES))
ROW_PARALLEL = ("o_proj", "down_proj")  # their inputs are split across ranks: A is, B is whole
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served: its folder, its config or its weights say why."""


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    rank: int
    # (layer, checkpoint projection) -> (A [rank, in], s · B [out, rank]): this rank's shard, on the host
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = field(repr=False)


def adapter_rank(path: str) -> int:
    return int(_adapter_config(Path(path))["r"])


def _adapter_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{folder} is not a PEFT LoRA adapter folder: {exc}") from None


def read_adapter(name: str, path: str, cfg: ModelConfig, tp: TensorParallel, max_rank: int, targets: tuple[str, ...]) -> Adapter:
    """The adapter at `path` (a PEFT folder), this rank's shard; AdapterError for one this engine cannot serve or read."""
    try:
        return _read_adapter(name, path, cfg, tp, max_rank, targets)
    except AdapterError:
        raise
    except (OSError, ValueError, TypeError, KeyError, SafetensorError) as exc:  # a corrupt file, a config of wrong types
        raise AdapterError(f"the adapter {name} at {path} could not be read: {exc}") from None


def _read_adapter(name: str, path: str, cfg: ModelConfig, tp: TensorParallel, max_rank: int, targets: tuple[str, ...]) -> Adapter:
    folder = Path(path)
    config = _adapter_config(folder)
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", config.get("r", 1)))
    unsupported = [
        what
        for what, present in (
            ("DoRA (use_dora)", config.get("use_dora")),
            ("per-module ranks (rank_pattern)", config.get("rank_pattern")),
            ("per-module alphas (alpha_pattern)", config.get("alpha_pattern")),
            ("trained whole modules (modules_to_save)", config.get("modules_to_save")),
            ("trained biases", config.get("bias", "none") != "none"),
            (f"a peft_type of {config.get('peft_type')}", config.get("peft_type", "LORA") != "LORA"),
        )
        if present
    ]
    if unsupported:
        raise AdapterError(f"the adapter {name} uses {', '.join(unsupported)}, which ringllm does not serve")
    if not 0 < rank <= max_rank:
        raise AdapterError(f"the adapter {name} has rank {rank}; this server serves ranks up to {max_rank} (--max-lora-rank)")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    files = sorted(folder.glob("adapter_model*.safetensors"))
    if not files:
        raise AdapterError(f"the adapter {name} has no adapter_model.safetensors in {folder}")
    parts: dict[tuple[int, str], dict[str, Tensor]] = {}
    for file in files:
        with safe_open(file, "pt") as checkpoint:
            for key in checkpoint.keys():  # noqa: SIM118  # safe_open is not iterable
                match = _KEY.search(key)
                if match is None or match[2] not in TARGETS:
                    raise AdapterError(f"the adapter {name} trains {key}, which ringllm does not serve (only {', '.join(TARGETS)})")
                layer, projection, side = int(match[1]), match[2], match[3]
                if projection not in targets:
                    raise AdapterError(f"the adapter {name} targets {projection}, outside --lora-target-modules ({', '.join(targets)})")
                if layer >= cfg.num_layers:
                    raise AdapterError(f"the adapter {name} has weights for layer {layer}; the model has {cfg.num_layers}")
                # each rank keeps its shard: B split by rows as a column-parallel projection, A by columns as a row-parallel one
                shard = side == ("A" if projection in ROW_PARALLEL else "B")
                tensor = read_shard(f"{projection}.weight", checkpoint.get_slice(key), cfg, tp) if shard else checkpoint.get_tensor(key)
                parts.setdefault((layer, projection), {})[side] = tensor.float()
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
    for (layer, projection), pair in parts.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"the adapter {name} has lora_A or lora_B of layer {layer}'s {projection} without the other")
        weights[layer, projection] = (pair["A"], pair["B"] * scale)
    return Adapter(name, path, rank, weights)


@dataclass
class LoraRows:
    """The step's rows by adapter slot: (slot, the rows' indices on the device, or None for every row); shared by
    every LoraLinear of the model, set before each forward."""

    groups: list[tuple[int, Tensor | None]] = field(default_factory=list)


class LoraLinear(nn.Module):
    """A projection (a fused one's parts side by side) and the slotted adapters over it."""

    def __init__(self, base: nn.Linear, part_sizes: tuple[int, ...], slots: int, rank: int, rows: LoraRows) -> None:
        """`base`: the projection as loaded, before the CPU's prepacking replaces it (which reaches it as `base`)."""
        super().__init__()
        self.base: nn.Module = base
        self.rows, self.rank, self.part_sizes = rows, rank, part_sizes
        parts, like = len(part_sizes), {"device": base.weight.device, "dtype": base.weight.dtype}
        self.a = torch.zeros(slots, parts * rank, base.in_features, **like)
        self.b = torch.zeros(slots, sum(part_sizes), parts * rank, **like)

    def forward(self, x: Tensor) -> Tensor:
        out = self.base(x)
        for slot, index in self.rows.groups:
            if index is None:
                out += (x @ self.a[slot].T) @ self.b[slot].T
            else:
                out.index_add_(0, index, (x[index] @ self.a[slot].T) @ self.b[slot].T)
        return out

    def place(self, slot: int, parts: dict[int, tuple[Tensor, Tensor]]) -> None:
        """An adapter's A and B of this projection's parts (by part index) into `slot`; parts it leaves out are zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        start = 0
        for part, size in enumerate(self.part_sizes):
            if part in parts:
                a, b = parts[part]
                rows = slice(part * self.rank, part * self.rank + len(a))
                self.a[slot, rows] = a.to(self.a.dtype)
                self.b[slot, start : start + size, rows] = b.to(self.b.dtype)
            start += size


class Adapters:
    """The adapters an engine serves: every loaded one on the host (by name), up to `slots - 1` of them in the
    projections' device slots, the least recently used moving out for one a step needs."""

    def __init__(self, cfg: ModelConfig, config: EngineConfig, tp: TensorParallel, device: torch.device) -> None:
        self.cfg, self.tp, self.device = cfg, tp, device
        self.slots, self.max_loaded = config.max_loras_per_batch + 1, config.max_loaded_loras
        self.targets = config.lora_target_modules or tuple(TARGETS)
        given = [adapter_rank(path) for _, path in config.lora_adapters]
        self.max_rank = config.max_lora_rank or max(given, default=DEFAULT_MAX_LORA_RANK)
        self.rows = LoraRows()
        self.loaded: dict[str, Adapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.free_slots = list(range(self.slots - 1, 0, -1))
        self.modules: dict[tuple[int, str], LoraLinear] = {}

    def attach(self, model: nn.Module) -> None:
        """Wrap each projection an adapter may target (build_model calls it once the weights are in)."""
        for index, layer in enumerate(model.model.layers):  # pyright: ignore[reportAttributeAccessIssue, reportCallIssue, reportArgumentType]
            attention, mlp = layer.self_attn, layer.mlp
            for owner, fused in ((attention, "qkv_proj"), (attention, "o_proj"), (mlp, "gate_up_proj"), (mlp, "down_proj")):
                base = getattr(owner, fused, None)
                if not isinstance(base, nn.Linear) or not any(TARGETS[t][0] == fused for t in self.targets):
                    continue  # MLA's projections, a sparse layer's experts: no adapter reaches them
                sizes = getattr(base, "shard_sizes", (base.out_features,))
                wrapped = LoraLinear(base, tuple(sizes), self.slots, self.max_rank, self.rows)
                setattr(owner, fused, wrapped)
                self.modules[index, fused] = wrapped

    def load(self, name: str, path: str) -> Adapter:
        """Read an adapter into host memory (again, where one of its name is loaded: its slot is refilled when next used)."""
        if name not in self.loaded and self.max_loaded is not None and len(self.loaded) >= self.max_loaded:
            raise AdapterError(f"{len(self.loaded)} adapters are loaded, the most this server holds (--max-loaded-loras); unload one first")
        adapter = read_adapter(name, path, self.cfg, self.tp, self.max_rank, self.targets)
        for (layer, projection), (a, b) in adapter.weights.items():
            fused, part = TARGETS[projection]
            if (module := self.modules.get((layer, fused))) is None:
                raise AdapterError(f"the adapter {name} targets layer {layer}'s {projection}, which takes no adapter in this model")
            wanted = ((adapter.rank, module.a.shape[2]), (module.part_sizes[part], adapter.rank))
            if (tuple(a.shape), tuple(b.shape)) != wanted:
                raise AdapterError(
                    f"the adapter {name}'s layer {layer} {projection} has A {tuple(a.shape)} and B {tuple(b.shape)} here; this "
                    f"model's shard takes {wanted[0]} and {wanted[1]} (an adapter of another base model?)"
                )
        self._evict(name)
        self.loaded[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if self.loaded.pop(name, None) is None:
            raise AdapterError(f"no adapter named {name} is loaded")
        self._evict(name)

    def _evict(self, name: str) -> None:
        if (slot := self.resident.pop(name, None)) is not None:
            self.free_slots.append(slot)

    def set_rows(self, names: list[str | None], counts: np.ndarray) -> set[str]:
        """The next forward's rows: sequence i runs with adapter names[i] (None: the base alone) over counts[i] rows.
        Returns the names no longer loaded (unloaded while a request ran with one): their rows run as the base's, and
        the engine fails their requests."""
        missing = {name for name in names if name is not None and name not in self.loaded}
        names = [None if name in missing else name for name in names]
        wanted = {name for name in names if name is not None}
        if not wanted:
            self.rows.groups = []
            return missing
        slot_of = {name: self._place(name, wanted) for name in wanted}
        seq_slots = np.array([0 if name is None else slot_of[name] for name in names], dtype=np.int64)
        if len(wanted) == 1 and (seq_slots != 0).all():
            self.rows.groups = [(int(seq_slots[0]), None)]
            return missing
        row_slots = np.repeat(seq_slots, counts)
        self.rows.groups = [
            (slot, torch.from_numpy(np.flatnonzero(row_slots == slot)).to(self.device, non_blocking=True)) for slot in slot_of.values()
        ]
        return missing

    def _place(self, name: str, wanted: set[str]) -> int:
        """The device slot holding `name`, moved in now where it is not, in place of the least recently used
        adapter that this step does not run."""
        if name in self.resident:
            self.resident.move_to_end(name)
            return self.resident[name]
        adapter = self.loaded[name]  # set_rows passes loaded names only
        if not self.free_slots:
            victim = next((held for held in self.resident if held not in wanted), None)
            if victim is None:
                raise AdapterError("a step runs more adapters than --max-loras-per-batch")
            self.free_slots.append(self.resident.pop(victim))
        slot = self.free_slots.pop()
        by_module: dict[tuple[int, str], dict[int, tuple[Tensor, Tensor]]] = {}
        for (layer, projection), pair in adapter.weights.items():
            fused, part = TARGETS[projection]
            by_module.setdefault((layer, fused), {})[part] = pair
        for key, module in self.modules.items():
            module.place(slot, by_module.get(key, {}))
        self.resident[name] = slot
        return slot
