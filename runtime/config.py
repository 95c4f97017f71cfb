"""Frozen configuration: the model's shape (from config.json) and the engine's knobs."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from runtime.cli_args import CliConfig, flag
from runtime.sampling_params import SamplingParams
from runtime.scheduler.tiers import STORAGE_BACKENDS, WRITE_POLICIES

SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
MODEL_DRAFTS = ("STANDALONE", "EAGLE", "EAGLE3")  # the algorithms that draft with a model (the engine fills the draft in)
# vLLM's speculative_config keys (LLM(speculative_config=...)) -> EngineConfig's fields; the fields' own names without
# their speculative_ prefix are taken too
VLLM_SPECULATIVE_KEYS = {
    "method": "speculative_algorithm",
    "model": "speculative_draft_model_path",
    "num_speculative_tokens": "speculative_num_draft_tokens",
    "prompt_lookup_min": "speculative_ngram_min_match_window_size",
    "prompt_lookup_max": "speculative_ngram_max_match_window_size",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
}
VLLM_METHODS = {"ngram": "NGRAM", "draft_model": "STANDALONE", "eagle": "EAGLE", "eagle3": "EAGLE3"}

log = structlog.get_logger()


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    short_factor: tuple[float, ...] = ()  # LongRoPE's: each frequency's divisor below original_max_position
    long_factor: tuple[float, ...] = ()  # ... and from there on
    attention_factor: float = 1.0  # LongRoPE's and YaRN's: cos and sin scaled by it
    beta_fast: float = 32.0  # YaRN's: the rotations past which a pair is extrapolated, not interpolated
    beta_slow: float = 1.0
    truncate: bool = True  # YaRN's: the ramp's ends rounded to whole dimensions
    softmax_mscale: float = 1.0  # YaRN's with mscale_all_dim: what the softmax's scale is multiplied by (DeepSeek's MLA)

    @classmethod
    def from_dict(cls, rope: dict[str, Any], raw: dict[str, Any]) -> RopeConfig:
        """From config.json's rope_parameters (or rope_scaling) and the rest of it (`raw`)."""
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in ("su", "yarn") and raw["architectures"][0] == "Phi3ForCausalLM":  # Phi-3's older names of LongRoPE
            kind = "longrope"
        # as transformers: the top-level value first (Phi-3's), and for LongRoPE the context itself without either
        fallback = raw.get("max_position_embeddings", 8192) if kind == "longrope" else 8192
        original = int(raw.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or fallback)
        config = cls(
            theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            kind=kind,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position=original,
        )
        if kind == "yarn":  # as transformers: the attention factor from the stretch, or mscale's ratio
            factor = float(rope.get("factor") or raw["max_position_embeddings"] / original)
            mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = rope.get("attention_factor") or (
                _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim else _yarn_mscale(factor)
            )
            return replace(
                config,
                factor=factor,
                attention_factor=float(attention),
                beta_fast=float(rope.get("beta_fast") or 32.0),
                beta_slow=float(rope.get("beta_slow") or 1.0),
                truncate=bool(rope.get("truncate", True)),
                softmax_mscale=_yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0,
            )
        if kind != "longrope":
            return config
        # as transformers: the factor is the context's stretch over pretraining, the attention factor from it
        factor = rope.get("factor") or raw.get("max_position_embeddings", original) / original
        attention = rope.get("attention_factor") or (1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original)))
        short, long = tuple(map(float, rope["short_factor"])), tuple(map(float, rope["long_factor"]))
        return replace(config, factor=float(factor), short_factor=short, long_factor=long, attention_factor=float(attention))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MoeConfig:
    """Qwen3-MoE's, Mixtral's and GPT-OSS's sparse blocks: top_k of num_experts SiLU-gated MLPs per token, weighted
    by the router's softmax (renormalised over the chosen when norm_topk_prob). GPT-OSS's router and experts have
    biases, and its experts gate with a clamped SwiGLU (swiglu_limit)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    biases: bool = False  # on the router and on each expert's projections
    swiglu_limit: float | None = None  # GPT-OSS: (clamp(up) + 1) · g · sigmoid(alpha · g), g = gate clamped above
    swiglu_alpha: float = 1.702
    # DeepSeek-V3: sigmoid scores, experts chosen from the topk_group best of n_group groups by the scores plus a
    # correction bias, weighted by the scores themselves times routed_scaling_factor; a shared MLP beside them
    sigmoid_groups: tuple[int, int] | None = None  # (n_group, topk_group)
    routed_scaling_factor: float = 1.0
    shared_intermediate: int = 0

    def is_sparse(self, layer: int) -> bool:
        """Hugging Face's rule: every decoder_sparse_step-th layer, except the MLP-only ones."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention: q through a low rank (q_lora_rank; None: q_proj whole), K and V of every
    head from one latent a token (kv_lora_rank, normed) and one roped key part shared by the heads (qk_rope_head_dim):
    the KV cache holds those, not heads."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's rope dims come in pairs (x0, x1), (x2, x3)...: reordered as they load

    @property
    def latent(self) -> int:
        """A token's cached values: the latent and the roped key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class Fp8Config:
    """A block-quantized FP8 checkpoint (quantization_config quant_method "fp8"; runtime.models.fp8)."""

    weight_block: tuple[int, int] = (128, 128)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Fp8Config:
        method = raw.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization {method!r} is not supported; supported: fp8 (block-quantized)")
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("FP8 checkpoints with static activation scales are not supported; dynamic ones are")
        block = raw.get("weight_block_size")
        if not block or len(block) != 2:
            raise ValueError("FP8 checkpoints quantized per tensor or per channel are not supported; weight_block_size is needed")
        return cls(weight_block=(int(block[0]), int(block[1])))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: biases on q, k and v
    output_bias: bool  # Llama or Mistral with attention_bias: a bias on o_proj too
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k
    rope: RopeConfig
    eos_token_ids: tuple[int, ...]
    local_rope: RopeConfig | None = None  # the sliding-window layers' rope, where it differs (Gemma 3's base 10k, not 1M)
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window (the keys a query sees, itself included), 0: all
    attention_scale: float | None = None  # the softmax's scale where not head_dim ** -0.5 (Gemma's query_pre_attn_scalar)
    attention_softcap: float | None = None  # Gemma 2: each score s becomes cap · tanh(s / cap)
    final_softcap: float | None = None  # ... and each logit
    attention_sinks: bool = False  # GPT-OSS: a learned logit per head joins each softmax (runtime.attention.backend)
    mla: MlaConfig | None = None  # DeepSeek-V3's multi-head latent attention
    moe: MoeConfig | None = None
    fp8: Fp8Config | None = None  # the checkpoint's projections are block-quantized FP8
    mxfp4: bool = False  # the checkpoint's experts are MXFP4 (GPT-OSS's): dequantized as they load (runtime.models.mxfp4)
    draft_vocab_size: int | None = None  # an EAGLE-3 head's: its lm_head's rows
    eagle_aux_layers: tuple[int, ...] | None = None  # an EAGLE-3 head's: the target layers whose outputs it reads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        arch = raw["architectures"][0]
        if arch in MULTIMODAL:  # the text model inside (its config's defaults filled in as transformers fills them)
            raw = {**MULTIMODAL[arch](raw), "architectures": [arch]}
        rope, local_rope = _ropes(raw)
        heads = raw["num_attention_heads"]
        experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
        moe = None
        if arch == "Qwen3MoeForCausalLM" and experts:
            moe = MoeConfig(
                num_experts=experts,
                top_k=raw["num_experts_per_tok"],
                intermediate_size=raw["moe_intermediate_size"],
                norm_topk_prob=raw.get("norm_topk_prob", False),
                decoder_sparse_step=raw.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
            )
        elif arch == "MixtralForCausalLM":  # every layer sparse, its top-k always renormalised
            moe = MoeConfig(experts, raw["num_experts_per_tok"], raw["intermediate_size"], norm_topk_prob=True)
        elif arch == "DeepseekV3ForCausalLM":  # the first first_k_dense_replace layers dense
            moe = MoeConfig(
                raw["n_routed_experts"],
                raw["num_experts_per_tok"],
                raw["moe_intermediate_size"],
                norm_topk_prob=raw.get("norm_topk_prob", True),
                mlp_only_layers=tuple(range(raw.get("first_k_dense_replace", 0))),
                sigmoid_groups=(raw.get("n_group") or 1, raw.get("topk_group") or 1),
                routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
                shared_intermediate=raw["moe_intermediate_size"] * (raw.get("n_shared_experts") or 0),
            )
        elif arch == "GptOssForCausalLM":  # every layer sparse; a softmax over the top-k logits is the renormalised one
            moe = MoeConfig(
                experts,
                raw["num_experts_per_tok"],
                raw["intermediate_size"],
                norm_topk_prob=True,
                biases=True,
                swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
            )
        max_position = raw.get("max_position_embeddings", 4096)
        gemma = arch in GEMMA_ARCHITECTURES
        quant = raw.get("quantization_config")
        mla = None
        scale = float(raw["query_pre_attn_scalar"]) ** -0.5 if gemma else None
        if arch == "DeepseekV3ForCausalLM":
            mla = MlaConfig(
                raw.get("q_lora_rank"),
                raw["kv_lora_rank"],
                raw["qk_nope_head_dim"],
                raw["qk_rope_head_dim"],
                raw["v_head_dim"],
                raw.get("rope_interleave", True),
            )
            scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5 * rope.softmax_mscale
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position=max_position,
            tie_word_embeddings=raw.get("tie_word_embeddings", gemma),
            attention_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            output_bias=arch != "Qwen2ForCausalLM" and raw.get("attention_bias", False),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *GEMMA3_ARCHITECTURES),
            rope=rope,
            local_rope=local_rope,
            layer_windows=_layer_windows(raw, arch, max_position),
            attention_scale=scale,
            mla=mla,
            attention_softcap=raw.get("attn_logit_softcapping") if gemma else None,
            final_softcap=raw.get("final_logit_softcapping") if gemma else None,
            attention_sinks=arch == "GptOssForCausalLM",
            eos_token_ids=eos_ids(raw),
            moe=moe,
            fp8=Fp8Config.from_dict(quant) if quant and quant.get("quant_method") != "mxfp4" else None,
            mxfp4=bool(quant) and quant.get("quant_method") == "mxfp4",
            draft_vocab_size=raw.get("draft_vocab_size"),
            eagle_aux_layers=tuple(aux) if (aux := (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")) else None,
        )

    @classmethod
    def load(cls, model_dir: Path) -> ModelConfig:
        """From config.json, with generation_config.json's end-of-sequence ids added (Phi-3's chat turns end with
        one that only it names), as transformers' generate and vLLM stop on them."""
        config = cls.from_dict(json.loads((model_dir / "config.json").read_text()))
        generation = model_dir / "generation_config.json"
        if not generation.exists():
            return config
        return replace(config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + eos_ids(json.loads(generation.read_text())))))

    @property
    def kv_cache_heads(self) -> int:
        """A token's KV heads in the pool (MLA's latent is one)."""
        return 1 if self.mla is not None else self.num_kv_heads

    @property
    def kv_cache_dim(self) -> int:
        """Each cached head's K (and V) width: MLA's latent is split in two, its first half in K's place, the rest in V's."""
        return self.mla.latent // 2 if self.mla is not None else self.head_dim

    @property
    def rope_dim(self) -> int:
        """The dims a head's rope rotates (MLA: its roped part)."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @property
    def windowed_layers(self) -> int:
        return sum(1 for window in self.layer_windows if window)

    @property
    def window(self) -> int:
        """The longest sliding window of its layers (0: none): the window pool holds this much of each request."""
        return max(self.layer_windows, default=0)

    @property
    def long_rope_from(self) -> int | None:
        """LongRoPE's pretraining length: a request whose prompt is longer takes the long factors at every position
        (runtime.models.layers.rope_cos_sin_cache); None without LongRoPE."""
        return self.rope.original_max_position if self.rope.kind == "longrope" else None


GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", *GEMMA3_ARCHITECTURES)
QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def _gemma3_text(raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's 4B, 12B and 27B checkpoints are image-text models: their config nests the text model's, which
    leaves out what its defaults say (transformers' Gemma3TextConfig fills them in)."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**raw.get("text_config", {})).to_dict()


MULTIMODAL = {"Gemma3ForConditionalGeneration": _gemma3_text}


def _ropes(raw: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """(the rope, the sliding-window layers' own or None): Gemma 3 names one per layer type in rope_parameters,
    or its older configs rope_theta with rope_scaling for the full layers, and rope_local_base_freq."""
    params = raw.get("rope_parameters") or {}
    by_type = "full_attention" in params
    full = params["full_attention"] if by_type else {**(raw.get("rope_scaling") or {}), **params}
    rope = _rope(full, raw)
    if by_type and "sliding_attention" in params:
        return rope, _rope(params["sliding_attention"], raw)
    if "rope_local_base_freq" in raw:
        return rope, RopeConfig(theta=float(raw["rope_local_base_freq"]))
    return rope, None


def _rope(params: dict[str, Any], raw: dict[str, Any]) -> RopeConfig:
    rope = RopeConfig.from_dict(params, raw)
    if rope.kind not in ("default", "linear", "llama3", "longrope", "yarn"):
        raise ValueError(f"rope type {rope.kind!r} is not supported")
    if float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ValueError("rope over part of each head (partial_rotary_factor) is not supported")
    return rope


def _layer_windows(raw: dict[str, Any], arch: str, max_position: int) -> tuple[int, ...]:
    """Each layer's sliding window, as transformers' config classes lay them out: config.json's layer_types, else
    Gemma 3's pattern (five windowed layers to a full one), Gemma 2's (every other), Qwen's (from
    max_window_layers on, where use_sliding_window), or every layer (Mistral-7B-v0.1, Phi-3-mini). () where none
    is shorter than the context."""
    window, layers = raw.get("sliding_window"), raw["num_hidden_layers"]
    if not window or window >= max_position or (arch in QWEN_ARCHITECTURES and not raw.get("use_sliding_window", False)):
        return ()
    if (types := raw.get("layer_types")) is None:
        every = {"Gemma2ForCausalLM": 2}.get(arch, raw.get("sliding_window_pattern", 6) if arch in GEMMA3_ARCHITECTURES else 0)
        first = raw.get("max_window_layers", layers) if arch in QWEN_ARCHITECTURES else 0
        windowed = [(i + 1) % every != 0 if every else i >= first for i in range(layers)]
        types = ["sliding_attention" if w else "full_attention" for w in windowed]
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)


def eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """A config's `eos_token_id`, one id, a list or none, as a tuple."""
    eos = raw.get("eos_token_id")
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


