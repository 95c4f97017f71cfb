"""The engine: weights, the KV pool, per-slot state and sampling. It executes step plans and
makes no scheduling decision.

`launch` queues a step on the device and returns at once; `PendingStep.result` reads the sampled
ids later. A decode feeds each slot the token its previous step sampled, straight from a device
tensor, so step i+1 can be planned and queued while step i still runs. A speculative draft by a model
(DraftModel) or an EAGLE head (EagleDraft) comes from an Engine of the draft's own, just before the step
that verifies it.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import structlog
import torch

from runtime.attention import ATTENTION_BACKENDS
from runtime.attention.backend import AttentionSpec
from runtime.attention.pool import KVPool
from runtime.batch import AttentionMeta, ForwardBatch, StepAbandoned, kv_rows, paged_meta
from runtime.config import DEFAULT_KV_TOKENS, MODEL_DRAFTS, EngineConfig, ModelConfig
from runtime.distributed import SINGLE, TensorParallel
from runtime.engine.cuda_graph import DecodeGraphs, PrefillGraphs, Scratch, capture_sizes
from runtime.engine.gemm_tuner import use_few_row_gemms, use_fp8_gemms, use_one_row_fusion
from runtime.engine.kv_tiers import HostTier, LayerWaits, RunCopier, TorchCopier, namespace
from runtime.engine.sampling import Feedback, PromptLogprobs, Sample, SampleRow, logprob_dicts, sample, warm_up_draws
from runtime.models.batch_invariant import make_batch_invariant
from runtime.models.cpu_linears import default_dtype
from runtime.models.decoder import DecoderLayer
from runtime.models.eagle import Eagle3Head, EagleHead, aux_layers
from runtime.models.fp8 import kv_scales
from runtime.models.loader import build_model
from runtime.models.lora import Adapters
from runtime.models.source import resolve_model_dir
from runtime.sampling_params import SamplingParams
from runtime.step import DRAFT_HERE, Chunk, HeldKV, Sampled, StepPlan
from runtime.structured.masks import GrammarMasks
from transport import env

log = structlog.get_logger()
BRANCHED_SLOTS = 16  # the most slots whose next draft a draft model draws ahead of their verify's read (Branches)
ROW_SEQUENCE_CHUNK = 8  # chunks up to this long run in decode graphs, each row a sequence (Engine._rows_as_sequences)
STANDBY_HEADROOM_BYTES = 4 << 30  # a standby engine's CUDA context, graphs, workspaces and activations, past its weights

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else default_dtype()
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class SlotState:
    rid: int
    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]  # read back so far
    sampled: int  # tokens drawn, read back or not: the position of the next draw is prompt + sampled
    num_pages: int = 0
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # the chunks' so far, until the first draw

    def row(self) -> SampleRow:
        return SampleRow(self.params, self.seed, len(self.prompt_ids) + self.sampled, self.prompt_ids, self.output_ids)


@dataclass(eq=False)
class PendingStep:
    """A queued step's draws, copied to pinned host memory behind an event."""

    states: list[SlotState]
    slots: list[int]
    rows: list[SampleRow]
    sample: Sample | None  # None: the step sampled nothing
    host_tokens: torch.Tensor
    done: torch.cuda.Event | None
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # by row: a first draw's prompt, on the host
    errors: dict[int, str] = field(default_factory=dict)  # by slot: why its grammar allowed no token (the draw is void)
    drafts: list[DraftRows] = field(default_factory=list)  # the speculative chunks' rows, checked as they are read
    on_draft: Callable[[DraftRows, int], None] | None = None  # told each draft's kept length once read
    _results: list[Sampled] | None = field(default=None)

    @property
    def read(self) -> bool:
        return self._results is not None

    def ready(self) -> bool:
        """Has the device finished it (reading it would not block)?"""
        return self.done is None or self.done.query()

    def result(self) -> list[Sampled]:
        if self._results is None:
            if self.done is not None:
                self.done.synchronize()
            tokens = self.host_tokens.tolist()
            logprobs = logprob_dicts(self.sample, self.rows, tokens) if self.sample else []
            dropped: set[int] = set()
            for draft in self.drafts:  # a draft holds as far as each of its tokens is the one drawn before it
                kept = next((i for i, token in enumerate(draft.tokens) if tokens[draft.first + i] != token), draft.count)
                dropped.update(range(draft.first + kept + 1, draft.first + draft.count + 1))
                assert self.on_draft is not None  # set with drafts
                self.on_draft(draft, kept)
            for i, (state, token) in enumerate(zip(self.states, tokens)):
                if i not in dropped:
                    state.output_ids.append(token)
            prompts = {i: p.rows() for i, p in self.prompt_logprobs.items()}
            rows = enumerate(zip(self.slots, tokens, logprobs))
            self._results = [
                Sampled(slot, token, lp, prompts.get(i), self.errors.get(slot)) for i, (slot, token, lp) in rows if i not in dropped
            ]
        return self._results


@dataclass
class DraftRows:
    """A speculative chunk's draws: rows first.. of its step, one after the last known token and one after each
    draft token."""

    first: int
    slot: int
    count: int  # draft tokens
    state: SlotState
    source: list[int] | Callable[[], list[int]]  # the draft's tokens, or what reads them back (a draft model's, left on the device)

    @functools.cached_property
    def tokens(self) -> list[int]:
        return self.source if isinstance(self.source, list) else self.source()


@dataclass(frozen=True)
class DeviceDraft:
    """A draft model's draft tokens, left on the device for the step that verifies them: `tokens`, the DRAFT_HERE
    places' in plan order; `read(slot)`, a slot's on the host, once the step that verifies them is done (None where
    no step verifies them: a draft model's catch-up over a verify's draws)."""

    tokens: torch.Tensor
    read: Callable[[int], list[int]] | None = None


@dataclass(frozen=True)
class Followed:
    """A draft model's catch-up queued behind a verify (DraftModel.follow): `rows` rows from position `start`, drawn
    in `step` from its row `row` on; `ahead`: the decode steps that draft on from each of those rows (a branch per
    row, rows `ahead_row`.. of each step), empty where the slot's draft decodes after the verify is read."""

    start: int
    rows: int
    step: PendingStep
    row: int
    ahead: tuple[PendingStep, ...] = ()
    ahead_row: int = 0


@dataclass(frozen=True)
class Branches:
    """Where a draft model drafts ahead of a verify's read (DraftModel._branch): for up to `slots` slots at once,
    a branch per catch-up row (`rows`: draft tokens + 1), each on a slot of its own from `first_slot` on (past the
    mirrored ones) and `pages` pages of its own from `first_page` on (past the target's), decoded `decodes` times
    (draft tokens - 1)."""

    first_slot: int
    first_page: int
    slots: int
    rows: int
    decodes: int
    pages: int

    @classmethod
    def of(cls, config: EngineConfig, first_slot: int, first_page: int) -> Branches | None:
        """A STANDALONE draft's of more than one draft token; None for others."""
        draft_tokens, page_size = config.speculative_num_draft_tokens, config.page_size
        if config.speculative_algorithm != "STANDALONE" or draft_tokens < 2:
            return None
        pages = (page_size + draft_tokens - 3) // page_size + 1  # what draft_tokens - 1 positions from any page offset span
        slots = min(BRANCHED_SLOTS, config.max_running_requests)
        return cls(first_slot, first_page, slots, draft_tokens + 1, draft_tokens - 1, pages)

    @property
    def total_slots(self) -> int:
        return self.slots * self.rows

    @property
    def total_pages(self) -> int:
        return self.total_slots * self.pages

    def slot_and_pages(self, block: int, row: int) -> tuple[int, list[int]]:
        """The slot and pages of the branch from catch-up row `row` of the `block`-th slot branched at once."""
        n = block * self.rows + row
        return self.first_slot + n, list(range(self.first_page + n * self.pages, self.first_page + (n + 1) * self.pages))


@dataclass
class SpecStats:
    """Speculative chunks read so far: how many, their draft tokens, and the draft tokens kept."""

    steps: int = 0
    drafted: int = 0
    kept: int = 0
    gave: list[int] = field(default_factory=list)  # tokens each verify gave a slot, until taken (the metrics')


