"""GPT-OSS: the decoder with biases on q, k, v and o, a learned attention sink per head (the config's, which every
attention backend takes), sliding windows on every other layer, YaRN rope, and a sparse MLP in every layer whose
router and experts have biases and whose experts gate with a clamped SwiGLU (runtime.models.moe). Its checkpoints
stack each layer's experts as transformers does ([E, H, 2·I], gate and up columns interleaved; [E, I, H]), in bf16
or MXFP4 (runtime.models.mxfp4): they are turned into the model's layout as they load."""

from __future__ import annotations

import torch

from runtime.config import ModelConfig
from runtime.distributed import TensorParallel
from runtime.models.decoder import DecoderForCausalLM
from runtime.models.layers import FusedOps


class GptOssForCausalLM(DecoderForCausalLM):
    def __init__(self, cfg: ModelConfig, ops: FusedOps, tp: TensorParallel) -> None:
        if tp.size > 1:  # its stacked experts and sinks are read whole: no shard of them is cut yet
            raise ValueError("GPT-OSS runs on one rank (--tp 1) for now")
        super().__init__(cfg, ops, tp)

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(".experts.gate_up_proj"):  # [E, H, 2I] -> [E, 2I, H], gate rows first
            rows = tensor.transpose(1, 2)
            return torch.cat((rows[:, 0::2], rows[:, 1::2]), dim=1)
        if name.endswith(".experts.gate_up_proj_bias"):
            return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
        if name.endswith(".experts.down_proj"):  # [E, I, H] -> [E, H, I]
            return tensor.transpose(1, 2)
        return tensor
