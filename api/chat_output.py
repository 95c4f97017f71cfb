"""A chat choice's text as OpenAI's message parts: reasoning (--reasoning-parser) set apart from the
answer, and tool calls (--tool-call-parser) read out of it, both as the text streams. Only text that
may yet be part of a marker is held back; a call's arguments stream as they are generated. GPT-OSS's
harmony format, whose reasoning and calls are read together, has a parser of its own (api.harmony)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from runtime.structured.grammars import TOOL_FORMATS

THINK, END_THINK = "<think>", "</think>"
# qwen3: thinking only where the output opens with <think> (enable_thinking false leaves it out);
# deepseek_r1: the template opens the block, so the output is thinking until </think>
THINK_OPENS_INSIDE = {"qwen3": False, "deepseek_r1": True}
HARMONY = "gpt-oss"  # GPT-OSS's harmony format, for both flags: either one names it for both (actors.pipeline)
REASONING_PARSERS = (*THINK_OPENS_INSIDE, HARMONY)
TOOL_CALL_PARSERS = tuple(TOOL_FORMATS)
DEFAULT_TOOL_CALL_PARSER = "hermes"  # unless --tool-call-parser says otherwise
# vLLM's names for parsers that SGLang names otherwise: each flag takes both, and keeps SGLang's
REASONING_PARSER_ALIASES = {"openai_gptoss": HARMONY}
TOOL_CALL_PARSER_ALIASES = {"openai": HARMONY}
# hermes and qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>; llama3_json: {"name": ..., "parameters": {...}}
JSON = json.JSONDecoder()
CALL_MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "qwen3": ("<tool_call>", "</tool_call>"), "llama3_json": ('{"name"', None)}
# a call's text up to its arguments' opening brace: what lets it stream (other key orders go out whole)
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
BLANKS = re.compile(r"[ \t\n\r]*")


def held_prefix(text: str, marker: str) -> int:
    """How many of text's last characters begin `marker`: held until the next delta tells."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return keep
    return 0


