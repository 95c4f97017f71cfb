"""GPT-OSS's harmony output as OpenAI's message parts (--reasoning-parser / --tool-call-parser gpt-oss).

The output is a run of messages, each a header and a body: `<|channel|>analysis<|message|>...<|end|>`, then
`<|start|>assistant<|channel|>final<|message|>...<|return|>`, or a call, `<|start|>assistant<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient may come before the channel instead).
The analysis channel is reasoning; a message to one of the request's tools is a call; every other message is
content (a commentary message without a recipient is the preamble before a call). The markers are special tokens,
which the detokenizer keeps in the text for this parser alone (api.app); none of them reaches the client.

A text parser, as SGLang's gpt-oss detector is: the openai-harmony package reads token ids, but fetches its
vocabulary from the internet when it starts."""

from __future__ import annotations

import re

from api.chat_output import call_delta, held_prefix
from runtime.structured.grammars import HARMONY_MARKERS as MARKERS

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")  # a message's end; the other markers begin the next message's header
MARKER = re.compile("|".join(map(re.escape, MARKERS)))
# what a header holds before <|message|>: its markers, the role, channel, recipient and content type
HEADER = re.compile(r"(?:<\|(?:start|channel|constrain)\|>|[\w.:= -])*")
HEADER_STARTS = ("<|", " to=")  # text that opens otherwise, where a header would begin, is not harmony
CHANNEL = re.compile(r"<\|channel\|>(\w+)")
RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


class HarmonyParser:
    """Gives the message parts of the text fed so far: reasoning, content and call deltas, each as it is
    generated. Only text that may be part of a marker, or a header whose body has not begun, is held. A call
    streams as ToolCallParser streams one: a first delta (index, id, type, name) once its header is whole,
    then its arguments' text verbatim, to its marker or the output's end (<|call|> is a stop token, whose
    text the detokenizer drops). Output that does not open like a header is content: an output held to a
    response_format's grammar reads as the answer. Deltas of one call within one feed come merged."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.held = ""
        self.route: str | int | None = None  # None: reading a header; else "reasoning", "content" or a call's index
        self.calls = 0  # calls begun

    def feed(self, text: str, final: bool) -> dict:
        self.held += text
        parts: dict[str | int, str] = {}  # by route, what this feed releases
        begun: dict[int, str] = {}  # calls whose header this feed read, by index: their names
        while self.held and (route := self.route if self.route is not None else self._open(parts, begun)) is not None:
            marker = MARKER.search(self.held)
            # held: a marker's beginning, unless the output ends here
            end = marker.start() if marker else len(self.held) - (0 if final else _marker_tail(self.held))
            if end:
                parts[route] = parts.get(route, "") + self.held[:end]
            self.held, self.route = self.held[end:], route
            if marker is None:
                break
            self.route, self.held = None, self.held.removeprefix(marker[0]) if marker[0] in ENDS else self.held
        if final:  # a header cut short says nothing
            self.held, self.route = "", None
        return _message_parts(parts, begun)

    def _open(self, parts: dict[str | int, str], begun: dict[int, str]) -> str | int | None:
        """Reads the held header: the route of the message whose body begins, or None while the header may go on.
        What only begins like a header (a character no header holds comes first) is dropped up to there, and the
        rest is content."""
        held = self.held
        if not any(held.startswith(start) or start.startswith(held) for start in HEADER_STARTS):
            return "content"  # not harmony (a response_format's JSON, say): the text is the answer
        at, good = held.find(MESSAGE), HEADER.match(held).end()  # pyright: ignore[reportOptionalMemberAccess]  # `*` always matches
        if at < 0 and good == len(held) - _marker_tail(held):
            return None
        if at != good:
            self.held = held[good:]
            return "content"
        header, self.held = held[:at], held[at + len(MESSAGE) :]
        channel, recipient = CHANNEL.search(header), RECIPIENT.search(header)
        if recipient is None or recipient[1] not in self.names:
            return "reasoning" if channel is not None and channel[1] == "analysis" else "content"
        self.calls += 1
        parts[self.calls - 1], begun[self.calls - 1] = "", recipient[1]  # the call's first delta goes out now
        return self.calls - 1


def _marker_tail(text: str) -> int:
    """How many of text's last characters may begin a marker."""
    return max(held_prefix(text, marker) for marker in MARKERS)


def _message_parts(parts: dict[str | int, str], begun: dict[int, str]) -> dict:
    """A feed's release as ChatOutput gives it: content, and reasoning_content and tool_calls where there are some."""
    out: dict = {"content": parts.get("content", "")}
    if parts.get("reasoning"):
        out["reasoning_content"] = parts["reasoning"]
    calls = [
        {"index": i, **(call_delta(begun[i], text) if i in begun else {"function": {"arguments": text}})}
        for i, text in parts.items()
        if isinstance(i, int)
    ]
    if calls:
        out["tool_calls"] = calls
    return out
