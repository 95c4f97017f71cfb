"""docs/cli.md, the command-line reference: every `ringllm` command's --help, from the parser itself.

`make docs` (python -m actors.cli_reference) writes it; a test fails while it differs from the flags."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from actors.cli import build_parser

PATH = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
COMMANDS = ("serve", "router", "status", "chat", "trace")
WIDTH = 110  # argparse wraps help to the terminal's COLUMNS; a fixed width keeps the page the same everywhere

HEADER = """# Command-line reference

Generated from the parser by `make docs`; a test keeps it current. Every `ringllm serve` flag is a
field of `EngineConfig` (runtime/config.py), `ServeConfig` (actors/pipeline.py) or `SupervisorConfig`
(actors/supervisor.py), declared once; `ringllm bench offline` takes the same engine flags
(`ringllm bench offline --help`, `ringllm bench serve --help`), and `LLM(model, **fields)` the same
fields.
"""


def command_help(command: str) -> str:
    """What `ringllm COMMAND --help` prints, at WIDTH columns."""
    out = io.StringIO()
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            build_parser().parse_args([command, "--help"])
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    return out.getvalue()


def markdown() -> str:
    sections = [f"## ringllm {command}\n\n```\n{command_help(command).rstrip()}\n```\n" for command in COMMANDS]
    return "\n".join([HEADER, *sections])


if __name__ == "__main__":
    PATH.write_text(markdown())
    print(f"wrote {PATH}")
