"""A process of the engine's own that builds grammars from output constraints, and the vocabulary where no
cache file holds it, for the engine's compile thread (runtime.structured.masks).

Both are work the engine's steps must not share a GIL with: xgrammar's build of a grammar from a schema
gives the GIL up only every few milliseconds (a 1 MB grammar takes ~0.6 s), and a step's every torch op
then waits for it again (16 CPU decode steps of 60 ms took up to 0.39 s beside builds on a thread, 0.19 s
beside builds in this process); loading a tokenizer holds it for up to ~0.2 s at a time. What comes back
is text (a grammar of at most 4 MB, the vocabulary's 1.6 MB), read off a pipe without the GIL. Compiling
the grammar against the vocabulary stays on the engine's thread: it releases the GIL throughout, and what
it makes (127 MB of JSON for a 1 MB grammar) could not cross a pipe cheaply.

The process starts with the first grammar, from the compile thread, whose lower priority it inherits and
whose exit (the engine's) ends it (a parent-death signal); it imports xgrammar (~1.5 s, torch with it)
before it answers. Requests and answers are length-prefixed JSON on its stdin and a copy of its stdout
(its own stdout goes to stderr, so that no library's print reaches the pipe). One that dies is started
again at the next request.
"""

from __future__ import annotations

import importlib
import os
import struct
import subprocess
import sys
from typing import IO, Any

import orjson

from runtime.structured.grammars import GuideError

_LENGTH = struct.Struct("<Q")
MAIN = """
import sys
sys.path[:] = {path!r}
from runtime.structured.builder import serve
serve({parent})
"""


class Builder:
    """The engine's side: one request at a time (the compile thread's)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    def grammar(self, kind: str, spec: str) -> str:
        """runtime.structured.grammars.build_grammar, there; GuideError as there."""
        return self._call(["grammar", kind, spec])

    def vocabulary(self, model_dir: str, vocab_size: int, stop_token_ids: list[int]) -> str:
        """runtime.structured.vocabulary.serialized, there."""
        return self._call(["vocabulary", model_dir, vocab_size, stop_token_ids])

    def start(self) -> None:
        """Started and ready (xgrammar imported), unless it is already."""
        self._call(["ready"])

    def close(self) -> None:
        """Its stdin closed, it ends (and the engine's exit ends it anyway)."""
        if (proc := self._proc) is not None:
            self._proc = None
            assert proc.stdin is not None  # piped
            proc.stdin.close()
            proc.wait()

    def _call(self, request: list[Any]) -> Any:
        for attempt in range(2):
            proc = self._proc
            if proc is None or proc.poll() is not None:
                command = [sys.executable, "-c", MAIN.format(path=sys.path, parent=os.getpid())]
                self._proc = proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert proc.stdin is not None and proc.stdout is not None  # both piped
            try:
                _send(proc.stdin, request)
                ok, kind, value = _receive(proc.stdout)
            except (OSError, EOFError):  # it died: once more with a new one
                proc.kill()
                proc.wait()
                if attempt:
                    raise RuntimeError("the grammar builder process died") from None
                continue
            if ok:
                return value
            raise GuideError(value) if kind == "guide" else RuntimeError(value)
        raise AssertionError("unreachable")


def _send(pipe: IO[bytes], value: Any) -> None:
    data = orjson.dumps(value)
    pipe.write(_LENGTH.pack(len(data)) + data)
    pipe.flush()


def _receive(pipe: IO[bytes]) -> Any:
    head = pipe.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError
    (length,) = _LENGTH.unpack(head)
    data = pipe.read(length)
    if len(data) < length:
        raise EOFError
    return orjson.loads(data)


def serve(parent: int) -> None:
    """The process's side: answers requests until its stdin closes."""
    from runtime.structured.grammars import build_grammar
    from runtime.structured.vocabulary import serialized
    from transport.lifetime import on_parent_death

    on_parent_death()
    if os.getppid() != parent:  # it died before the signal was armed
        return
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    importlib.import_module("xgrammar")  # what `ready` waits for

    requests = sys.stdin.buffer
    while True:
        try:
            request = _receive(requests)
        except EOFError:
            return
        try:
            match request:
                case ["grammar", kind, spec]:
                    answer = [True, None, build_grammar(kind, spec)]
                case ["vocabulary", model_dir, vocab_size, stops]:
                    answer = [True, None, serialized(model_dir, vocab_size, stops)]
                case _:
                    answer = [True, None, None]
        except GuideError as exc:
            answer = [False, "guide", str(exc)]
        except Exception as exc:  # for the compile that asked: its request fails, the engine goes on
            answer = [False, "error", f"{type(exc).__name__}: {exc}"]
        _send(answers, answer)
