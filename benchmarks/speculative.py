"""Speculative decoding against plain decoding, on an input-grounded task: requests ask the model to repeat a
~500-token text, or to repeat it with one word changed. Each arm is an `LLM` built from the same engine flags
plus the arm's own (--arm NAME='FLAGS', any number; the plain arm drops --speculative-algorithm). Arms run one
after another, one engine on the device at a time. Per arm, task and batch size (that many copies of the
request at once): output tokens, seconds and tokens/s (best of --rounds, after a warm-up run), the ratio to
plain, and for speculation the verify steps and the tokens a verify step gave a request (its acceptance
length). Greedy, so every arm must give plain's tokens; the record says whether it did.

    python -m benchmarks.speculative [--model DIR] [--max-tokens 600] [--rounds 3] [--batch-sizes 1,8]
        [--tasks repeat,edit] [--ignore-eos] [--arm NAME='FLAGS' ...] [--out FILE] [ENGINE FLAGS]

Without --arm, one arm speculates with the engine flags' --speculative-algorithm, NGRAM unless given.

A draft of the target's first N layers (a STANDALONE checkpoint folder of N layers; with --dummy-weights each
parameter's random values follow its name, so the two share them) agrees with the target as far as the later
layers change the result: --residual-scales 1,0.1,0 --agree-layers N measures every case at each scale of the
target's layers from N on (their output projections, o_proj and down_proj, multiplied in place; the largest
scale first), which sets the acceptance length and leaves the target's cost as it is. At 0 the target is its
first N layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shlex
import sys
import time
from pathlib import Path
from typing import Any, cast

import orjson
import torch

from benchmarks.provenance import machine, provenance
from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
from runtime.models.decoder import MLP, DecoderLayer
from runtime.models.source import default_model_dir

SENTENCES = (
    "The harbour town woke slowly, its fishing boats rocking against the grey stone of the old quay.",
    "Every morning the baker on Mill Street opened his shutters at six and set out loaves of rye and barley.",
    "Children ran past the chapel on their way to school, their satchels bouncing and their voices loud.",
    "By nine the market square was full of stalls selling apples, cheese, wool, and copper pots.",
    "A retired sea captain sat on the same green bench each day, feeding crumbs to the pigeons.",
    "He told anyone who would listen about the storm of nineteen fifty-two and the ship he nearly lost.",
    "The schoolteacher, a patient woman named Ellen Marsh, taught arithmetic, history, and a little Latin.",
    "In the afternoons the tide went out far enough to show the ribs of an old wreck in the sand.",
    "Visitors came in summer to walk the cliff path, photograph the lighthouse, and eat crab sandwiches.",
    "The lighthouse keeper kept a logbook in which he noted the weather, the ships, and the birds he saw.",
    "When autumn arrived the visitors left, the cafes closed early, and the wind turned cold from the north.",
    "Fishermen mended their nets in sheds that smelled of tar, salt, and wet rope.",
    "On Fridays the town band practised in the hall above the post office, badly but with great spirit.",
    "The post office itself was run by two brothers who had not agreed about anything for forty years.",
    "In winter the storms could be fierce, and the harbour wall was sometimes hidden under white spray.",
    "Yet every spring the town painted its doors again, blue and yellow and red, as if nothing had happened.",
    "The library opened three days a week and lent out novels, seed catalogues, and knitting patterns.",
    "Its librarian believed that every person in the town had exactly one book that would change their life.",
    "She spent years trying to find that book for each of them, and claimed to have succeeded eleven times.",
    "Nobody in the town could say whether she was joking, and nobody quite dared to ask her.",
    "At night the lighthouse beam swept across the water, over the rooftops, and out to the dark sea.",
    "In the spring of that year a stranger arrived on the evening bus, carrying a violin case and a map.",
    "She took a room above the bakery, paid a month in advance, and said she had come to count the gulls.",
    "Within a week half the town had an opinion about her, and the other half had two.",
    "And the town slept, as it had for three hundred years, to the sound of the waves against the quay.",
)
TEXT = " ".join(SENTENCES)
TASKS = {
    "repeat": "Repeat the following text exactly, word for word, and nothing else:\n\n" + TEXT,
    "edit": "Repeat the following text exactly, but write 'village' wherever it says 'town':\n\n" + TEXT,
}


def _csv(kind: type) -> Any:
    return lambda text: [kind(item) for item in text.split(",") if item]


def parse(argv: list[str]) -> tuple[argparse.Namespace, dict[str, EngineConfig]]:
    """The benchmark's arguments and each arm's engine configuration, plain first."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n\n")[0])  # pyright: ignore[reportOptionalMemberAccess]
    p.add_argument("--model", type=Path, default=None, help="a model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3, help="timed runs of each arm, task and batch size; the best counts")
    p.add_argument("--batch-sizes", type=_csv(int), default=[1], help="comma-separated: copies of a request run at once")
    p.add_argument("--tasks", type=_csv(str), default=list(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--ignore-eos", action="store_true", help="every request decodes --max-tokens (random weights)")
    p.add_argument("--residual-scales", type=_csv(float), default=[1.0], help="comma-separated: scales of the later layers' output")
    p.add_argument("--agree-layers", type=int, default=1, help="the layers --residual-scales leaves as they are")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=FLAGS", help="engine flags of a speculative arm")
    p.add_argument("--out", type=Path)
    args, engine_argv = p.parse_known_args(argv)
    if unknown := set(args.tasks) - set(TASKS):
        p.error(f"unknown tasks {sorted(unknown)}")
    args.residual_scales = sorted(set(args.residual_scales), reverse=True)
    if args.residual_scales[0] > 1 or args.residual_scales[-1] < 0:
        p.error("--residual-scales lie in [0, 1]")
    engine = argparse.ArgumentParser(prog="ENGINE FLAGS")
    EngineConfig.add_cli_args(engine)
    base = EngineConfig.from_cli_args(engine.parse_args(engine_argv))
    arms = {"plain": dataclasses.replace(base, speculative_algorithm=None, speculative_draft_model_path=None)}
    algorithm = base.speculative_algorithm or "NGRAM"
    for arm in args.arm or [f"{algorithm.lower()}=--speculative-algorithm {algorithm}"]:
        name, sep, flags = arm.partition("=")
        if not sep or name in arms:
            p.error(f"--arm {arm!r}: give NAME=FLAGS, a name once")
        arms[name] = EngineConfig.from_cli_args(engine.parse_args(engine_argv + shlex.split(flags)))
    args.engine_argv = engine_argv
    return args, arms


def measure(llm: LLM, prompt: list[int], batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """`batch` copies of the prompt at once: a warm-up, then the best of --rounds; the verify steps and the
    tokens they kept, per round."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=args.ignore_eos)
    stats = llm.engine.speculation
    llm.flush_cache()  # KV cached at another --residual-scales scale is not this one's
    llm.generate([prompt] * batch, params)
    before, best = (stats.steps, stats.kept), float("inf")
    for _ in range(args.rounds):
        llm.flush_cache()
        started = time.perf_counter()
        outputs = llm.generate([prompt] * batch, params)
        best = min(best, time.perf_counter() - started)
    steps, kept = (stats.steps - before[0]) / args.rounds, (stats.kept - before[1]) / args.rounds
    tokens = sum(len(o.token_ids) for o in outputs)
    return {
        "output_tokens": tokens,
        "seconds": round(best, 3),
        "tok_per_s": round(tokens / best, 1),
        "verify_steps": round(steps, 1),
        "tokens_per_verify_step": round((kept + steps) / steps, 2) if steps else None,
        "token_ids": [o.token_ids for o in outputs],
    }


def scale_residuals(llm: LLM, first: int, scale: float) -> None:
    """Multiplies the output projections of the target's (and its draft model's) layers from `first` on by `scale`."""
    engines = [llm.engine, *([llm.engine.drafter.engine] if llm.engine.drafter else [])]
    for engine in engines:
        layers = cast("list[DecoderLayer]", list(engine.model.model.layers))  # a ModuleList is typed as holding any Module
        for layer in layers[first:]:
            if not isinstance(layer.mlp, MLP):
                raise SystemExit("--residual-scales takes a dense model")
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)


def task_text(llm: LLM, task: str) -> str:
    """The task as a chat's user turn, or as it is where the tokenizer has no chat template (a base model)."""
    tokenizer = llm.tokenizer
    assert tokenizer is not None  # run_arm checks
    if getattr(tokenizer, "chat_template", None) is None:
        return TASKS[task]
    return tokenizer.apply_chat_template([{"role": "user", "content": TASKS[task]}], add_generation_prompt=True, tokenize=False)


def case_name(task: str, scale: float, args: argparse.Namespace) -> str:
    return task if args.residual_scales == [1.0] else f"{task}@{scale:g}"


def run_arm(name: str, config: EngineConfig, model: Path, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build the arm's LLM, measure every task and batch size, and free the device for the next arm."""
    print(f"speculative: arm {name}: {shlex.join(config.to_cli_args())}", file=sys.stderr, flush=True)
    llm = LLM(model, config)
    if llm.tokenizer is None:
        raise SystemExit(f"{model} has no tokenizer: the tasks are text")
    figures: dict[str, Any] = {}
    current = 1.0
    for scale in args.residual_scales:
        if scale != current:
            scale_residuals(llm, args.agree_layers, scale / current)
            current = scale
        for task in args.tasks:
            prompt = llm.tokenizer.encode(task_text(llm, task), add_special_tokens=False)
            label = case_name(task, scale, args)
            case = figures[label] = {}
            for batch in args.batch_sizes:
                cell = case[str(batch)] = {"prompt_tokens": len(prompt), **measure(llm, prompt, batch, args)}
                gave = cell["tokens_per_verify_step"]
                print(
                    f"speculative: arm {name} {label} x{batch}: {cell['tok_per_s']} tok/s, {gave} a verify step",
                    file=sys.stderr,
                    flush=True,
                )
    record = dataclasses.asdict(llm.config)
    llm.close()
    del llm
    gc.unfreeze()  # the LLM froze its start-up heap; its engine's cycles must be collectable to free the device
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return figures, record


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, arms = parse(argv)
    model = args.model or default_model_dir()
    measured = {name: run_arm(name, config, model, args) for name, config in arms.items()}
    plain = {case: {batch: cell["token_ids"] for batch, cell in cells.items()} for case, cells in measured["plain"][0].items()}
    results = {name: figures for name, (figures, _) in measured.items()}
    cases = [case_name(task, scale, args) for scale in args.residual_scales for task in args.tasks]
    cells = [(name, case, batch, results[name][case][str(batch)]) for name in results for case in cases for batch in args.batch_sizes]
    for _, task, batch, cell in cells:
        cell["same_tokens"] = cell.pop("token_ids") == plain[task][str(batch)]
        cell["speedup"] = round(cell["tok_per_s"] / results["plain"][task][str(batch)]["tok_per_s"], 3)
    record = {
        **provenance(),
        "machine": machine(),
        "command": shlex.join(["python", "-m", "benchmarks.speculative", *argv]),
        "model": str(model),
        "config": {name: config for name, (_, config) in measured.items()},
        "results": results,
    }
    for name, task, batch, cell in cells:
        print(
            f"{name} {task} x{batch}: {cell['tok_per_s']} tok/s ({cell['speedup']}x plain), "
            f"{cell['tokens_per_verify_step']} tokens a verify step, same tokens: {cell['same_tokens']}"
        )
    line = orjson.dumps(record).decode()
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return record


if __name__ == "__main__":
    main()
