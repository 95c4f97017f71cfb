"""Benchmarks; results are written to benchmarks/results/."""

from pathlib import Path

import orjson


def write_result(path: Path, result: object) -> None:
    """A result as indented JSON, its folder made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2) + b"\n")
