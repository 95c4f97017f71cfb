"""Per-request sampling parameters: plain data, importable without torch.

`SamplingParams` is the one place their ranges are checked: the api builds one from a request's
fields (and answers a 400 naming the field when a range fails), the offline `LLM` takes one, and
the frames carry it typed from the api worker to the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

GREEDY_BELOW = 1e-5  # temperatures under this draw greedily, as in vLLM: logits / 1e-38 overflow float32 to inf
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows
MAX_CACHE_SALT = 1024  # characters


class InvalidParams(ValueError):
    """A sampling parameter out of its range; `param` names it, `why` says what it must be."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"'{param}' {why}")
        self.param, self.why = param, why


def _within(low: float, high: float) -> tuple[Callable[[float], bool], str]:
    return (lambda v: low <= v <= high), f"must be between {low:g} and {high:g}"


# each field's range: what a value must satisfy, and the words that say so; None passes where a field may be unset
RANGES: dict[str, tuple[Callable, str]] = {
    "max_tokens": (lambda v: v >= 1, "must be at least 1"),
    "temperature": _within(0, 2),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "top_k": (lambda v: v >= -1, "must be -1 (off) or at least 0"),
    "min_p": _within(0, 1),
    "presence_penalty": _within(-2, 2),
    "frequency_penalty": _within(-2, 2),
    "repetition_penalty": (lambda v: 0 < v <= 2, "must be in (0, 2]"),
    "logprobs": _within(0, MAX_LOGPROBS),
    "prompt_logprobs": _within(0, MAX_LOGPROBS),
    "priority": (lambda v: -(2**31) <= v < 2**31, "must fit in 32 bits"),
    "cache_salt": (lambda v: 0 < len(v) <= MAX_CACHE_SALT, f"must be a non-empty string of at most {MAX_CACHE_SALT} characters"),
    "crash_at": (lambda v: v >= 0, "must be at least 0"),
    "logit_bias": (lambda pairs: all(-100 <= b <= 100 for _, b in pairs), "must map token ids to biases between -100 and 100"),
}


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # OpenAI's default for completions; None: the rest of the context (chat's default)
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
    logprobs: int | None = None  # the top N alternatives of each drawn token; 0: the drawn token's own only
    prompt_logprobs: int | None = None  # each prompt token's log-probability and the top N there (vLLM's); skips the prefix cache
    priority: int = 0  # under the priority schedule policy, lower goes first (as vLLM)
    guide: tuple[str, str] | None = None  # (kind, spec) of runtime.structured.grammars: draws keep to its grammar
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs added to the logits, as OpenAI's
    # vLLM's: the prefix cache's namespace; a request reuses only KV cached under the same salt (None: the shared one)
    cache_salt: str | None = None
    lora: str | None = None  # the LoRA adapter it runs with, by name (runtime.models.lora); None: the base model alone
    crash_at: int | None = None  # a test's fault injection (transport.env.fault_injection): the engine raises at this draw

    def __post_init__(self) -> None:
        """Lists become tuples (the frames carry lists), then every range is checked: the first that
        fails raises InvalidParams."""
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.guide is not None:
            object.__setattr__(self, "guide", tuple(self.guide))
        for name, (check, why) in RANGES.items():
            value = getattr(self, name)
            if value is not None and not check(value):
                raise InvalidParams(name, why)

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
