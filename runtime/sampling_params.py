"""Per-request sampling parameters: plain data, importable without torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass

GREEDY_BELOW = 1e-5  # temperatures under this draw greedily, as in vLLM: logits / 1e-38 overflow float32 to inf


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW): greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's log-probability and the top N there (vLLM's); skips the prefix cache
    priority: int = 0  # under the priority schedule policy, lower goes first (as vLLM)
    guide: tuple[str, str] | None = None  # (kind, spec) of runtime.structured.grammars: draws keep to its grammar
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs added to the logits, as OpenAI's

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.guide is not None:
            object.__setattr__(self, "guide", tuple(self.guide))
        checks = {
            "max_tokens must be >= 1": self.max_tokens >= 1,
            "temperature must be >= 0": self.temperature >= 0,
            "top_p must be in (0, 1]": 0 < self.top_p <= 1,
            "top_k must be -1, 0 or positive": self.top_k >= -1,
            "min_p must be in [0, 1]": 0 <= self.min_p <= 1,
            "presence_penalty must be in [-2, 2]": -2 <= self.presence_penalty <= 2,
            "frequency_penalty must be in [-2, 2]": -2 <= self.frequency_penalty <= 2,
            "repetition_penalty must be > 0": self.repetition_penalty > 0,
            "logprobs must be >= 0": self.logprobs is None or self.logprobs >= 0,
            "prompt_logprobs must be >= 0": self.prompt_logprobs is None or self.prompt_logprobs >= 0,
            "logit_bias must be in [-100, 100]": all(-100 <= b <= 100 for _, b in self.logit_bias),
        }
        if failed := [message for message, ok in checks.items() if not ok]:
            raise ValueError("; ".join(failed))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def filters(self) -> bool:
        return self.top_k > 1 or self.top_p < 1 or self.min_p > 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def to_dict(self) -> dict:
        return asdict(self)
