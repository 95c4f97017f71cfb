"""The `ringllm` command line."""

from __future__ import annotations

import argparse
import sys

import orjson

from actors.control import STATUS_KEYS, ControlBlock, pid_alive


def status(port: int, as_json: bool) -> int:
    """Read the supervisor's control block of the server on `port` and list its actors."""
    try:
        control = ControlBlock.attach(str(port))
    except FileNotFoundError:
        print(f"no ringllm server on port {port}", file=sys.stderr)
        return 1
    try:
        if not pid_alive(control.supervisor_pid):
            print(f"the supervisor of port {port} (pid {control.supervisor_pid}) is gone; "
                  "its segments are swept by the next server on that port", file=sys.stderr)
            return 1
        rows = control.status()
    finally:
        control.close()
    if as_json:
        print(orjson.dumps(rows).decode())
        return 0
    table = [STATUS_KEYS] + [tuple("-" if row[k] is None else str(row[k]) for k in STATUS_KEYS) for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(STATUS_KEYS))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ringllm", description="ringllm: an LLM serving engine on shared-memory rings")
    commands = parser.add_subparsers(dest="command", required=True)
    status_cmd = commands.add_parser("status", help="list the actors of a running server")
    status_cmd.add_argument("--port", type=int, default=8000)
    status_cmd.add_argument("--json", action="store_true", help=f"a JSON list of objects with keys {', '.join(STATUS_KEYS)}")
    args = parser.parse_args(argv)
    if args.command == "status":
        return status(args.port, args.json)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