class ReasoningSplitter:
    """Gives (reasoning, content) of the text fed so far, as far as they can be told apart. A
    constrained output (a grammar, a forced tool) opens with <think> if it thinks at all."""

    def __init__(self, parser: str, constrained: bool) -> None:
        self.opens_inside = THINK_OPENS_INSIDE[parser] and not constrained
        self.state = "start"  # start -> thinking -> after -> answer, or start -> answer
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = ""
        if self.state == "start":
            head = self.held.lstrip()
            if head.startswith(THINK):
                self.held, self.state = head[len(THINK) :], "thinking"
            elif THINK.startswith(head):
                return "", ""  # may still open with <think>
            else:
                self.state = "thinking" if self.opens_inside else "answer"
        if self.state == "thinking":
            end = self.held.find(END_THINK)
            if end < 0:
                cut = len(self.held) - held_prefix(self.held, END_THINK)
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
            reasoning, self.held, self.state = self.held[:end], self.held[end + len(END_THINK) :], "after"
        if self.state == "after":  # the newlines between </think> and the answer belong to neither
            self.held = self.held.lstrip("\n")
            if not self.held:
                return reasoning, ""
            self.state = "answer"
        content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The text still held, at the end: an unclosed block is all thinking."""
        held, self.held = self.held, ""
        if self.state == "thinking" or (self.state == "start" and self.opens_inside):
            return held, ""
        return "", "" if self.state == "after" else held


@dataclass
class _Streamed:
    """A call whose arguments are streaming, and where its JSON stands (depth 1: inside the call's object)."""

    index: int
    depth: int = 1
    in_string: bool = False
    escaped: bool = False
    arguments_done: bool = False

    def scan(self, text: str, depth: int) -> int | None:
        """Follows `text`; where the JSON comes back to `depth` (just past that bracket), or None if it does not."""
        for at, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == depth:
                    return at + 1
        return None


class ToolCallParser:
    """Gives (content, call deltas) of the answer fed so far. A call streams as it is generated, as vLLM
    and SGLang stream theirs: a first delta (index, id, type, name) once its text has named a tool of
    the request and opened its arguments' object, then the arguments' text as it comes, verbatim, so
    the fragments joined are the generated JSON. Such a call stays a call even if it never closes (the
    finish reason says so). A call that opens otherwise goes out whole once it closes, if it parses and
    names a tool of the request; else it is content. Deltas of one call within one feed come merged."""

    def __init__(self, parser: str, names: set[str]) -> None:
        self.begin, self.end = CALL_MARKERS[parser]
        self.names = names
        self.held, self.inside = "", False
        self.streamed: _Streamed | None = None
        self.calls = 0  # calls begun
        self.after_call = 0  # 1 just after a call, 2 after its "; " separator too

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        content: list[str] = []
        deltas: dict[int, dict] = {}
        while True:
            if self.after_call:  # newlines after a call, and a "; " between calls, are neither calls nor content
                self.held = self.held.lstrip("\n" if self.after_call == 1 else " \n")
                if self.after_call == 1 and self.held.startswith(";"):
                    self.held, self.after_call = self.held[1:].lstrip(" \n"), 2
                self.after_call = self.after_call if not self.held else 0
            if not self.inside:
                at = self.held.find(self.begin)
                if at < 0:
                    cut = len(self.held) - held_prefix(self.held, self.begin)
                    content.append(self.held[:cut])
                    self.held = self.held[cut:]
                    break
                content.append(self.held[:at])
                self.held, self.inside = self.held[at:], True
            if self.streamed is None and not self._open(deltas):
                if (closed := self._close()) is None:
                    break
                call, text = closed
                if call is not None:
                    deltas[self.calls] = {"index": self.calls, **call}
                    self.calls += 1
                content += [] if call else [text]
                self.after_call = 1 if call is not None else 0
            elif not self._stream(deltas):
                break
        return "".join(content), list(deltas.values())

    def _open(self, deltas: dict[int, dict]) -> bool:
        """Begins streaming the held call if its text has named a tool of the request and opened its arguments."""
        header = HEADER.match(self.held, len(self.begin) if self.end is not None else 0)
        if header is None or header[1] not in self.names:
            return False
        self.streamed, self.held = _Streamed(self.calls), self.held[header.end() :]
        deltas[self.calls] = {"index": self.calls, **call_delta(header[1], "")}
        self.calls += 1
        return True

    def _stream(self, deltas: dict[int, dict]) -> bool:
        """Passes on the streaming call's new arguments text; True once the call has closed."""
        streamed = self.streamed
        assert streamed is not None  # a call streams: _open has begun it
        if not streamed.arguments_done:
            end = streamed.scan(self.held, 1)
            cut = len(self.held) if end is None else end
            if cut:
                delta = deltas.setdefault(streamed.index, {"index": streamed.index, "function": {"arguments": ""}})
                delta["function"]["arguments"] += self.held[:cut]
            self.held = self.held[cut:]
            if end is None:
                return False
            streamed.arguments_done = True
        if self.end is not None:  # the rest of the call's object, then its end marker
            end = self.held.find(self.end)
            if end < 0:
                return False
            self.held = self.held[end + len(self.end) :]
        else:  # the rest of the call's object, followed as it comes
            end = streamed.scan(self.held, 0)
            self.held = "" if end is None else self.held[end:]
            if end is None:
                return False
        self.inside, self.streamed, self.after_call = False, None, 1
        return True

    def _close(self) -> tuple[dict | None, str] | None:
        """The held call, once its text is complete: (the call or None if it does not parse, its text)."""
        if self.end is not None:
            end = self.held.find(self.end)
            if end < 0:
                return None
            text, body, self.held = self.held[: end + len(self.end)], self.held[len(self.begin) : end], self.held[end + len(self.end) :]
        else:
            try:
                _, length = JSON.raw_decode(self.held)
            except json.JSONDecodeError:  # not complete yet (or not JSON: then it stays held, and is content at the end)
                return None
            text, body, self.held = self.held[:length], self.held[:length], self.held[length:]
        self.inside = False
        call = _call(body)
        return (call if call is not None and call["function"]["name"] in self.names else None), text

    def finish(self) -> str:
        """The text still held, at the end: an unclosed call is content, unless it has begun streaming."""
        held, self.held, self.inside = self.held, "", False
        streaming, self.streamed = self.streamed, None
        return "" if streaming else held


def call_delta(name: str, arguments: str) -> dict:
    """A call's first delta, or a whole call: its new id, type, name and arguments."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _call(body: str) -> dict | None:
    """A whole call from its JSON text: its arguments as generated (a string's value if they are one)."""
    members = _members(body)
    if members is None or not isinstance(members.get("name", (None,))[0], str):
        return None
    if (arguments := members.get("arguments", members.get("parameters"))) is None:
        return None
    value, text = arguments
    return call_delta(members["name"][0], value if isinstance(value, str) else text)


def _members(text: str) -> dict[str, tuple[Any, str]] | None:
    """A JSON object's members as (value, the value's text), or None if `text` is not one object."""
    try:
        if not isinstance(JSON.decode(text), dict):
            return None
    except json.JSONDecodeError:
        return None
    # BLANKS matches anywhere (if only the empty string), which the checker cannot know: hence the ignores
    members, at = {}, BLANKS.match(text, text.index("{") + 1).end()  # pyright: ignore[reportOptionalMemberAccess]
    while text[at] != "}":
        key, at = JSON.raw_decode(text, at)
        at = BLANKS.match(text, BLANKS.match(text, at).end() + 1).end()  # pyright: ignore[reportOptionalMemberAccess]  # past the colon
        value, end = JSON.raw_decode(text, at)
        members[key] = (value, text[at:end])
        at = BLANKS.match(text, end).end()  # pyright: ignore[reportOptionalMemberAccess]
        at = BLANKS.match(text, at + 1).end() if text[at] == "," else at  # pyright: ignore[reportOptionalMemberAccess]
    return members


class ChatOutput:
    """One chat choice's parsers; `feed` gives the message fields of what can be released."""

    def __init__(self, reasoning_parser: str | None, tool_call_parser: str | None, tool_names: set[str], constrained: bool) -> None:
        self.reasoning = ReasoningSplitter(reasoning_parser, constrained) if reasoning_parser else None
        self.tools = ToolCallParser(tool_call_parser, tool_names) if tool_call_parser else None

    @property
    def calls(self) -> int:
        """How many tool calls the choice has begun."""
        return self.tools.calls if self.tools else 0

    def feed(self, text: str, final: bool) -> dict:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            more_reasoning, more_content = self.reasoning.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        calls = []
        if self.tools:
            content, calls = self.tools.feed(content)
            if final:
                content += self.tools.finish()
        parts: dict = {"content": content}
        if reasoning:
            parts["reasoning_content"] = reasoning
        if calls:
            parts["tool_calls"] = calls
        return parts
