"""What the FP8 modes cost in accuracy, against the model's own dtype: perplexity over a fixed text
(teacher-forced, in windows, every position scored) and greedy agreement (how many of a
continuation's tokens equal the baseline's before the first that does not). Modes: the baseline,
an FP8 KV cache (`kv_cache_dtype="fp8_e4m3"`), FP8 weights (`quantization="fp8"`), and both.

The text is a fixed set of Python standard-library docstrings (English prose with some code), so
anyone with the same Python gets the same tokens. A mode that moves perplexity by more than 2% is a
defect.

    python -m benchmarks.fp8_accuracy [--model PATH] [--device cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import orjson
import torch
import torch.nn.functional as F

from benchmarks.provenance import provenance
from runtime import LLM, SamplingParams
from runtime.batch import AttentionMeta, ForwardBatch, kv_rows

MODES = {"baseline": {}, "fp8_kv": {"kv_cache_dtype": "fp8_e4m3"}, "fp8_weights": {"quantization": "fp8"}}
MODES["fp8_both"] = {**MODES["fp8_kv"], **MODES["fp8_weights"]}
WINDOW = 512
CONTINUATIONS, CONTINUATION_TOKENS = 8, 64
DEFAULT_OUT = Path(__file__).parent / "results" / "fp8-accuracy.json"


def fixed_text() -> str:
    return "\n\n".join(module.__doc__ or "" for module in (argparse, json, subprocess, textwrap, math))


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int]) -> float:
    """exp(mean next-token NLL) over `ids` in windows of WINDOW tokens, each a fresh sequence."""
    engine = llm.engine
    page = engine.config.page_size
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        window = ids[start : start + WINDOW + 1]
        n = len(window)
        pages = -(-n // page)
        positions = np.arange(n, dtype=np.int64)
        meta = AttentionMeta(
            np.array([0, n], np.int32), np.array([0, pages], np.int32), np.arange(pages, dtype=np.int32), np.array([n], np.int32)
        )
        rows = kv_rows(positions // page, positions % page, page)
        device = engine.device
        batch = ForwardBatch(
            torch.tensor(window, device=device), torch.from_numpy(positions).to(device), torch.from_numpy(rows).to(device), meta
        )
        engine.attention.prepare(meta)
        logits = engine.model.logits(engine.model(batch, engine.attention)).float()
        total += F.cross_entropy(logits[:-1], torch.tensor(window[1:], device=device), reduction="sum").item()
        count += n - 1
    return math.exp(total / count)


def continuations(llm: LLM, ids: list[int]) -> list[list[int]]:
    """Greedy continuations of CONTINUATIONS prompts cut from the text."""
    step = len(ids) // (CONTINUATIONS + 1)
    prompts = [ids[: step * (i + 1)][-256:] for i in range(CONTINUATIONS)]
    params = SamplingParams(max_tokens=CONTINUATION_TOKENS, temperature=0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


def agreement(ours: list[list[int]], baseline: list[list[int]]) -> float:
    """The share of the baseline's tokens matched before each continuation's first difference."""
    matched = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(ours, baseline)]
    return sum(matched) / sum(map(len, baseline))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp8_accuracy", description=__doc__.splitlines()[0])  # pyright: ignore[reportOptionalMemberAccess]
    parser.add_argument("--model", help="a model folder or hub id (default: the default model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    results, baseline = {}, None
    ids = None
    for mode, options in MODES.items():
        if args.device.startswith("cuda") and "kv_cache_dtype" in options:
            continue  # not on CUDA yet (docs/fp8.md)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **options)
        assert llm.tokenizer is not None, "the text needs the model's tokenizer"
        ids = ids or llm.tokenizer.encode(fixed_text(), add_special_tokens=False)
        ppl, cont = perplexity(llm, ids), continuations(llm, ids)
        baseline = baseline or cont
        results[mode] = {"perplexity": round(ppl, 4), "greedy_agreement": round(agreement(cont, baseline), 4)}
        print(mode, results[mode], flush=True)
        llm.close()
    assert ids is not None  # the baseline mode always runs
    base = results["baseline"]["perplexity"]
    for found in results.values():
        found["perplexity_change"] = f"{100 * (found['perplexity'] / base - 1):+.2f}%"
    record = {
        "command": " ".join(["python -m benchmarks.fp8_accuracy", *(sys.argv[1:] if argv is None else argv)]),
        **provenance(),
        "python": platform.python_version(),
        "text_tokens": len(ids),
        "device": args.device,
        "modes": results,
    }
    args.out.write_bytes(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
    print(orjson.dumps(record).decode())


if __name__ == "__main__":
    main()