DEFAULT_KV_TOKENS = 16384


ATTENTION_BACKEND_NAMES = ("torch", "flashinfer")


def device_defaults(device: str) -> dict[str, Any]:
    """Defaults by device: on CPU a large prefill chunk stalls every decode, and a launch computes its step,
    so a third step in flight only queues; on CUDA it keeps the device fed while results cross processes."""
    cuda = device.startswith("cuda")
    return {
        "max_prefill_tokens": 8192 if cuda else 512,
        "attention_backend": "flashinfer" if cuda else "torch",
        "steps_in_flight": 3 if cuda else 2,
    }


def speculative_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """LLM(speculative_config=...): vLLM's keys and methods ("ngram", "draft_model", "eagle", "eagle3"), or
    EngineConfig's speculative fields without their prefix, as those fields."""
    out: dict[str, Any] = {}
    for key, value in spec.items():
        name = VLLM_SPECULATIVE_KEYS.get(key, f"speculative_{key}")
        if name not in EngineConfig.__dataclass_fields__:
            raise ValueError(f"speculative_config has no key {key!r}; it takes {sorted(VLLM_SPECULATIVE_KEYS)} and EngineConfig's")
        if name == "speculative_algorithm" and isinstance(value, str):
            value = VLLM_METHODS.get(value.lower(), value.upper())
        out[name] = value
    return out


KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")  # fp8: vLLM's name for fp8_e4m3
FLOAT32_NAMES = ("float32", "fp32")


SCHEDULE_POLICIES = ("fcfs", "priority")

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # PEFT's names of the projections
DEFAULT_MAX_LORA_RANK = 64


def lora_adapter(entry: str) -> tuple[str, str]:
    """(name, path) of a --lora-paths entry: NAME=PATH, a bare PATH (named by its last part), or vLLM's JSON object."""
    if entry.startswith("{"):
        try:
            spec = json.loads(entry)
            return str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f'a JSON --lora-modules entry is {{"name": ..., "path": ...}}, not {entry}') from None
    name, sep, path = entry.partition("=")
    if not sep:
        return Path(entry.rstrip("/")).name, entry
    if not name or not path:
        raise ValueError(f"a --lora-paths entry is NAME=PATH or PATH, not {entry!r}")
    return name, path


# what --override-generation-config may set, as vLLM's: generation_config.json's sampling keys, by SamplingParams' names
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
GENERATION_ALIASES = {"max_new_tokens": "max_tokens"}  # generation_config.json's name, which vLLM's flag takes


def generation_defaults(given: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    """--override-generation-config's object (or its pairs) as sorted (SamplingParams field, value) pairs, each
    checked against the field's range, so that a server refuses at start a default no request could send."""
    named = {GENERATION_ALIASES.get(name, name): value for name, value in dict(given).items()}
    if unknown := sorted(named.keys() - set(GENERATION_DEFAULTS)):
        raise ValueError(f"override_generation_config takes {', '.join(GENERATION_DEFAULTS)} (or max_new_tokens), not {unknown}")
    if any(isinstance(value, bool) or not isinstance(value, int | float) for value in named.values()):
        raise ValueError(f"override_generation_config's values are numbers, not {named}")
    if fractional := sorted(name for name in ("max_tokens", "top_k") if isinstance(named.get(name), float)):
        raise ValueError(f"override_generation_config's {' and '.join(fractional)} are whole numbers, not {named}")
    try:
        SamplingParams(**named)
    except ValueError as exc:
        raise ValueError(f"override_generation_config: {exc}") from None
    return tuple(sorted(named.items()))


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"a JSON object is expected, not {text}")
    return value


