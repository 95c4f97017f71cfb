"""A chat choice's text as OpenAI's message parts: reasoning (--reasoning-parser) set apart from the
answer, and tool calls (--tool-call-parser) read out of it, both as the text streams. Only text that
may yet be part of a marker is held back; a call goes out whole once it has closed."""

from __future__ import annotations

import json
import uuid

import orjson

from runtime.structured.grammars import TOOL_FORMATS

THINK, END_THINK = "<think>", "</think>"
# qwen3: thinking only where the output opens with <think> (enable_thinking false leaves it out);
# deepseek_r1: the template opens the block, so the output is thinking until </think>
REASONING_PARSERS = {"qwen3": False, "deepseek_r1": True}
TOOL_CALL_PARSERS = tuple(TOOL_FORMATS)
DEFAULT_TOOL_CALL_PARSER = "hermes"  # unless --tool-call-parser says otherwise
# hermes and qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>; llama3_json: {"name": ..., "parameters": {...}}
JSON = json.JSONDecoder()
CALL_MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "qwen3": ("<tool_call>", "</tool_call>"), "llama3_json": ('{"name"', None)}


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
        self.opens_inside = REASONING_PARSERS[parser] and not constrained
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


class ToolCallParser:
    """Gives (content, calls) of the answer fed so far; a call whose text does not parse, or that names
    no tool of the request, stays content."""

    def __init__(self, parser: str, names: set[str]) -> None:
        self.begin, self.end = CALL_MARKERS[parser]
        self.names = names
        self.held, self.inside = "", False
        self.after_call = 0  # 1 just after a call, 2 after its "; " separator too

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        content, calls = [], []
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
            if (closed := self._close()) is None:
                break
            call, text = closed
            calls += [call] if call else []
            content += [] if call else [text]
            self.after_call = 1 if call is not None else 0
        return "".join(content), calls

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
        """The text still held, at the end: an unclosed call is content."""
        held, self.held, self.inside = self.held, "", False
        return held


def _call(body: str) -> dict | None:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or not {"arguments", "parameters"} & parsed.keys():
        return None
    arguments = parsed.get("arguments", parsed.get("parameters"))
    arguments = arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": parsed["name"], "arguments": arguments}}


class ChatOutput:
    """One chat choice's parsers; `feed` gives the message fields of what can be released."""

    def __init__(self, reasoning_parser: str | None, tool_call_parser: str | None, tool_names: set[str], constrained: bool) -> None:
        self.reasoning = ReasoningSplitter(reasoning_parser, constrained) if reasoning_parser else None
        self.tools = ToolCallParser(tool_call_parser, tool_names) if tool_call_parser else None
        self.calls = 0

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
            parts["tool_calls"] = [{"index": self.calls + i, **call} for i, call in enumerate(calls)]
            self.calls += len(calls)
        return parts
