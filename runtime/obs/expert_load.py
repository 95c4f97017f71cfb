"""Mixture-of-experts routing load, for operators: every stats interval each replica's engine (rank 0)
publishes the tokens each expert of each sparse layer took over the interval, as a JSON file in the
server's metrics folder (replaced whole, so a reader never sees half of one) and as the gauge
ringllm:moe_expert_load_imbalance{layer}: a layer's busiest expert's tokens over the mean expert's
(1 is perfect balance). A replica publishes after a step that ends an interval, so an idle one keeps
showing its last busy interval (the record says when it ended)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from runtime.obs.metrics import MULTIPROC_ENV, metrics


def imbalance(tokens_per_expert: np.ndarray) -> np.ndarray:
    """Per layer (row): max over mean tokens per expert; 0 for a layer that saw no token."""
    mean = tokens_per_expert.mean(axis=1)
    return np.where(mean > 0, tokens_per_expert.max(axis=1) / np.maximum(mean, 1e-9), 0.0)


def _path(replica: int) -> Path | None:
    folder = os.environ.get(MULTIPROC_ENV)
    return None if folder is None else Path(folder) / f"expert-load-{replica}.json"


def publish(replica: int, layers: list[int], tokens_per_expert: np.ndarray, interval_s: float) -> None:
    """Record one interval's counts ([sparse layers, experts]) for /server_info and the gauge."""
    ratios = imbalance(tokens_per_expert)
    gauge = metrics().moe_imbalance
    for layer, ratio in zip(layers, ratios):
        gauge.labels(str(replica), str(layer)).set(float(ratio))
    record = {
        "replica": replica,
        "interval_s": round(interval_s, 3),
        "at": time.time(),
        "layers": layers,
        "imbalance": [round(float(r), 3) for r in ratios],
        "tokens_per_expert": tokens_per_expert.astype(np.int64).tolist(),
    }
    if (path := _path(replica)) is not None:
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(orjson.dumps(record))
        os.replace(partial, path)


def read(replicas: int) -> list[dict[str, Any]]:
    """The latest interval each replica published (none before its first)."""
    found = []
    for replica in range(replicas):
        path = _path(replica)
        if path is not None and path.exists():
            found.append(orjson.loads(path.read_bytes()))
    return found