def _by_device(name: str) -> str:
    """The help text's note on a default that depends on the device."""
    return f"default: {device_defaults('cuda')[name]} on CUDA, {device_defaults('cpu')[name]} on CPU"


@dataclass(frozen=True)
class EngineConfig(CliConfig):
    """The scheduler's and the engine's settings: `ringllm serve`'s engine flags, `LLM`'s keyword arguments."""

    page_size: int = field(default=16, metadata=flag("tokens per KV cache page"))
    num_pages: int | None = field(
        default=None,
        metadata=flag(f"KV pool size in pages (default: what --mem-fraction leaves on CUDA, {DEFAULT_KV_TOKENS} tokens on CPU)"),
    )
    mem_fraction: float = field(default=0.85, metadata=flag("CUDA: share of device memory for weights and KV cache"))
    cuda_graph_max_bs: int = field(default=256, metadata=flag("CUDA: largest decode batch replayed as a graph; 0: off"))
    cuda_graph_max_prefill_tokens: int = field(
        default=3072, metadata=flag("CUDA: largest step with prefill chunks replayed as a graph (up to 7 sequences); 0: off")
    )
    max_prefill_tokens: int | None = field(
        default=None, metadata=flag(f"the prefill chunk budget of one step ({_by_device('max_prefill_tokens')})")
    )
    mixed_chunk: bool = field(
        default=False,
        metadata=flag("run decodes inside steps with prefill chunks (default: prefill first, as SGLang does)", ("--enable-mixed-chunk",)),
    )
    max_running_requests: int = field(default=256, metadata=flag("requests decoding at once; more wait in the queue"))
    enable_prefix_cache: bool = field(
        default=True, metadata=flag("no radix-tree prefix cache: every prompt is prefilled whole", inverse="--disable-prefix-cache")
    )
    # SGLang's HiCache flags, spelled as SGLang spells them (runtime.scheduler.radix_cache, runtime.engine.kv_tiers)
    hierarchical_cache: bool = field(
        default=False,
        metadata=flag(
            "KV tiers under the prefix cache: pages evicted from the device pool go to host memory (and with "
            "--hicache-storage-backend, to disk), and come back when a prompt matches them",
            ("--enable-hierarchical-cache",),
        ),
    )
    hicache_ratio: float = field(default=2.0, metadata=flag("the host tier's size as a multiple of the device pool's"))
    hicache_size: float = field(default=0.0, metadata=flag("the host tier's size in GB (0: --hicache-ratio decides)"))
    hicache_write_policy: str = field(
        default="write_through",
        metadata=flag(
            "write_through: a page is copied to the host tier (and disk) as it enters the prefix cache; "
            "write_back: as it leaves the device (and to disk as it leaves the host tier)",
            choices=WRITE_POLICIES,
        ),
    )
    hicache_storage_backend: str | None = field(
        default=None, metadata=flag("a third tier: file, whole pages in files named by their tokens' hash chain", choices=STORAGE_BACKENDS)
    )
    hicache_storage_dir: str | None = field(
        default=None, metadata=flag("where the file tier keeps its pages (default: RINGLLM_CACHE/hicache)", metavar="DIR")
    )
    # SGLang's speculative decoding flags (runtime.scheduler.ngram drafts; runtime.engine verifies)
    speculative_algorithm: str | None = field(
        default=None,
        metadata=flag(
            "speculative decoding: NGRAM drafts the tokens that followed the latest earlier match of the sequence's "
            "last tokens (prompt lookup), STANDALONE a smaller model of the same vocabulary, EAGLE and EAGLE3 a draft "
            "head over the target's hidden states (--speculative-draft-model-path); a step verifies the draft and "
            "keeps what the model itself gives",
            choices=SPECULATIVE_ALGORITHMS,
        ),
    )
    speculative_draft_model_path: str | None = field(
        default=None, metadata=flag("STANDALONE, EAGLE, EAGLE3: the draft model's or head's folder or hub id", metavar="DIR")
    )
    speculative_num_draft_tokens: int = field(default=4, metadata=flag("draft tokens a step verifies (a step gives up to one more)"))
    speculative_num_steps: int | None = field(
        default=None,
        metadata=flag(
            "SGLang's draft depth: when given, a chain of this many draft tokens (it sets --speculative-num-draft-tokens; "
            "SGLang counts the last known token too, so its --speculative-num-draft-tokens N + 1 says the same)",
            metavar="N",
        ),
    )
    speculative_eagle_topk: int | None = field(
        default=None, metadata=flag("SGLang's draft tree width: drafts are chains, so 1 (or unset)", metavar="1")
    )
    speculative_disable_by_batch_size: int | None = field(
        default=8,
        metadata=flag(
            "no drafts while more requests than this run (vLLM's flag): speculation pays at small batches, and past 8 "
            "it stopped paying on an H200 (docs/speculative.md)",
            metavar="N",
        ),
    )
    speculative_ngram_min_match_window_size: int = field(default=1, metadata=flag("NGRAM: the fewest last tokens a match takes"))
    speculative_ngram_max_match_window_size: int = field(
        default=12, metadata=flag("NGRAM: the most last tokens a match takes (the longest match wins)")
    )
    # SGLang's name: the sliding-window layers' pool (runtime.scheduler.window_pages) against the full layers'
    swa_full_tokens_ratio: float = field(
        default=0.8,
        metadata=flag(
            "models with sliding windows: the tokens the windowed layers' KV pool holds, as a share of the full layers' "
            "(each request holds its window there, idle pages serve the prefix cache)"
        ),
    )
    schedule_policy: str = field(
        default="fcfs",
        metadata=flag(
            "priority: requests carry a 'priority' (lower first, as vLLM); the queue and preemption follow it", choices=SCHEDULE_POLICIES
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=flag("auto, float32, bfloat16 or float16 (auto: bfloat16 on CUDA and on CPUs with AMX bf16 tiles, else float32)"),
    )
    device: str = field(default="cpu", metadata=flag("cpu, cuda or cuda:N"))
    dummy_weights: bool = field(default=False, metadata=flag("random weights of the config's shape"))
    attention_backend: str | None = field(default=None, metadata=flag(_by_device("attention_backend"), choices=ATTENTION_BACKEND_NAMES))
    seed: int = field(default=0, metadata=flag("seeds the per-request seeds of requests that bring none"))
    # applied where a request becomes SamplingParams (api.protocol, LLM.get_default_sampling_params); a JSON object
    # on the command line, a dict or pairs as LLM's keyword, held as sorted pairs so that the config stays hashable
    override_generation_config: tuple[tuple[str, Any], ...] = field(
        default=(),
        metadata=flag(
            "vLLM's: a JSON object of sampling defaults for the fields a request leaves out, of "
            f"{', '.join(GENERATION_DEFAULTS)} (or max_new_tokens; it caps every request), e.g. "
            '\'{"temperature": 0.5, "top_p": 0.9}\'',
            metavar="JSON",
            parse=_json_object,
            show=lambda pairs: json.dumps(dict(pairs)),
        ),
    )
    steps_in_flight: int | None = field(
        default=None, metadata=flag(f"steps planned ahead of their results ({_by_device('steps_in_flight')}; 1: no overlap)")
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=flag(
            "engine processes that split the model, one device each (engine0..engineN-1 in `ringllm status`)",
            ("--tp", "--tensor-parallel-size"),
            metavar="N",
        ),
    )
    pd: bool = field(
        default=False,
        metadata=flag(
            "prefill-decode disaggregation: a prefill engine and a decode engine, each with its own KV pool, under one "
            "scheduler; a request's KV moves to the decode engine after its first token (on CUDA the next device)"
        ),
    )
    # off by default: measured in the engine, NCCL was as fast (benchmarks/results/README.md, tensor parallelism)
    custom_all_reduce: bool = field(
        default=False,
        metadata=flag("CUDA, --tp > 1: all-reduces of up to 4 MiB through torch's symmetric-memory one-shot kernel instead of NCCL"),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=flag(
            "auto: the model's dtype; fp8_e4m3 (fp8): float8 pages with a scale per layer, twice the tokens of bf16",
            choices=KV_CACHE_DTYPES,
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=flag(
            "fp8: quantize a bf16/fp32 checkpoint's projections per output channel at load (an FP8 checkpoint needs no flag)",
            choices=("fp8",),
        ),
    )
    # the pool leaves room for the standby's own copy of the weights and its graphs
    standby_engine: bool = field(
        default=False,
        metadata=flag(
            "CUDA: a second engine process, set up over the kept KV pool with its own weights, takes over at once when the engine dies"
        ),
    )
    # batch-invariant GEMMs and attention, as SGLang's flag of the same name
    deterministic: bool = field(
        default=False,
        metadata=flag(
            "batch-invariant kernels: a request's output does not depend on what runs beside it (dense models; Hopper GPUs, fp32 CPUs)",
            ("--enable-deterministic-inference",),
        ),
    )
    # a request waits out of the batch while its grammar compiles (runtime.structured.masks)
    grammar_compile_timeout: float = field(
        default=10.0,
        metadata=flag(
            "seconds an output constraint's grammar may take to compile against the vocabulary; a longer one is a 400 "
            "(the request waits out of the batch meanwhile)"
        ),
    )
    # LoRA adapters (runtime.models.lora), with SGLang's flags and vLLM's spellings
    enable_lora: bool = field(default=False, metadata=flag("serve LoRA adapters over the base model; a request names one as its model"))
    lora_paths: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "adapters loaded at start, each NAME=PATH (a PEFT folder), a bare PATH (named by its folder) or vLLM's JSON "
            '{"name": ..., "path": ...}; implies --enable-lora',
            ("--lora-paths", "--lora-modules"),
            metavar="NAME=PATH",
        ),
    )
    max_loras_per_batch: int = field(
        default=8, metadata=flag("the most distinct adapters one step runs", ("--max-loras-per-batch", "--max-loras"))
    )
    max_loaded_loras: int | None = field(
        default=None, metadata=flag("the most adapters held in host memory (default: no bound)", ("--max-loaded-loras", "--max-cpu-loras"))
    )
    max_lora_rank: int | None = field(
        default=None, metadata=flag(f"the largest adapter rank served (default: the largest of --lora-paths, else {DEFAULT_MAX_LORA_RANK})")
    )
    lora_target_modules: tuple[str, ...] = field(
        default=(), metadata=flag(f"the projections adapters may train (default: all of {', '.join(LORA_TARGETS)})", choices=LORA_TARGETS)
    )

    def __post_init__(self) -> None:
        """Fill in the device's defaults, and refuse sizes that could never run."""
        if self.device.startswith("cuda") and self.dtype in FLOAT32_NAMES:  # flashinfer has no float32 kernels
            if self.attention_backend == "flashinfer":
                raise ValueError("attention_backend flashinfer has no float32 kernels: use dtype bfloat16 or float16, or the torch backend")
            if self.attention_backend is None:
                log.warning("float32_on_cuda", attention_backend="torch", why="flashinfer has no float32 kernels; CUDA graphs are off")
                object.__setattr__(self, "attention_backend", "torch")
        for name, value in device_defaults(self.device).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, not {self.schedule_policy!r}")
        if self.attention_backend not in ATTENTION_BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKEND_NAMES}, not {self.attention_backend!r}")
        at_least = {
            "page_size": 1,
            "max_prefill_tokens": 1,
            "max_running_requests": 1,
            "num_pages": 1,
            "cuda_graph_max_bs": 0,
            "cuda_graph_max_prefill_tokens": 0,
            "steps_in_flight": 1,
            "tensor_parallel_size": 1,
            "speculative_num_draft_tokens": 1,
            "speculative_num_steps": 1,
            "speculative_disable_by_batch_size": 0,
            "speculative_ngram_min_match_window_size": 1,
        }
        for name, least in at_least.items():
            value = getattr(self, name)
            if value is not None and value < least:
                raise ValueError(f"{name} must be at least {least}, not {value}")
        if self.hierarchical_cache and not self.enable_prefix_cache:
            raise ValueError("the hierarchical cache tiers the prefix cache: it cannot run with --disable-prefix-cache")
        if self.hierarchical_cache and self.tensor_parallel_size > 1:
            raise ValueError("the hierarchical cache runs on one rank (--tp 1)")
        if self.hicache_storage_backend and not self.hierarchical_cache:
            raise ValueError("--hicache-storage-backend needs --enable-hierarchical-cache")
        if not (self.hicache_ratio > 0 and self.hicache_size >= 0):
            raise ValueError(
                f"hicache_ratio must be more than 0 and hicache_size at least 0, not {self.hicache_ratio}, {self.hicache_size}"
            )
        if self.hicache_storage_backend not in (None, *STORAGE_BACKENDS):
            raise ValueError(f"hicache_storage_backend must be one of {STORAGE_BACKENDS} or none, not {self.hicache_storage_backend!r}")
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {WRITE_POLICIES}, not {self.hicache_write_policy!r}")
        if self.speculative_algorithm not in (None, *SPECULATIVE_ALGORITHMS):
            raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS} or none, not {self.speculative_algorithm!r}")
        if (self.speculative_algorithm in MODEL_DRAFTS) != (self.speculative_draft_model_path is not None):
            raise ValueError(f"--speculative-algorithm {'/'.join(MODEL_DRAFTS)} takes --speculative-draft-model-path, and only they do")
        if self.speculative_algorithm in MODEL_DRAFTS and self.tensor_parallel_size > 1:
            raise ValueError("a draft model or head runs on one rank (--tp 1)")
        if self.speculative_eagle_topk not in (None, 1):
            raise ValueError("drafts are chains: --speculative-eagle-topk takes 1 (tree drafts are not built)")
        if self.speculative_num_steps is not None:  # SGLang's depth is the chain's length
            object.__setattr__(self, "speculative_num_draft_tokens", self.speculative_num_steps)
        if self.speculative_ngram_max_match_window_size < self.speculative_ngram_min_match_window_size:
            raise ValueError("speculative_ngram_max_match_window_size must be at least speculative_ngram_min_match_window_size")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be more than 0 seconds, not {self.grammar_compile_timeout}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], not {self.swa_full_tokens_ratio}")
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"mem_fraction must be in (0, 1], not {self.mem_fraction}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or none, not {self.quantization!r}")
        if self.pd and (self.tensor_parallel_size > 1 or self.speculative_algorithm or self.hierarchical_cache):
            raise ValueError("prefill-decode disaggregation runs one rank a side, without speculative decoding or KV tiers")
        if self.deterministic and (self.quantization or self.fp8_kv or self.tensor_parallel_size > 1):
            raise ValueError("deterministic inference runs unquantized weights and KV on one rank (FP8 scales and all-reduces mix rows)")
        object.__setattr__(self, "override_generation_config", generation_defaults(self.override_generation_config))
        if self.deterministic and self.device == "cpu" and self.dtype == "auto":  # the CPU's batch-invariant attention is fp32
            object.__setattr__(self, "dtype", "float32")
        self._check_lora()

    def _check_lora(self) -> None:
        if self.lora_paths:  # as SGLang: adapters given turn LoRA on
            object.__setattr__(self, "enable_lora", True)
        for name, least in (("max_loras_per_batch", 1), ("max_loaded_loras", 1), ("max_lora_rank", 1)):
            if (value := getattr(self, name)) is not None and value < least:
                raise ValueError(f"{name} must be at least {least}, not {value}")
        names = [name for name, _ in self.lora_adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-paths names an adapter twice: {names}")
        if self.max_loaded_loras is not None and len(names) > self.max_loaded_loras:
            raise ValueError(f"--lora-paths gives {len(names)} adapters; --max-loaded-loras holds {self.max_loaded_loras}")
        if self.enable_lora and (self.pd or self.speculative_algorithm or self.deterministic or self.quantization):
            raise ValueError("LoRA adapters are served without --pd, speculative decoding, deterministic inference and --quantization")

    @property
    def lora_adapters(self) -> tuple[tuple[str, str], ...]:
        """(name, path) of each --lora-paths entry."""
        return tuple(lora_adapter(entry) for entry in self.lora_paths)

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def host_tier_pages(self, device_pages: int, page_bytes: int) -> int:
        """The host tier's size in pages: --hicache-size GB, else --hicache-ratio times the device pool."""
        if not self.hierarchical_cache:
            return 0
        return int(self.hicache_size * 1e9 // page_bytes) if self.hicache_size else int(self.hicache_ratio * device_pages)

    @property
    def default_max_tokens(self) -> int | None:
        """--override-generation-config's max_tokens: the most any request draws (the api caps one that gives
        max_tokens, the scheduler one that leaves it out)."""
        return dict(self.override_generation_config).get("max_tokens")

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def window_prefill_pages(self, window: int) -> int:
        """The most window pages a prompt's prefill holds at once: its window, the chunks of the steps in flight, and a
        speculative draft after the last (a verify chunk's)."""
        assert self.max_prefill_tokens is not None and self.steps_in_flight is not None  # the device's defaults
        drafts = self.speculative_num_draft_tokens if self.speculative_algorithm is not None else 0
        return self.pages_for(window + self.steps_in_flight * self.max_prefill_tokens + drafts) + 1

    def window_pages_for(self, num_pages: int, window: int) -> int:
        """The window pool's pages beside a pool of `num_pages` (scheduler and engine both size it so): room for
        one prefill at least."""
        return max(int(num_pages * self.swa_full_tokens_ratio), self.window_prefill_pages(window))

    def cpu_pool_bytes(self, model: ModelConfig) -> int:
        """At most what a CPU engine's KV pool takes (values of up to 4 bytes; an FP8 pool holds the
        same bytes as an `auto` one, more tokens), the scratch page included."""
        token_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 4
        tokens = (self.num_pages + 1) * self.page_size if self.num_pages else DEFAULT_KV_TOKENS + self.page_size
        return tokens * token_bytes
