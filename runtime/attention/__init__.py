"""Attention backends behind one interface (runtime.attention.backend), chosen by name."""

from runtime.attention.flashinfer_backend import FlashInferAttention
from runtime.attention.torch_backend import TorchAttention
from runtime.config import ATTENTION_BACKEND_NAMES

ATTENTION_BACKENDS: dict[str, type] = {"torch": TorchAttention, "flashinfer": FlashInferAttention}
assert tuple(ATTENTION_BACKENDS) == ATTENTION_BACKEND_NAMES, "runtime.config names the backends EngineConfig accepts"
