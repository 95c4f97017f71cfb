"""DeepSeek-V3/R1: the decoder with multi-head latent attention (runtime.models.mla), dense MLPs in the first
first_k_dense_replace layers and sparse ones after, routed by sigmoid scores over groups with a shared MLP beside
them (runtime.models.moe). Checkpoints whose rope dims come in pairs (rope_interleave) have those rows of q's and
the latent's projections reordered as they load (evens, then odds): rope then rotates halves, as everywhere else,
and q·k is the same sum."""

from __future__ import annotations

import torch

from runtime.models.decoder import DecoderForCausalLM

ROPED_ROWS = (".q_b_proj.weight", ".q_proj.weight", ".kv_a_proj_with_mqa.weight", ".kv_a_proj_with_mqa.bias")


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        mla = self.config.mla
        assert mla is not None
        if not mla.rope_interleave or not name.endswith(ROPED_ROWS):
            return tensor
        rope = mla.qk_rope_head_dim
        order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        if ".kv_a_proj_with_mqa." in name:  # the latent, then the shared roped part
            return torch.cat([tensor[: mla.kv_lora_rank], tensor[mla.kv_lora_rank :][order]])
        heads = tensor.view(self.config.num_heads, mla.qk_nope_head_dim + rope, -1)  # each head: unroped, then roped rows
        return torch.cat([heads[:, : mla.qk_nope_head_dim], heads[:, mla.qk_nope_head_dim :][:, order]], dim=1).view_as(tensor)
