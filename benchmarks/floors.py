"""The least time `ringllm bench offline`'s workload can take on a card, from its bytes and FLOPs at the
card's measured rates: what a throughput target is checked against before it is chased.

A decode step reads each weight it uses once (in a MoE layer, the experts its rows pick: expected
over uniform routing) and the KV of every live request, and does 2 FLOPs a weight a row; it takes
the longer of the two. The workload's requests all start at once and each ends at its output
length, so step t runs only the requests longer than t: the floor sums the steps as they shrink,
where "256 rows a step" would count a full batch to the end. The prefill does 2 FLOPs a weight a
prompt token, plus attention's. `--single` adds the floor of one request (the workload's first
prompt, 512 tokens out).

    python -m benchmarks.floors --model benchmarks/models/qwen3-30b-a3b --bandwidth 4.3 --tflops 700
    python -m benchmarks.floors --model benchmarks/models/qwen3-8b-fp8 --weight-bytes 1 --kv-bytes 1 ...
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from benchmarks.offline import SINGLE_PROMPT, workload
from runtime.config import ModelConfig

FULL_CONTEXT = 1100  # a mid-run context of the workload (prompts 100-1024, outputs 100-1024), for the full-batch figure


@dataclass(frozen=True)
class Shape:
    """A model's weights by how a step reads them, in parameters."""

    always: int  # attention, dense MLPs, router, norms-free: every step reads them whole
    head: int  # the LM head (read once a step, one row's worth of FLOPs a sequence in prefill)
    expert: int  # one expert of one sparse layer
    sparse_layers: int
    experts: int
    top_k: int
    kv_values: int  # K and V values a token keeps in the full-attention layers
    window_kv_values: int = 0  # ... and in the sliding-window layers, which read the last `window` tokens' alone
    window: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig) -> Shape:
        attention = cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
        kv_token = 2 * cfg.num_kv_heads * cfg.head_dim  # a token's cached values a layer
        if (mla := cfg.mla) is not None:  # q through its rank, the latent, kv_b_proj, o_proj; one latent a token
            qk, heads = mla.qk_nope_head_dim + mla.qk_rope_head_dim, cfg.num_heads
            q = cfg.hidden_size * mla.q_lora_rank + mla.q_lora_rank * heads * qk if mla.q_lora_rank else cfg.hidden_size * heads * qk
            kv = cfg.hidden_size * mla.latent + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
            attention, kv_token = q + kv + heads * mla.v_head_dim * cfg.hidden_size, mla.latent
        moe = cfg.moe
        sparse = sum(moe.is_sparse(layer) for layer in range(cfg.num_layers)) if moe else 0
        dense_mlp = 3 * cfg.hidden_size * cfg.intermediate_size * (cfg.num_layers - sparse)
        dense_mlp += 3 * cfg.hidden_size * moe.shared_intermediate * sparse if moe else 0  # DeepSeek's shared experts
        router = cfg.hidden_size * moe.num_experts * sparse if moe else 0
        windowed = cfg.windowed_layers
        return cls(
            always=attention * cfg.num_layers + dense_mlp + router,
            head=cfg.vocab_size * cfg.hidden_size,
            expert=3 * cfg.hidden_size * moe.intermediate_size if moe else 0,
            sparse_layers=sparse,
            experts=moe.num_experts if moe else 0,
            top_k=moe.top_k if moe else 0,
            kv_values=(cfg.num_layers - windowed) * kv_token,
            window_kv_values=windowed * kv_token,
            window=cfg.window,
        )

    def active_experts(self, rows: int) -> float:
        """Expected distinct experts a layer's rows pick, each row top_k of `experts` at random."""
        return self.experts * (1 - (1 - self.top_k / self.experts) ** rows) if self.experts else 0.0

    def step_s(self, contexts: list[int], args: argparse.Namespace) -> float:
        rows = len(contexts)
        weights = self.always + self.head + self.expert * self.sparse_layers * self.active_experts(rows)
        weights -= self.head  # the LM head stays in the model's dtype under FP8 too
        kv = sum(contexts) * self.kv_values + sum(min(c, self.window) for c in contexts) * self.window_kv_values
        read = weights * args.weight_bytes + self.head * 2 + kv * args.kv_bytes
        flops = 2 * rows * (self.always + self.head + self.expert * self.sparse_layers * self.top_k)
        return max(read / (args.bandwidth * 1e12), flops / (args.tflops * 1e12))

    def prefill_s(self, prompt_lengths: list[int], cfg: ModelConfig, args: argparse.Namespace) -> float:
        per_token = self.always + self.expert * self.sparse_layers * self.top_k
        # causal QK and PV (a sliding-window layer's row sees at most its window)
        windowed = cfg.windowed_layers
        attention = sum(
            2 * p * (p * (cfg.num_layers - windowed) + min(p, cfg.window) * windowed) * cfg.num_heads * cfg.head_dim for p in prompt_lengths
        )
        flops = 2 * per_token * sum(prompt_lengths) + 2 * self.head * len(prompt_lengths) + attention
        return flops / (args.tflops * 1e12)


def offline_floor(shape: Shape, cfg: ModelConfig, args: argparse.Namespace) -> tuple[float, float]:
    """(seconds, output tok/s) of the workload at its floor."""
    prompts, lengths = workload(args.requests)
    seconds = shape.prefill_s([len(p) for p in prompts], cfg, args)
    for step in range(max(lengths)):
        live = [len(p) + step for p, n in zip(prompts, lengths) if n > step]
        seconds += shape.step_s(live, args)
    return seconds, sum(lengths) / seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.floors", description=__doc__.splitlines()[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--model", type=Path, required=True, help="a folder with config.json")
    parser.add_argument("--bandwidth", type=float, required=True, help="the card's measured copy bandwidth, TB/s")
    parser.add_argument("--tflops", type=float, required=True, help="its measured dense GEMM rate at the weights' dtype, TFLOP/s")
    parser.add_argument("--weight-bytes", type=float, default=2.0, help="bytes a weight (2: bf16, 1: FP8; the LM head stays 2)")
    parser.add_argument("--kv-bytes", type=float, default=2.0, help="bytes a K or V value (2: bf16, 1: FP8)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--single", action="store_true", help="also one request: SINGLE_PROMPT in, 512 out")
    args = parser.parse_args(argv)
    cfg = ModelConfig.load(args.model)
    shape = Shape.of(cfg)
    seconds, rate = offline_floor(shape, cfg, args)
    full = args.requests / shape.step_s([FULL_CONTEXT] * args.requests, args)
    print(
        f"{args.model.name}: offline floor {seconds:.2f} s, {rate:,.0f} output tok/s "
        f"({full:,.0f} if every step ran {args.requests} rows of {FULL_CONTEXT} tokens)"
    )
    if args.single:
        decode = sum(shape.step_s([SINGLE_PROMPT + step], args) for step in range(512))
        print(f"{args.model.name}: one request floor {512 / decode:,.0f} output tok/s ({decode / 512 * 1e3:.2f} ms a token)")


if __name__ == "__main__":
    main()