@dataclass(slots=True)
class HostStep:
    """A step's metadata on the host (Engine._host_step): what its forward and its draw read."""

    tokens: int  # rows of the step: each chunk's tokens, then one per decode
    seq_slots: np.ndarray  # int64 [B]: the step's sequences, chunks first
    qo_indptr: np.ndarray  # int64 [B + 1]: sequence i's rows are qo_indptr[i]:qo_indptr[i+1]
    positions: np.ndarray  # int64 [tokens]
    rope_rows: np.ndarray  # int64 [tokens]: each row's row of the rope cache (its position, but for LongRoPE's long prompts)
    kv_rows: np.ndarray  # int64 [tokens, 2]: where each row's K and V go (batch.kv_rows)
    meta: AttentionMeta
    decodes: np.ndarray  # int64: the decodes' slots
    sample_rows: np.ndarray  # int64: the rows that sample (a chunk's last, or a draft's and the one before; every decode)
    sample_slots: np.ndarray  # int64: their slots
    states: list[SlotState]
    rows: list[SampleRow]
    drafts: list[DraftRows]
    row_seqs: bool  # each row attends as a sequence of its own (meta), so that a decode graph runs the step
    drafted: DeviceDraft | None  # the draft tokens of its DRAFT_HERE places


class Engine:
    def __init__(
        self,
        model_dir: Path,
        config: EngineConfig,
        tp: TensorParallel = SINGLE,
        device: torch.device | None = None,
        kv_memory: Callable[[int, int], torch.Tensor] | None = None,
        host_memory: Callable[[int], torch.Tensor] | None = None,
        model_config: ModelConfig | None = None,
    ) -> None:
        """`tp`: this engine's rank in a tensor-parallel group it has joined, on `device` (config.device
        when None). Every rank runs every step; each holds its shard of the weights and its heads' KV.
        `kv_memory`: where the KV pool lives, (bytes, pages) -> a uint8 tensor (KVPool's `memory`); None: its own.
        `host_memory`: likewise, where the host KV tier lives (--enable-hierarchical-cache). `model_config`: the
        model's, where not the folder's config.json as it stands (a draft head's)."""
        self.config, self.tp = config, tp
        self.device = device or torch.device(config.device)
        # set by an owner that follows an eager step's progress: called between layers, True abandons the step (StepAbandoned)
        self.between_layers: Callable[[], bool] | None = None
        self.speculation = SpecStats()
        self.fault_injection = env.fault_injection()  # a test's query of death (SamplingParams.crash_at)
        self.drafter: DraftModel | None = None  # a model-drafting speculation's (the draft_model phase)
        # Start-up runs in phases, each timed for engine_ready's startup_s: where a restart's time goes.
        phases: dict[str, Callable[[], None]] = {
            "weights": lambda: self._load_weights(model_dir, model_config),
            "pool": lambda: self._make_pool(model_dir, kv_memory, host_memory),
            "kernels": self._choose_kernels,
            "graphs": self._capture_graphs,
            "warm_up": self._warm_up,
            "draft_model": self._load_draft_model,
        }
        startup_s = {}
        for phase, run in phases.items():
            started = time.monotonic()
            run()
            startup_s[phase] = round(time.monotonic() - started, 3)
        self._log_ready(startup_s)

    def _load_draft_model(self) -> None:
        """A model-drafting speculation's draft model or head, in an engine of its own over a pool of this one's
        page ids. A head runs eager (its features are set before each forward) and over the target's context."""
        config = self.config
        if (path := config.speculative_draft_model_path) is None:
            return
        folder = resolve_model_dir(path)
        branches = Branches.of(config, config.max_running_requests, self.num_pages)
        draft_config = replace(
            config,
            num_pages=self.num_pages + (branches.total_pages if branches else 0),
            max_running_requests=config.max_running_requests + (branches.total_slots if branches else 0),
            speculative_algorithm=None,
            speculative_draft_model_path=None,
            hierarchical_cache=False,
        )
        head = None
        if config.speculative_algorithm != "STANDALONE":
            head = replace(ModelConfig.load(folder), architecture=config.speculative_algorithm, max_position=self.model_config.max_position)
            draft_config = replace(draft_config, cuda_graph_max_bs=0, cuda_graph_max_prefill_tokens=0)
        draft = Engine(folder, draft_config, SINGLE, self.device, model_config=head)
        if draft.model_config.vocab_size != self.model_config.vocab_size or draft.max_pages_per_seq < self.max_pages_per_seq:
            raise ValueError(f"the draft model {path} needs the target's vocabulary and at least its context")
        self.drafter = DraftModel(draft, branches) if head is None else EagleDraft(draft, self)

    def _load_weights(self, model_dir: Path, model_config: ModelConfig | None) -> None:
        """The checkpoint's config, the dtypes of the weights and the KV cache, and the model's weights
        (this rank's shard), made batch-invariant under deterministic inference."""
        config, tp = self.config, self.tp
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model_config = cfg = model_config or ModelConfig.load(model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = torch.float8_e4m3fn if config.fp8_kv else self.dtype
        if config.deterministic and (cfg.moe is not None or cfg.fp8 is not None):  # expert GEMMs take rows by routing; FP8 scales span rows
            raise ValueError("deterministic inference serves dense, unquantized checkpoints")
        if cfg.mla is not None and config.fp8_kv:
            raise ValueError("multi-head latent attention keeps its latents in the model's dtype (--kv-cache-dtype auto)")
        if cfg.window and (config.hierarchical_cache or config.speculative_algorithm in MODEL_DRAFTS):
            raise ValueError("models with sliding windows run without --enable-hierarchical-cache and without draft models (NGRAM drafts)")
        if config.enable_lora and (cfg.moe is not None or cfg.mla is not None):
            raise ValueError("LoRA adapters are served over dense models without latent attention")
        if config.enable_lora and cfg.fp8 is not None:
            raise ValueError("LoRA adapters are served over unquantized checkpoints (not FP8)")
        self.adapters = Adapters(cfg, config, tp, self.device) if config.enable_lora else None
        self.lora_errors: dict[int, str] = {}  # by slot: its adapter was unloaded while it ran (the next draw fails it)
        adapt = self.adapters.attach if self.adapters is not None else None
        self.model = build_model(
            cfg, model_dir, self.dtype, self.device, config.dummy_weights, tp=tp, quantization=config.quantization, adapt=adapt
        )
        for name, path in config.lora_adapters:
            self.adapters.load(name, path)  # pyright: ignore[reportOptionalMemberAccess]  # lora_paths turn LoRA on
        # deterministic inference: projections, then the sampler's row-wise reductions, on blocks of this many rows
        self.block_rows = make_batch_invariant(self.model, self.device) if config.deterministic else None

    def _make_pool(
        self, model_dir: Path, kv_memory: Callable[[int, int], torch.Tensor] | None, host_memory: Callable[[int], torch.Tensor] | None
    ) -> None:
        """The KV pool (in `kv_memory` where given) and its host tier (in `host_memory`), the attention backend
        over the pool, and the per-slot state that indexes it: page table, lengths, last tokens, grammars."""
        cfg, config, tp = self.model_config, self.config, self.tp
        self.kv_heads = tp.split(cfg.kv_cache_heads)[1]
        self.num_pages = tp.min(self._pool_pages())  # the scheduler's one page table serves every rank
        self.scratch_page = self.num_pages  # one page past the scheduler's: padding rows of CUDA graphs write here
        scales = kv_scales(model_dir, cfg.num_layers) if config.fp8_kv and not config.dummy_weights else None
        page_bytes = KVPool.bytes_per_page(cfg.num_layers, config.page_size, self.kv_heads, cfg.kv_cache_dim, self.kv_dtype)
        # a sliding-window layer's pages are the window pool's (runtime.scheduler.window_pages), each with its scratch page;
        # window_of: the window page the scheduler paired with each page (-1: none)
        self.window_of: np.ndarray | None = None
        layer_pages = [self.num_pages + 1] * cfg.num_layers
        if cfg.window:
            window_pages = config.window_pages_for(self.num_pages, cfg.window)
            layer_pages = [window_pages + 1 if window else self.num_pages + 1 for window in cfg.layer_windows]
            self.window_of = np.full(self.num_pages + 1, -1, dtype=np.int64)
            self.window_of[self.scratch_page] = window_pages
        layer_bytes = KVPool.bytes_per_page(1, config.page_size, self.kv_heads, cfg.kv_cache_dim, self.kv_dtype)
        self.pool = KVPool(
            cfg.num_layers,
            self.num_pages + 1,
            config.page_size,
            self.kv_heads,
            cfg.kv_cache_dim,
            self.kv_dtype,
            self.device,
            self.dtype,
            scales,
            kv_memory(sum(layer_pages) * layer_bytes, self.num_pages) if kv_memory else None,
            layer_pages,
        )
        self.tiers: HostTier | None = None
        if host_pages := config.host_tier_pages(self.num_pages, page_bytes):
            disk = None
            if config.hicache_storage_backend:
                disk = Path(config.hicache_storage_dir or env.cache_root() / "hicache") / namespace(
                    model_dir, self.pool, config.dummy_weights
                )
            memory = host_memory(HostTier.bytes_for(host_pages, page_bytes, config.page_size)) if host_memory else None
            self.tiers = HostTier(self.pool, host_pages, memory, disk)
        assert config.attention_backend is not None  # EngineConfig fills in the device's default
        self.attention = ATTENTION_BACKENDS[config.attention_backend](
            self.pool, tp.split(cfg.num_heads)[1], AttentionSpec.of(cfg), config.deterministic
        )
        slots = config.max_running_requests
        self.max_pages_per_seq = config.pages_for(cfg.max_position) + 1
        self.page_table = np.zeros((slots, self.max_pages_per_seq), dtype=np.int64)
        self.lengths = np.zeros(slots, dtype=np.int64)  # tokens whose KV is written (or queued to be)
        # each slot's last sampled token, which its next decode feeds; past them, a decode graph's chunk rows' tokens
        self.token_sources = torch.zeros(slots + self._graph_limits()[0], dtype=torch.int64, device=self.device)
        self.last_tokens = self.token_sources[:slots]
        self.slots: dict[int, SlotState] = {}
        self.grammars = GrammarMasks(model_dir, cfg.vocab_size, cfg.eos_token_ids, config.grammar_compile_timeout)
        self._unread: deque[PendingStep] = deque()
        # steps no one will read, held until the device is done with them: the sampler writes a step's draws into
        # its pinned host buffer itself, which freed earlier could be handed out again before that write
        self._forgotten: list[PendingStep] = []
        # the last launch's host time spent reading earlier draws back and filling grammar masks (steps that need them)
        self.host_waits: dict[str, float] = {}
        # a disaggregated decode engine's: the prefill engine's pool, which StepPlan.imports copy from, the bytes so far,
        # and each request's copy, (bytes, start, end: CUDA events, or times on CPU) until take_imports
        self.peer: KVPool | None = None
        self.imported_bytes = 0
        self._imports: deque[tuple[int, Any, Any]] = deque()

    def _graph_limits(self) -> tuple[int, int]:
        """(the largest decode batch, the most prefill tokens) that CUDA graphs capture, 0 for none.
        Graphs are captured on CUDA under the flashinfer backend only."""
        config = self.config
        if self.device.type != "cuda" or config.attention_backend != "flashinfer" or config.enable_lora:  # LoRA steps run eager
            return 0, 0
        return min(config.cuda_graph_max_bs, config.max_running_requests), config.cuda_graph_max_prefill_tokens

    def _choose_kernels(self) -> None:
        """Times the kernels that may stand in for cuBLAS and swaps in the winners (runtime.engine.gemm_tuner):
        FP8 GEMMs on CUDA, and few-row GEMMs and one-row fusions for decode graphs. Kernels chosen per
        row count are not batch-invariant: deterministic inference keeps cuBLAS. `chosen_kernels` says
        what won."""
        fp8_gemms = use_fp8_gemms(self.model, self.dtype) if self.device.type == "cuda" else {}
        few_row_gemms, one_row_fused = {}, {}
        max_bs = self._graph_limits()[0]
        if max_bs and not self.config.deterministic:
            few_row_gemms = use_few_row_gemms(self.model, capture_sizes(max_bs), self.device, self.dtype)
            layers = cast("list[DecoderLayer]", list(self.model.model.layers))  # a ModuleList is typed as holding any Module
            one_row_fused = use_one_row_fusion(layers, self.device, self.dtype, allow_summed=self.tp.size == 1)
        self.chosen_kernels: dict[str, dict] = {"few_row_kernels": few_row_gemms, "fp8_kernels": fp8_gemms, "one_row_fused": one_row_fused}

    def _capture_graphs(self) -> None:
        """CUDA graphs of decode steps up to the largest batch, and of prefill steps up to the most
        tokens, where _graph_limits allows them; the prefill graphs share the decode graphs' memory pool."""
        max_bs, prefill_tokens = self._graph_limits()
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if max_bs:
            self.graphs = DecodeGraphs(
                self.model, self.attention, max_bs, self.max_pages_per_seq, self._scratch(), self.token_sources, len(self.last_tokens)
            )
        if prefill_tokens:
            self.prefill_graphs = PrefillGraphs(
                self.model,
                self.attention,
                prefill_tokens,
                self.max_pages_per_seq,
                self._scratch(),
                self.device,
                self.graphs.pool if self.graphs else None,
            )

    def _kv_rows(self, pages: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """batch.kv_rows of tokens at (page, offset): [T, 2], or [T, 4] with the window pool's rows after."""
        rows = kv_rows(pages, offsets, self.config.page_size)
        if self.window_of is None:
            return rows
        return np.concatenate([rows, kv_rows(self.window_of[pages], offsets, self.config.page_size)], axis=1)

    def _scratch(self) -> Scratch:
        window_page = int(self.window_of[self.scratch_page]) if self.window_of is not None else None
        return Scratch(self.scratch_page, window_page, self.config.page_size)

    def _log_ready(self, startup_s: dict[str, float]) -> None:
        """engine_ready: each start-up phase's seconds and what start-up chose (kernels, graphs, pages)."""
        cfg, config, graphs = self.model_config, self.config, self.graphs
        log.info(
            "engine_ready",
            startup_s=startup_s,
            architecture=cfg.architecture,
            tp_rank=f"{self.tp.rank}/{self.tp.size}",
            dtype=str(self.dtype),
            device=str(self.device),
            pages=self.num_pages,
            kv_tokens=self.num_pages * config.page_size,
            host_tier_pages=self.tiers.num_pages if self.tiers else None,
            disk_tier=str(self.tiers.disk) if self.tiers and self.tiers.disk else None,
            tier_copies=self.tiers.copies if self.tiers else None,
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            cuda_graphs=graphs.sizes if graphs else None,
            **self.chosen_kernels,
            decode_attention=graphs.attention_kernels if graphs else None,
            deterministic=config.deterministic,
            decode_graph_us={bs: round(ms * 1e3, 1) for bs, ms in graphs.replay_ms.items()} if graphs else None,
            prefill_graphs=[f"{t}x{s}" for t, s in self.prefill_graphs.shapes] if self.prefill_graphs else None,
            padded_to={n: bs for n, bs in graphs.replay_size.items() if bs != n} if graphs else None,
        )

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One prefill on the scratch page and every kind of draw before serving. Kernels that build
        on first use (flashinfer's JIT, Triton's sampler variants) do it now, inside start-up's
        timeout, not under a request's watchdog."""
        n = min(8, self.config.page_size)
        positions = np.arange(n, dtype=np.int64)
        meta = AttentionMeta(
            np.array([0, n], np.int32), np.array([0, 1], np.int32), np.array([self.scratch_page], np.int32), np.array([n], np.int32)
        )
        rows = self._kv_rows(np.full(n, self.scratch_page), positions)
        if self.window_of is not None:  # the window pool's scratch page too
            window_page = np.array([self.window_of[self.scratch_page]], np.int32)
            meta.window = AttentionMeta(meta.qo_indptr, meta.kv_indptr, window_page, meta.kv_lens)
        batch = ForwardBatch(torch.zeros(n, dtype=torch.int64, device=self.device), self._to_device(positions), self._to_device(rows), meta)
        self.attention.prepare(meta)
        warm_up_draws(self.model.logits(self.model(batch, self.attention)[-1:]), self.last_tokens)
        self.model.take_expert_load()  # routing counts start with the first request
        if self.device.type == "cuda":  # a kernel's fault surfaces here, and the draws' pinned buffers are done with
            self.grammars.warm_up(self.device)
            torch.cuda.synchronize(self.device)

    def _pool_pages(self) -> int:
        """--num-pages, else on CUDA what is left of mem_fraction of the device after the weights."""
        cfg, config = self.model_config, self.config
        if config.num_pages:
            return config.num_pages
        if self.device.type != "cuda":
            return config.pages_for(DEFAULT_KV_TOKENS * self.dtype.itemsize // self.kv_dtype.itemsize)  # the same bytes
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * config.mem_fraction - (total - free)
        if config.standby_engine:  # what this process holds now (the weights) again, and room for the standby's graphs
            budget -= torch.cuda.memory_allocated(self.device) + STANDBY_HEADROOM_BYTES
        # a page's bytes in every full layer, and in each sliding-window layer the window pool's share of a page
        windowed = cfg.windowed_layers
        layer_bytes = KVPool.bytes_per_page(1, config.page_size, self.kv_heads, cfg.kv_cache_dim, self.kv_dtype)
        page_bytes = int(layer_bytes * (cfg.num_layers - windowed + windowed * config.swa_full_tokens_ratio))
        draft_weights, draft_page = self.draft_cost()  # a draft model's engine takes its share of the same budget
        budget -= draft_weights
        page_bytes += draft_page
        if budget < 16 * page_bytes:
            raise ValueError(f"mem_fraction {config.mem_fraction} leaves no room for the KV cache after the weights")
        return int(budget // page_bytes) - 1

    def draft_cost(self) -> tuple[int, int]:
        """A draft model's or head's weights (dense, in this engine's dtype, with a tenth more for its
        activations and graphs) and its branches' pages, and its KV bytes a page of this pool's; (0, 0) without a
        draft model."""
        if (path := self.config.speculative_draft_model_path) is None:
            return 0, 0
        draft = ModelConfig.load(resolve_model_dir(path))
        attention = draft.hidden_size * draft.head_dim * 2 * (draft.num_heads + draft.num_kv_heads)
        embeddings = draft.vocab_size * draft.hidden_size * (1 if draft.tie_word_embeddings else 2)
        params = draft.num_layers * (attention + 3 * draft.hidden_size * draft.intermediate_size) + embeddings
        page = KVPool.bytes_per_page(draft.num_layers, self.config.page_size, draft.num_kv_heads, draft.head_dim, self.kv_dtype)
        branches = Branches.of(self.config, 0, 0)
        return int(params * self.dtype.itemsize * 1.1) + (branches.total_pages * page if branches else 0), page

    def apply(self, plan: StepPlan) -> None:
        """The plan's freed and new slots and their pages (launch applies each plan first)."""
        for slot in plan.freed:
            self.slots.pop(slot, None)
            self.grammars.close(slot)
            self.lora_errors.pop(slot, None)
        for new in plan.new_slots:
            self.slots[new.slot] = SlotState(new.rid, new.params, new.seed, new.prompt_ids, list(new.output_ids), len(new.output_ids))
            self.lengths[new.slot] = new.cached
            if new.params.guide is not None:
                self.grammars.open(new.slot, new.params)
        if plan.resync and (reopened := [(new.slot, new.output_ids[-1]) for new in plan.new_slots if new.output_ids]):
            slots, tokens = zip(*reopened)  # a slot of a resync may decode at once (Scheduler.reopen): its last token
            self.last_tokens[list(slots)] = self._to_device(np.array(tokens, dtype=np.int64))
        for slot, pages in plan.pages:
            state = self.slots[slot]
            self.page_table[slot, state.num_pages : state.num_pages + len(pages)] = pages
            state.num_pages += len(pages)
        if plan.window_pages:
            assert self.window_of is not None  # a scheduler pairs window pages for a model with windows only
            full, window = np.array(plan.window_pages, dtype=np.int64).T
            self.window_of[full] = window

    def map_peer(self, num_pages: int, memory: Callable[[int], torch.Tensor]) -> None:
        """A decode engine's view of the prefill engine's pool (`num_pages` and the scratch page, laid out as this
        engine's pool is) in `memory`, bytes -> a uint8 tensor: the pool StepPlan.imports copy from."""
        pool = self.pool
        layer_bytes = KVPool.bytes_per_page(1, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype)
        kept = memory(len(pool.kv) * (num_pages + 1) * layer_bytes)
        layout = (pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype, kept.device, pool.compute_dtype, pool.scales)
        self.peer = KVPool(len(pool.kv), num_pages + 1, *layout, kept)

    def _import(self, imports: list[tuple[list[int], list[int]]]) -> None:
        """Requests handed over from the prefill engine: their KV, copied from its pool into this one's, request by
        request, queued before the forward that reads it."""
        assert self.peer is not None  # the scheduler plans copies for a disaggregated decode engine only
        pool, copier = self.pool, RunCopier(TorchCopier())
        page_bytes = KVPool.bytes_per_page(len(pool.kv), pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype)
        cuda = self.device.type == "cuda"
        for source, target in imports:
            copy = copier.prepare(self.peer, source, pool, target)
            start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if isinstance(start, torch.cuda.Event):
                start.record()
            for layer in range(len(pool.kv)):
                copy(layer)
            end = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if isinstance(end, torch.cuda.Event):
                end.record()
            self._imports.append((len(target) * page_bytes, start, end))
            self.imported_bytes += len(target) * page_bytes

    def take_imports(self) -> list[tuple[int, float]]:
        """(bytes, seconds) of each request's copy done since the last call."""
        done = []
        while self._imports and (not isinstance(end := self._imports[0][2], torch.cuda.Event) or end.query()):
            size, start, end = self._imports.popleft()
            done.append((size, start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start))
        return done

    @torch.inference_mode()
    def launch(self, plan: StepPlan, drafted: DeviceDraft | None = None) -> PendingStep:
        """Queues the plan's forward and draw on the device and returns without waiting for either. `drafted`: the
        DRAFT_HERE places' tokens, for an engine without a drafter of its own (a draft model's)."""
        while any(step.drafts and not step.read for step in self._unread):  # a tensor-parallel follower reads late:
            self._unread.popleft().result()  # a draft's kept length must move its slot back before a later plan runs
        self.apply(plan)
        if plan.imports:
            self._import(plan.imports)
        if self.drafter is not None:
            self.drafter.mirror(plan)
            plan, drafted = self.drafter.draft(plan, self.slots)
        waits = None
        if plan.moves:
            assert self.tiers is not None  # the scheduler moves pages between tiers only where there are some
            waits = self.tiers.run(plan.moves)
        step = self._host_step(plan, drafted)
        if self.fault_injection:
            self._crash_if_asked(step)
        try:
            logits, sample_slots_on_device = self._forward(plan, step, waits)
        except StepAbandoned:  # its rows' KV is not all in the pool: the slots end where they were
            self.lengths[step.seq_slots] -= np.diff(step.qo_indptr)
            raise
        # penalties count every earlier token, and a grammar's mask follows from them: both wait for the draws in
        # flight, which the device has done before this forward, queued already, that the masks' work overlaps
        constrained = self.grammars.constrains(step.sample_slots)
        self.host_waits = {}
        if constrained or any(row.params.penalized for row in step.rows):
            started = time.perf_counter()
            self._read_all()
            self.host_waits["read_ms"] = round((time.perf_counter() - started) * 1e3, 3)
        if logits is None:  # nothing samples
            return PendingStep([], [], [], None, torch.empty(0, dtype=torch.int64), None)
        pending = self._sample(step, logits, sample_slots_on_device, constrained)
        if self.drafter is not None and step.drafts:
            self.drafter.follow(step, pending)
        return pending

    @staticmethod
    def _crash_if_asked(step: HostStep) -> None:
        """A test's query of death: a request that draws at or past its crash_at raises, and the engine dies of it."""
        for state in step.states:
            if state.params.crash_at is not None and state.sampled >= state.params.crash_at:
                raise RuntimeError(f"fault injection: request {state.rid} draws at {state.sampled} (crash_at {state.params.crash_at})")

    def _host_step(self, plan: StepPlan, drafted: DeviceDraft | None = None) -> HostStep:
        """The step's rows, positions, KV rows and attention plan on the host, chunks first; the
        slots' lengths move on past it. `drafted`: the draft tokens its DRAFT_HERE places take, on the device."""
        chunk_slots = [c.slot for c in plan.chunks]
        seq_slots = np.array(chunk_slots + plan.decodes, dtype=np.int64)
        q_lens = np.array([len(c.token_ids) for c in plan.chunks] + [1] * len(plan.decodes), dtype=np.int64)
        starts = self.lengths[seq_slots]
        kv_lens = starts + q_lens
        self.lengths[seq_slots] = kv_lens
        qo_indptr = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qo_indptr[1:])
        tokens = int(qo_indptr[-1])
        positions = np.repeat(starts - qo_indptr[:-1], q_lens) + np.arange(tokens)
        rope_rows = positions
        if (switch := self.model_config.long_rope_from) is not None:  # a long prompt's rows: the long factors' half
            long = np.array([len(self.slots[slot].prompt_ids) > switch for slot in seq_slots])
            rope_rows = positions + self.model_config.max_position * np.repeat(long, q_lens)
        ps = self.config.page_size
        row_slots = np.repeat(seq_slots, q_lens)
        kv_dest = self._kv_rows(self.page_table[row_slots, positions // ps], positions % ps)
        row_seqs = self._rows_as_sequences(plan, tokens)
        if row_seqs:  # row i attends to its sequence's positions up to its own
            meta = self._meta(row_slots, positions + 1, np.arange(tokens + 1))
        else:
            meta = self._meta(seq_slots, kv_lens, qo_indptr)

        sample_rows, sample_slots, states, rows, drafts = [], [], [], [], []
        for i, chunk in enumerate(plan.chunks):
            if not chunk.sample:
                continue
            draws = len(chunk.token_ids) if chunk.every_row else chunk.drafts + 1
            state = self.slots[chunk.slot]
            first, position = int(qo_indptr[i + 1]) - draws, len(state.prompt_ids) + state.sampled
            if chunk.drafts:  # a draw after the last known token and after each draft token, as decodes would draw them
                draft = chunk.token_ids[-chunk.drafts :]
                source = draft
                if drafted is not None:  # a device draft's: no penalty, no grammar
                    assert drafted.read is not None  # a target's draft model reads back what its verify checks
                    source = functools.partial(drafted.read, chunk.slot)
                drafts.append(DraftRows(len(rows), chunk.slot, chunk.drafts, state, source))
                for j in range(draws):
                    outputs = state.output_ids if drafted else state.output_ids + draft[:j]
                    rows.append(SampleRow(state.params, state.seed, position + j, state.prompt_ids, outputs))
            elif chunk.every_row:
                rows += [SampleRow(state.params, state.seed, position + j, state.prompt_ids, state.output_ids) for j in range(draws)]
            else:
                rows.append(state.row())
            sample_rows += range(first, first + draws)
            sample_slots += [chunk.slot] * draws
            states += [state] * draws
        for slot in plan.decodes:
            states.append(state := self.slots[slot])
            rows.append(state.row())
        sample_rows += (qo_indptr[len(chunk_slots) + 1 :] - 1).tolist()
        sample_slots += plan.decodes
        decodes = np.array(plan.decodes, dtype=np.int64)
        return HostStep(
            tokens,
            seq_slots,
            qo_indptr,
            positions,
            rope_rows,
            kv_dest,
            meta,
            decodes,
            np.array(sample_rows, dtype=np.int64),
            np.array(sample_slots, dtype=np.int64),
            states,
            rows,
            drafts,
            row_seqs,
            drafted,
        )

    def _rows_as_sequences(self, plan: StepPlan, tokens: int) -> bool:
        """Can a decode graph run the step, its chunks' rows attending as sequences of one row? Where the chunks
        are short (a verify, a draft's catch-up), where no row's hidden state is wanted past the logits."""
        if self.graphs is None or not self.graphs.fits(tokens):
            return False
        if plan.chunks and self.drafter is not None and self.drafter.reads_hidden:
            return False
        return all(len(c.token_ids) <= ROW_SEQUENCE_CHUNK and self.slots[c.slot].params.prompt_logprobs is None for c in plan.chunks)

    def _meta(self, seq_slots: np.ndarray, kv_lens: np.ndarray, qo_indptr: np.ndarray) -> AttentionMeta:
        """The attention plan of sequences on these slots' pages, attending to their first kv_lens positions; with
        windows, the sliding-window layers' too, over the window pool from the first page any of its rows sees."""
        ps = self.config.page_size
        seq_pages = -(-kv_lens // ps)
        meta = paged_meta(self.page_table[seq_slots, : int(seq_pages.max())], kv_lens, qo_indptr, ps)
        if self.window_of is not None:
            first = np.maximum(0, kv_lens - np.diff(qo_indptr) - self.model_config.window + 1) // ps
            width = int((seq_pages - first).max())
            at = np.minimum(first[:, None] + np.arange(width)[None, :], self.max_pages_per_seq - 1)
            table = self.window_of[self.page_table[seq_slots[:, None], at]]
            meta.window = paged_meta(table, kv_lens - first * ps, qo_indptr, ps)
            assert (meta.window.kv_indices >= 0).all(), "a window page the scheduler let go is read"
        return meta

    def _forward(self, plan: StepPlan, step: HostStep, waits: LayerWaits | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Queues the forward: a decode graph (steps of decodes and short chunks it fits), a prefill graph, or
        eager; a graph after the tiers' copies, an eager forward layer by layer as they land (`waits`). Returns
        the logits of the sampling rows (None where none samples) and, from a decode-only step's graph, their
        slots on the device."""
        tokens, decodes, sampled = step.tokens, step.decodes, len(step.sample_rows)
        if step.row_seqs and self.graphs is not None:
            if waits is not None:
                waits.all()
            if not plan.chunks:  # every row samples
                return self.graphs.replay(step.meta, step.rope_rows, step.kv_rows, decodes)
            n_chunk = tokens - len(decodes)
            own, drafted = self._chunk_ids(plan, step, n_chunk)
            sources = np.concatenate([len(self.last_tokens) + np.arange(n_chunk), decodes])
            own = np.concatenate([own, np.zeros(len(decodes), dtype=np.int64)])  # a decode row's token is its slot's
            logits, _ = self.graphs.replay(step.meta, step.rope_rows, step.kv_rows, sources, own, drafted)
            return (logits if sampled == tokens else logits[self._to_device(step.sample_rows)]), None
        # KV rows first, [T, 2] at the buffer's start: the Triton rope and KV write then sees the same
        # alignment and strides at every step, so no step compiles a new variant of it
        host = self._to_device(np.concatenate([step.kv_rows.ravel(), step.rope_rows, decodes, step.sample_rows]))
        k = step.kv_rows.shape[1]  # 2, or 4 with the window pool's rows
        input_ids = torch.empty(tokens, dtype=torch.int64, device=self.device)
        n_chunk = tokens - len(decodes)
        if n_chunk:
            own, drafted = self._chunk_ids(plan, step, n_chunk)
            input_ids[:n_chunk] = self._to_device(own)
            if drafted is not None:
                input_ids[drafted[0]] = drafted[1]
        if len(decodes):
            input_ids[n_chunk:] = self.last_tokens[host[(k + 1) * tokens : (k + 1) * tokens + len(decodes)]]
        batch = ForwardBatch(
            input_ids, host[k * tokens : (k + 1) * tokens], host[: k * tokens].view(tokens, k), step.meta, self.between_layers
        )
        shape = self.prefill_graphs.fit(tokens, len(step.seq_slots)) if self.prefill_graphs else None
        if shape:
            if waits is not None:
                waits.all()
            hidden = self.prefill_graphs.replay(shape, batch)  # pyright: ignore[reportOptionalMemberAccess]  # shape: only with graphs
        else:
            batch.before_layer = waits.layer if waits is not None else None
            self.attention.prepare(step.meta)
            if self.adapters is not None:
                names = [self.slots[slot].params.lora for slot in step.seq_slots]
                if missing := self.adapters.set_rows(names, np.diff(step.qo_indptr)):
                    for slot, name in zip(step.seq_slots.tolist(), names):
                        if name in missing:  # its draw is void, and its request fails with why
                            self.lora_errors[slot] = f"the LoRA adapter '{name}' was unloaded while the request ran"
            hidden = self.model(batch, self.attention)
        self._prompt_logprobs(plan, step, hidden)
        if self.drafter is not None:
            self.drafter.take_features(plan, step, hidden)
        return (self.model.logits(hidden[host[(k + 1) * tokens + len(decodes) :]]) if sampled else None), None

    def _chunk_ids(self, plan: StepPlan, step: HostStep, n_chunk: int) -> tuple[np.ndarray, tuple[torch.Tensor, torch.Tensor] | None]:
        """The chunks' token ids, and for a draft left on the device (rows among them, its tokens) to put there."""
        own = np.fromiter((t for c in plan.chunks for t in c.token_ids), np.int64, n_chunk)
        if step.drafted is None:
            return own, None
        return own, (self._to_device(np.flatnonzero(own == DRAFT_HERE)), step.drafted.tokens)

    def _prompt_logprobs(self, plan: StepPlan, step: HostStep, hidden: torch.Tensor) -> None:
        """For chunks of slots that asked: the log-probability of each prompt token the chunk's rows
        predict, kept on the slot until its first draw."""
        for i, chunk in enumerate(plan.chunks):
            state = self.slots[chunk.slot]
            if state.params.prompt_logprobs is None:
                continue
            first = int(step.qo_indptr[i])
            start = int(step.positions[first])
            count = min(len(chunk.token_ids), len(state.prompt_ids) - 1 - start)  # the prompt's last row predicts the output
            if count > 0:
                targets = self._to_device(np.array(state.prompt_ids[start + 1 : start + 1 + count], dtype=np.int64))
                rows, top = hidden[first : first + count], state.params.prompt_logprobs
                state.prompt_logprobs.append(PromptLogprobs.of(self.model.logits, rows, targets, top, self.block_rows))

    def _sample(self, step: HostStep, logits: torch.Tensor, sample_slots_on_device: torch.Tensor | None, constrained: bool) -> PendingStep:
        """Queues the draw of the sampling rows (masked by their grammars where `constrained`); each
        draw also becomes its slot's next input token."""
        if sample_slots_on_device is None:
            sample_slots_on_device = self._to_device(step.sample_slots)
        host = torch.empty(len(step.rows), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        constrain = None
        if constrained:
            slots, outputs = step.sample_slots.tolist(), [row.output_ids for row in step.rows]  # a draft row's: with the draft before it
            constrain = functools.partial(self._masked, slots=slots, outputs=outputs)
        drawn = sample(logits, step.rows, Feedback(self.last_tokens, sample_slots_on_device, host), constrain, self.block_rows)
        drafting = {id(draft.state) for draft in step.drafts}
        for state in step.states:
            if id(state) not in drafting:  # a draft's slot counts its draws once they are read (PendingStep.result)
                state.sampled += 1
        pending = self._pending(step.states, step.sample_slots.tolist(), step.rows, drawn, host)
        if step.drafts:
            pending.drafts, pending.on_draft = step.drafts, self._kept
        if constrained:
            pending.errors = self.grammars.take_errors()
        if self.lora_errors:
            pending.errors |= {slot: self.lora_errors.pop(slot) for slot in set(step.sample_slots.tolist()) & self.lora_errors.keys()}
        return pending

    def _kept(self, draft: DraftRows, kept: int) -> None:
        """A draft's first `kept` tokens held: its slot counts their draws and the one after, and its length (past
        every draft token's KV) steps back over the rest, whose KV the next chunk overwrites."""
        draft.state.sampled += kept + 1
        if self.slots.get(draft.slot) is draft.state:  # not a slot freed and opened again meanwhile
            self.lengths[draft.slot] -= draft.count - kept
            if self.drafter is not None:
                self.drafter.kept(draft.slot, int(self.lengths[draft.slot]))
        self.speculation.steps += 1
        self.speculation.drafted += draft.count
        self.speculation.kept += kept
        self.speculation.gave.append(kept + 1)

    def _masked(self, logits: torch.Tensor, slots: list[int], outputs: list[list[int]]) -> None:
        started = time.perf_counter()
        self.grammars.apply(logits, slots, outputs)
        self.host_waits["mask_ms"] = round((time.perf_counter() - started) * 1e3, 3)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def _pending(self, states: list[SlotState], slots: list[int], rows: list[SampleRow], drawn: Sample, host: torch.Tensor) -> PendingStep:
        """`host` holds the draws (in pinned memory on CUDA, written by the step); the step's event
        covers them: reading them must not wait on later steps."""
        prompts = {}
        for i, state in enumerate(states):
            if state.prompt_logprobs:
                prompts[i], state.prompt_logprobs = PromptLogprobs.joined(state.prompt_logprobs), []
        if self.device.type == "cuda":
            if drawn.logprob_rows:
                drawn.top_ids, drawn.top_values, drawn.chosen = (
                    # set whenever logprob_rows is
                    t.to("cpu", non_blocking=True)  # pyright: ignore[reportOptionalMemberAccess]
                    for t in (drawn.top_ids, drawn.top_values, drawn.chosen)
                )
            done = torch.cuda.Event()
            done.record()
            step = PendingStep(states, slots, rows, drawn, host, done, prompts)
        else:
            step = PendingStep(states, slots, rows, drawn, host, None, prompts)
        while self._unread and self._unread[0].read:
            self._unread.popleft()
        self._unread.append(step)
        return step

    def _read_all(self) -> None:
        while self._unread:
            self._unread.popleft().result()

    def forget(self, step: PendingStep) -> None:
        """A queued step whose draws nobody will read (a draft model's catch-up or branch no draft took): no longer
        waited on, and held only until the device has written them."""
        self._forgotten = [held for held in self._forgotten if not held.ready()]
        if step in self._unread:
            self._unread.remove(step)
            self._forgotten.append(step)

    def reset(self) -> list[HeldKV]:
        """Forget every slot (a new epoch): the next plans open them afresh. Returns what the pool holds
        of each slot's request (its rid, the tokens whose KV is written, their pages, its salt), for a new
        scheduler to adopt."""
        self._read_all()
        self.lora_errors.clear()
        if self.drafter is not None:
            self.drafter.reset()
        if self.tiers is not None:  # the host tier's index is complete for the scheduler that adopts it
            self.tiers.finish_stores(wait=True)
        ps = self.config.page_size
        held = [
            (
                state.rid,
                (state.prompt_ids + state.output_ids)[:length],
                self.page_table[slot, : -(-length // ps)].tolist(),
                state.params.cache_salt,
            )
            for slot, state in self.slots.items()
            if (length := int(self.lengths[slot]))
        ]
        self.slots.clear()
        self.grammars.clear()
        return held


class DraftModel:
    """STANDALONE drafts: a smaller model of the target's vocabulary, in an Engine of its own that mirrors the
    target's slots and page tables (its own pool under the same page ids). A cached prefix's pages may hold no
    draft KV, so a slot's draft KV is computed from its first token at its first draft, and caught up to the
    target's tokens before each draft after. Its draws take the request's own sampling and seed: a draft model
    that is the target draws what the target will.

    The catch-up after a verify is queued right behind it, before the host reads it (`follow`): over every verify
    row, each fed the target's draw there, so that the row after the last kept token is among them whatever the
    verify keeps. Behind the catch-up, a branch per row decodes the rest of the next draft from that row's draw.
    Reading the verify and planning the next step then overlap the GPU's work, and the next draft is one branch's
    draws, picked on the device."""

    reads_hidden = False  # from the target's steps (take_features)

    def __init__(self, engine: Engine, branches: Branches | None = None) -> None:
        """`branches`: where `follow` drafts ahead of the read (the engine's slots and pages past the mirrored
        ones); None: the draft decodes after it."""
        self.engine, self.branches = engine, branches
        self.followed: dict[int, Followed] = {}  # slot -> its catch-up queued behind its last verify
        self.queued: list[PendingStep] = []  # those catch-ups' steps, until a draft takes them or none waits on them

    def mirror(self, plan: StepPlan) -> None:
        """The plan's freed and new slots and their pages, as the target applied them (no grammar: the draft
        model draws freely, and the target's verify rows carry the grammar's masks; no log-probabilities)."""
        new = [replace(n, cached=0, params=replace(n.params, guide=None, logprobs=None, prompt_logprobs=None)) for n in plan.new_slots]
        self.engine.apply(StepPlan(freed=plan.freed, new_slots=new, pages=plan.pages))
        asked = {c.slot for _, c in self._asks(plan)}
        for slot in [*plan.freed, *(n.slot for n in plan.new_slots), *(c.slot for c in plan.chunks), *plan.decodes]:
            if slot not in asked:
                self.followed.pop(slot, None)  # a queued catch-up holds only until the slot's next step, which draws

    def follow(self, step: HostStep, verify: PendingStep) -> None:
        """Queues the catch-up over each verify chunk's rows behind it (the class's note): row j at the chunk's
        position + 1 + j, fed the target's draw after verify row j; then the branches that draft on from its rows.
        Rows past the slot's pages are left out (a verify that keeps more catches up as before), and so are slots
        whose drafts the host reads (grammars, penalties: their draft rows need the request's outputs)."""
        assert verify.sample is not None  # a verify draws
        page_size = self.engine.config.page_size
        chunks, index, starts = [], [], []
        for draft in step.drafts:
            mine, params = self.engine.slots.get(draft.slot), draft.state.params
            if mine is None or params.guide is not None or params.penalized:
                continue
            start = int(step.positions[step.sample_rows[draft.first]]) + 1
            rows = min(draft.count + 1, mine.num_pages * page_size - start)
            if rows <= 0:
                continue
            self.engine.lengths[draft.slot] = start  # its KV from there on is rewritten
            mine.sampled = start + 1 - len(mine.prompt_ids)  # row 0 draws the token after `start`
            chunks.append(Chunk(draft.slot, [DRAFT_HERE] * rows, True, every_row=True))
            index += range(draft.first, draft.first + rows)
            starts.append(start)
        if not chunks:
            return
        tokens = verify.sample.tokens[self.engine._to_device(np.array(index, dtype=np.int64))]
        queued = self.engine.launch(StepPlan(chunks=chunks), DeviceDraft(tokens))
        ahead, first_branch = self._branch(chunks, starts, queued) if self.branches else ((), {})
        self.queued += [queued, *ahead]
        row = 0
        for chunk, start in zip(chunks, starts):
            branched = chunk.slot in first_branch
            rows = len(chunk.token_ids)
            self.followed[chunk.slot] = Followed(start, rows, queued, row, ahead if branched else (), first_branch.get(chunk.slot, 0))
            row += rows

    def _branch(self, chunks: list[Chunk], starts: list[int], catch_up: PendingStep) -> tuple[tuple[PendingStep, ...], dict[int, int]]:
        """Queues a branch per catch-up row (`follow`'s chunks from `starts`): a slot of its own (Branches), on the
        slot's pages up to the row and on pages of its own after it (the row's page copied there), fed the row's
        draw and decoded once per draft token after the first. Returns the decode steps and, per branched slot,
        the row of its first branch in them."""
        branches, engine = self.branches, self.engine
        assert branches is not None and catch_up.sample is not None  # follow branches where there are branches; a catch-up draws
        page_size, table = engine.config.page_size, engine.page_table
        slots, sources, first_branch, copies = [], [], {}, ([], [])
        row = 0
        for chunk, start in zip(chunks, starts):
            rows = len(chunk.token_ids)
            end = start + rows + branches.decodes  # past the last branch's last position
            fits = end <= engine.model_config.max_position and (start + rows) // page_size + branches.pages <= engine.max_pages_per_seq
            if len(first_branch) < branches.slots and fits:
                first_branch[chunk.slot] = len(slots)
                state = engine.slots[chunk.slot]
                for j in range(rows):
                    slot, pages = branches.slot_and_pages(len(first_branch) - 1, j)
                    first = start + j + 1  # the branch's first position of its own
                    held = first // page_size
                    table[slot, :held] = table[chunk.slot, :held]
                    table[slot, held : held + len(pages)] = pages
                    if first % page_size:
                        copies[0].append(int(table[chunk.slot, held]))
                        copies[1].append(pages[0])
                    engine.lengths[slot] = first
                    sampled = first + 1 - len(state.prompt_ids)  # its first decode draws the token after `first`
                    engine.slots[slot] = SlotState(state.rid, state.params, state.seed, state.prompt_ids, [], sampled)
                    slots.append(slot)
                    sources.append(row + j)
            row += rows
        if not slots:
            return (), {}
        if copies[0]:
            copy = TorchCopier().prepare(engine.pool, copies[0], engine.pool, copies[1])
            for layer in range(len(engine.pool.kv)):
                copy(layer)
        drawn = catch_up.sample.tokens[engine._to_device(np.array(sources, dtype=np.int64))]
        engine.last_tokens[engine._to_device(np.array(slots, dtype=np.int64))] = drawn
        return tuple(engine.launch(StepPlan(decodes=slots)) for _ in range(branches.decodes)), first_branch

    def draft(self, plan: StepPlan, targets: dict[int, SlotState]) -> tuple[StepPlan, DeviceDraft | None]:
        """Draws the plan's DRAFT_HERE tokens: a step over each drafted slot's tokens the draft model lacks (a
        long catch-up, as a prompt's first, in prefill-sized steps before it), then a decode step for each
        draft token after the first; a slot whose catch-up and branches were queued behind its verify takes
        their draws. The draws stay on the device for the verify step, which is queued behind them
        (DeviceDraft), unless a drafted slot's grammar or penalties need them on the host first: then they are
        read and written into the plan."""
        asks = self._asks(plan)
        followed = {c.slot: q for _, c in asks if (q := self.followed.pop(c.slot, None)) is not None}
        steps: list[PendingStep] = []  # the draft steps whose draws the verify takes
        try:
            return self._draft(plan, targets, asks, followed, steps)
        finally:
            self._let_go(steps)

    def _draft(
        self,
        plan: StepPlan,
        targets: dict[int, SlotState],
        asks: list[tuple[int, Chunk]],
        followed: dict[int, Followed],
        steps: list[PendingStep],
    ) -> tuple[StepPlan, DeviceDraft | None]:
        if not asks:
            return plan, None
        budget = self.engine.config.max_prefill_tokens
        assert budget is not None  # EngineConfig fills in the device's default
        ends: list[tuple[Chunk, torch.Tensor | None]] = []
        where: dict[int, list[tuple[PendingStep, int]]] = {c.slot: [] for _, c in asks}  # slot -> its draft tokens' (step, row)
        for _, chunk in asks:
            target, mine = targets[chunk.slot], self.engine.slots[chunk.slot]
            mine.output_ids, mine.sampled = list(target.output_ids), len(target.output_ids)
            known = len(target.prompt_ids) + len(target.output_ids)  # the last known token is at known - 1
            if (queued := followed.get(chunk.slot)) is not None and 0 <= (kept := known - 1 - queued.start) < queued.rows:
                ahead = [(step, queued.ahead_row + kept) for step in queued.ahead[: chunk.drafts - 1]]
                where[chunk.slot] = [(queued.step, queued.row + kept), *ahead]
                self.engine.lengths[chunk.slot] = known  # that row wrote the last known token's KV
                mine.sampled += 1  # and drew the first draft token
                continue
            tokens, features = self._catch_up(chunk.slot, target)
            last = (len(tokens) - 1) // budget * budget  # where the piece that draws begins
            for start in range(0, last, budget):
                piece = None if features is None else features[start : start + budget]
                self._launch(StepPlan(chunks=[Chunk(chunk.slot, tokens[start : start + budget], False)]), [piece])
            ends.append((Chunk(chunk.slot, tokens[last:], True), None if features is None else features[last:]))
        launched: list[PendingStep] = []
        group: list[tuple[Chunk, torch.Tensor | None]] = []
        for end in ends:  # the last pieces, in steps of a budget's rows at most
            if group and sum(len(c.token_ids) for c, _ in group) + len(end[0].token_ids) > budget:
                launched.append(self._launch(StepPlan(chunks=[c for c, _ in group]), [f for _, f in group]))
                group = []
            group.append(end)
        if group:
            launched.append(self._launch(StepPlan(chunks=[c for c, _ in group]), [f for _, f in group]))
        for step in launched:
            for r, slot in enumerate(step.slots):
                where[slot].append((step, r))
        decoding = [c for _, c in asks if len(where[c.slot]) < c.drafts]
        for c in decoding:
            (step, r), *_ = where[c.slot]
            if c.slot in followed and step is followed[c.slot].step:  # a followed catch-up drew every row: the slot's
                sample = step.sample  # next decode feeds this one
                assert sample is not None  # a catch-up draws
                self.engine.last_tokens[c.slot : c.slot + 1] = sample.tokens[r : r + 1]
        for j in range(1, max((c.drafts for c in decoding), default=0)):
            step = self._launch(StepPlan(decodes=[c.slot for c in decoding if c.drafts > j]))
            for r, slot in enumerate(step.slots):
                where[slot].append((step, r))
        self._drafted([c.slot for _, c in asks])
        for step, _ in (place for places in where.values() for place in places):
            if step not in steps:
                steps.append(step)
        read = lambda slot: [step.result()[r].token for step, r in where[slot]]  # noqa: E731
        if any(targets[c.slot].params.guide is not None or targets[c.slot].params.penalized for _, c in asks):
            chunks = list(plan.chunks)  # a grammar's masks and penalties read the draft on the host: it waits for the draws
            for i, chunk in asks:
                chunks[i] = replace(chunk, token_ids=chunk.token_ids[: -chunk.drafts] + read(chunk.slot))
            return replace(plan, chunks=chunks), None
        offsets = dict(zip(map(id, steps), np.cumsum([0] + [len(step.rows) for step in steps]).tolist()))
        index = np.array([offsets[id(step)] + r for _, c in asks for step, r in where[c.slot]], dtype=np.int64)
        draws = torch.cat([step.sample.tokens for step in steps if step.sample is not None])  # each of these steps samples
        return plan, DeviceDraft(draws[self.engine._to_device(index)], read)

    @staticmethod
    def _asks(plan: StepPlan) -> list[tuple[int, Chunk]]:
        """The plan's chunks (with their places) whose draft tokens the draft model fills in."""
        return [(i, c) for i, c in enumerate(plan.chunks) if c.drafts and c.token_ids[-1] == DRAFT_HERE]

    def _let_go(self, taken: list[PendingStep]) -> None:
        """Followed catch-ups and branches that the draft did not take and no slot waits on: their draws are never
        read."""
        waiting = [step for q in self.followed.values() for step in (q.step, *q.ahead)]
        for step in self.queued:
            if step not in waiting and step not in taken:
                self.engine.forget(step)
        self.queued = [step for step in self.queued if step in waiting]

    def _catch_up(self, slot: int, target: SlotState) -> tuple[list[int], torch.Tensor | None]:
        """The tokens that bring the slot's draft KV up to the target's, the last drawing the first draft token
        (and a head's features for them)."""
        known = target.prompt_ids + target.output_ids
        begin = min(int(self.engine.lengths[slot]), len(known) - 1)  # the last known token at least: it draws
        self.engine.lengths[slot] = begin
        return known[begin:], None

    def _launch(self, plan: StepPlan, features: list[torch.Tensor | None] | None = None) -> PendingStep:
        """Queues a draft step; `features`: a head's, one tensor per chunk."""
        return self.engine.launch(plan)

    def _drafted(self, slots: list[int]) -> None:
        """Every draft step of these slots is queued."""

    def take_features(self, plan: StepPlan, step: HostStep, hidden: torch.Tensor) -> None:
        """The target's step ran its forward over `plan` (hidden: its last hidden states, a row per token)."""

    def kept(self, slot: int, length: int) -> None:
        """The target kept KV for `length` tokens of the slot: the draft KV past it is void."""
        self.engine.lengths[slot] = min(int(self.engine.lengths[slot]), length)

    def reset(self) -> None:
        self.engine.reset()
        self.followed.clear()
        self.queued.clear()


class EagleDraft(DraftModel):
    """EAGLE and EAGLE-3 drafts. The head's row at position p reads the token at p + 1 and the target's feature
    at p, and hands its own hidden state on as the feature of the row after it; so a draft first catches the
    head up over the target's features it has not read (a prefill's rows, then a verify step's kept rows),
    whose last row draws the first draft token, then decodes on its own features. The features wait on the
    device, per slot, from the target's forward to the slot's next draft. A position whose feature never
    came (a prefix from the radix cache; steps decoded while drafting was off) is skipped where the head's
    KV begins, else read with a zero feature: it costs acceptance, never output. The head runs eager: its
    features are set before each forward."""

    reads_hidden = True

    def __init__(self, engine: Engine, target: Engine) -> None:
        super().__init__(engine)
        head, model = engine.model, target.model
        assert isinstance(head, EagleHead | Eagle3Head)  # Engine builds one for EAGLE and EAGLE3
        self.head, self.target_lengths = head, target.lengths
        head.model.embed_tokens = model.model.embed_tokens
        width = model.config.hidden_size
        if isinstance(head, EagleHead):
            head.lm_head = model.lm_head
        else:
            model.capture = aux_layers(head.config, model.config.num_layers)
            if not all(0 <= layer <= model.config.num_layers for layer in model.capture):
                raise ValueError(f"the EAGLE-3 head reads layers {model.capture} of a {model.config.num_layers}-layer target")
            target.prefill_graphs = None  # a graph's replay would not set the layers' hidden states it keeps
            width *= len(model.capture)
        self.target_model = model
        self.width, self.dtype, self.device = width, target.dtype, target.device
        self.pending: dict[int, tuple[int, list[torch.Tensor]]] = {}  # slot -> (the first row's position, features [rows, width])
        self._last: dict[int, torch.Tensor] = {}  # slot -> the head's hidden state of its last row, the next row's feature
        self._ends: dict[int, int] = {}  # slot -> how far its head KV holds after the draft: the rest is redone next time

    def mirror(self, plan: StepPlan) -> None:
        super().mirror(plan)
        for slot in [*plan.freed, *(n.slot for n in plan.new_slots)]:
            self.pending.pop(slot, None)

    def follow(self, step: HostStep, verify: PendingStep) -> None:
        """Nothing is queued behind a verify: a head's catch-up reads the features of the rows the verify kept."""

    def take_features(self, plan: StepPlan, step: HostStep, hidden: torch.Tensor) -> None:
        features = self.target_model.captured if self.target_model.capture else hidden  # EAGLE-3's layers, or the last
        for i, chunk in enumerate(plan.chunks):
            first, last = int(step.qo_indptr[i]), int(step.qo_indptr[i + 1])
            position, rows = int(step.positions[first]), features[first:last].clone()  # a graph's output is overwritten
            start, held = self.pending.get(chunk.slot, (position, []))
            if start + sum(len(r) for r in held) == position:
                held.append(rows)
            else:
                start, held = position, [rows]
            self.pending[chunk.slot] = (start, held)

    def _catch_up(self, slot: int, target: SlotState) -> tuple[list[int], torch.Tensor | None]:
        known = target.prompt_ids + target.output_ids
        end = len(known) - 1  # the row at end - 1 reads the last known token and draws the first draft
        start, held = self.pending.pop(slot, (end, []))
        rows = torch.cat(held) if held else torch.empty(0, self.width, dtype=self.dtype, device=self.device)
        begin = min(max(int(self.engine.lengths[slot]), start), end - 1)
        self.engine.lengths[slot] = begin
        features = torch.zeros(end - begin, self.width, dtype=self.dtype, device=self.device)
        low, high = max(begin, start), min(end, start + len(rows))
        if high > low:
            features[low - begin : high - begin] = rows[low - start : high - start]
        # the target's step about to run gives the features from where its chunk starts (a resumed prefill's last
        # chunk carries a draft): the head's rows from there read zeros now and are redone with them next time
        self._ends[slot] = min(end, max(begin, int(self.target_lengths[slot])))
        return known[begin + 1 : end + 1], features

    def _launch(self, plan: StepPlan, features: list[torch.Tensor | None] | None = None) -> PendingStep:
        if plan.chunks:
            assert features is not None and all(f is not None for f in features)  # _catch_up gives a head's
            self.head.features = torch.cat(features)  # pyright: ignore[reportArgumentType]
        else:
            self.head.features = torch.stack([self._last[slot] for slot in plan.decodes])
        step = self.engine.launch(plan)
        out = self.head.next_features
        if plan.chunks:
            ends = np.cumsum([len(c.token_ids) for c in plan.chunks]) - 1
            self._last.update((c.slot, out[int(row)]) for c, row in zip(plan.chunks, ends))
        else:
            self._last.update((slot, out[i]) for i, slot in enumerate(plan.decodes))
        return step

    def _drafted(self, slots: list[int]) -> None:
        for slot in slots:  # the head's KV past the catch-up came from its own guesses: the next catch-up redoes it
            self.engine.lengths[slot] = self._ends.pop(slot)
        self._last = {}

    def kept(self, slot: int, length: int) -> None:
        super().kept(slot, length)
        if slot in self.pending:  # the verify rows past the kept ones saw draft tokens the target did not keep
            start, held = self.pending[slot]
            rows = torch.cat(held)[: max(0, length - start)]
            self.pending[slot] = (start, [rows])

    def reset(self) -> None:
        super().reset()
        self.pending.clear()
