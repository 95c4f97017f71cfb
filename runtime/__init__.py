"""Engine runtime. `LLM` and `SamplingParams` load lazily, so that processes which only need
`runtime.obs.logs` or the command line never import torch."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers only: at run time these load on first use, below
    from runtime.llm import LLM, GenerationOutput
    from runtime.sampling_params import SamplingParams

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]


def __getattr__(name: str):
    if name in ("LLM", "GenerationOutput"):
        from runtime import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
