"""The engine: weights, the KV pool, per-slot state and sampling. It executes step plans and
makes no scheduling decision."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from runtime.attention import ATTENTION_BACKENDS, ForwardBatch, KVPool, SeqSpan
from runtime.config import EngineConfig, ModelConfig
from runtime.loader import build_model
from runtime.sampling import SampleRow, sample
from runtime.sampling_params import SamplingParams
from runtime.step import Sampled, StepPlan

log = structlog.get_logger()

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class SlotState:
    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose KV is written


class Engine:
    def __init__(self, model_dir: Path, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model_config = ModelConfig.load(model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model = build_model(self.model_config, model_dir, self.dtype, self.device, config.dummy_weights)
        self.num_pages = config.kv_pages()
        cfg = self.model_config
        self.pool = KVPool(cfg.num_layers, self.num_pages, config.page_size, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.attention = ATTENTION_BACKENDS[config.attention_backend](self.pool, cfg.num_heads)
        self.slots: dict[int, SlotState] = {}
        log.info("engine_ready", architecture=cfg.architecture, dtype=str(self.dtype), device=str(self.device), pages=self.num_pages)

    def _apply(self, plan: StepPlan) -> None:
        for slot in plan.freed:
            self.slots.pop(slot, None)
        for new in plan.new_slots:
            self.slots[new.slot] = SlotState(new.params, new.seed, new.prompt_ids, list(new.output_ids), length=new.cached)
        for slot, pages in plan.pages:
            self.slots[slot].pages += pages

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[Sampled]:
        self._apply(plan)
        feeds = [(c.slot, c.token_ids, c.sample) for c in plan.chunks]
        feeds += [(slot, self.slots[slot].output_ids[-1:], True) for slot in plan.decodes]
        ids, positions, out_slots, seqs, sample_rows, sample_slots = [], [], [], [], [], []
        ps = self.config.page_size
        for slot, tokens, wants_sample in feeds:
            state = self.slots[slot]
            start, end = state.length, state.length + len(tokens)
            seqs.append(SeqSpan(len(ids), len(tokens), end, state.pages))
            ids += tokens
            positions += range(start, end)
            out_slots += (state.pages[p // ps] * ps + p % ps for p in range(start, end))
            state.length = end
            if wants_sample:
                sample_rows.append(len(ids) - 1)
                sample_slots.append(slot)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            out_slots=torch.tensor(out_slots, dtype=torch.long, device=self.device),
            seqs=seqs,
        )
        self.attention.prepare(batch)
        hidden = self.model(batch, self.attention)
        if not sample_slots:
            return []
        logits = self.model.logits(hidden[torch.tensor(sample_rows, device=self.device)])
        rows = [self._sample_row(self.slots[slot]) for slot in sample_slots]
        tokens, logprobs = sample(logits, rows)
        for slot, token in zip(sample_slots, tokens):
            self.slots[slot].output_ids.append(token)
        return [Sampled(slot, token, lp) for slot, token, lp in zip(sample_slots, tokens, logprobs)]

    @staticmethod
    def _sample_row(state: SlotState) -> SampleRow:
        return SampleRow(state.params, state.seed, len(state.prompt_ids) + len(state.output_ids), state.prompt_ids, state.output_ids)
