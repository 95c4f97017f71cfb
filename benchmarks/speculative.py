"""Speculative decoding on an input-grounded task, against plain decoding, side by side: one request at a
time asks the model to repeat a ~500-token text, or to repeat it with one word changed; each arm is an `LLM`
built from the same flags but --speculative-algorithm. Per task and arm: output tokens, seconds, tokens/s (best
of --rounds, the arms alternating), and for speculation the verify steps, the draft tokens kept and the tokens a
verify step gave. Greedy, so both arms must give the same tokens; the record says whether they did.

    python -m benchmarks.speculative [--model DIR] [--max-tokens 600] [--rounds 3] [--out FILE] [ENGINE FLAGS]

ENGINE FLAGS are `ringllm serve`'s (EngineConfig's), for both arms; the plain arm runs without
--speculative-algorithm, the other with it (NGRAM unless given)
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from benchmarks.provenance import machine, provenance
from runtime import LLM, SamplingParams
from runtime.config import EngineConfig
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


def run(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    started = time.perf_counter()
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))
    return output.token_ids, time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n\n")[0])  # pyright: ignore[reportOptionalMemberAccess]
    p.add_argument("--model", type=Path, default=None, help="a model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3, help="timed runs of each arm and task, alternating; the best counts")
    p.add_argument("--out", type=Path)
    EngineConfig.add_cli_args(p)
    args = p.parse_args(argv)
    model = args.model or default_model_dir()
    config = EngineConfig.from_cli_args(args)
    plain = LLM(model, config, speculative_algorithm=None)
    spec = LLM(model, config, speculative_algorithm=config.speculative_algorithm or "NGRAM")
    tokenizer = plain.tokenizer
    if tokenizer is None:
        raise SystemExit(f"{model} has no tokenizer: the tasks are text")
    tasks: dict[str, Any] = {}
    for name, content in TASKS.items():
        chat = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(chat, add_special_tokens=False)
        best = {"plain": float("inf"), "speculative": float("inf")}
        outputs: dict[str, list[int]] = {}
        before = (spec.engine.speculation.steps, spec.engine.speculation.kept)
        for _ in range(args.rounds):
            for arm, llm in (("plain", plain), ("speculative", spec)):
                outputs[arm], seconds = run(llm, prompt, args.max_tokens)
                best[arm] = min(best[arm], seconds)
        steps = (spec.engine.speculation.steps - before[0]) / args.rounds
        kept = (spec.engine.speculation.kept - before[1]) / args.rounds
        tokens = len(outputs["speculative"])
        tasks[name] = {
            "prompt_tokens": len(prompt),
            "text_tokens": len(tokenizer.encode(TEXT, add_special_tokens=False)),
            "output_tokens": {arm: len(ids) for arm, ids in outputs.items()},
            "same_tokens": outputs["plain"] == outputs["speculative"],
            "seconds": {arm: round(s, 3) for arm, s in best.items()},
            "tok_per_s": {arm: round(len(outputs[arm]) / s, 1) for arm, s in best.items()},
            "speedup": round(best["plain"] / best["speculative"] * tokens / max(len(outputs["plain"]), 1), 3),
            "verify_steps": round(steps, 1),
            "draft_tokens_kept": round(kept, 1),
            "tokens_per_verify_step": round((kept + steps) / steps, 2) if steps else None,
        }
    record = {
        **provenance(),
        "machine": machine(),
        "command": shlex.join(["python", "-m", "benchmarks.speculative", *argv]),
        "model": str(model),
        "config": {"plain": dataclasses.asdict(plain.config), "speculative": dataclasses.asdict(spec.config)},
        "tasks": tasks,
    }
    for name, task in tasks.items():
        print(
            f"{name}: plain {task['tok_per_s']['plain']} tok/s, NGRAM {task['tok_per_s']['speculative']} tok/s "
            f"({task['speedup']}x), {task['tokens_per_verify_step']} tokens a verify step, same tokens: {task['same_tokens']}"
        )
    line = orjson.dumps(record).decode()
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return record


if __name__ == "__main__":
    main()
