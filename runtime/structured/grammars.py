"""A request's output constraint (a guide: kind and spec) as an xgrammar grammar, serialized.

Built by the engine's builder process (runtime.structured.builder) while the request waits out of the
batch, then compiled against the vocabulary (runtime.structured.masks); a bad or oversized schema,
regex or grammar is refused with a 400 from there. Its JSON strings are kept strict, and a grammar
that admits nothing is refused (runtime.structured.checks). xgrammar is imported on the first guide,
not at start-up.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import orjson

from runtime.structured.checks import Layout

# what a guide can be: (kind, spec); the spec is a JSON string for json_schema and tools, text otherwise
GUIDE_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tools")
JSON_KINDS = ("json_schema", "json_object", "tools")  # whose strings keep to strict JSON (runtime.structured.checks)
# tool-call output formats, as xgrammar's structural tags name them, by --tool-call-parser
TOOL_FORMATS = {"hermes": "qwen_3", "qwen3": "qwen_3", "llama3_json": "llama", "gpt-oss": "harmony"}
# GPT-OSS's harmony: its markers (special tokens), a message of reasoning and what follows it, and a call's header
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
HARMONY_ANALYSIS = ("<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant")
HARMONY_CALL = "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
# at most one whitespace character between JSON tokens: `{"a": 1}` and `{"a":1}` both pass, but a
# model cannot stall in an endless run of blanks (which free JSON whitespace lets it do)
MAX_WHITESPACE = 1
MAX_MESSAGE_CHARS = 500
# building and compiling take about 0.8 s a MB of grammar against a 49k vocabulary on two cores: this bounds the
# work one request can give the engine's compile thread (runtime.structured.masks), which runs beside the steps
MAX_GRAMMAR_BYTES = 4 << 20
# how much lower than the steps' threads a grammar's build and compile run in the engine: on a CPU engine a build
# at the same priority made its steps of 16 streams 3-4x slower
GRAMMAR_NICE = 5
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before its message


class GuideError(ValueError):
    """The guide cannot be built: its message says why, for the client's 400."""


def lower_priority() -> None:
    """The calling thread gives way to the steps' (Linux: a thread's nice value is its own, and the threads and
    processes it starts inherit it)."""
    os.nice(GRAMMAR_NICE)


def build_grammar(kind: str, spec: str) -> str:
    """The guide's grammar as xgrammar's serialized JSON; GuideError when it is invalid or too large."""
    if kind not in GUIDE_KINDS:
        raise GuideError(f"unknown guide kind {kind!r}")
    grammar = _build(kind, spec)
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise GuideError(
            f"the {_label(kind)}'s grammar takes {len(grammar) / 2**20:.1f} MB, more than the {MAX_GRAMMAR_BYTES >> 20} MB "
            "this server compiles (a schema's optional properties multiply it)"
        )
    return grammar


@functools.lru_cache(maxsize=512)
def _build(kind: str, spec: str) -> str:
    import pydantic
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            grammar = xgr.Grammar.from_json_schema(spec, max_whitespace_cnt=MAX_WHITESPACE)
        elif kind == "json_object":
            grammar = xgr.Grammar.from_json_schema('{"type": "object"}', max_whitespace_cnt=MAX_WHITESPACE)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(spec)
        elif kind == "choice":  # EBNF string literals take JSON's escapes
            grammar = xgr.Grammar.from_ebnf("root ::= " + " | ".join(orjson.dumps(c).decode() for c in orjson.loads(spec)))
        elif kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(spec)
        else:
            grammar = xgr.Grammar.from_structural_tag(_tool_tag(orjson.loads(spec)))
        if (layout := Layout.parse(grammar.serialize_json())) is None:
            return grammar.serialize_json()
        if kind in JSON_KINDS:
            layout = layout.restrict_json_strings()
    except (RuntimeError, ValueError, TypeError, AssertionError, pydantic.ValidationError) as exc:
        raise GuideError(f"the {_label(kind)} cannot be used: {_message(exc)}") from None
    if (rule := layout.dead_rule()) is not None:
        raise GuideError(
            f"the {_label(kind)} admits no output: its rule '{rule}' can never end (it refers only to itself, or to "
            "what admits nothing, such as an empty character class)"
        )
    return layout.dumps()


def _tool_tag(spec: dict[str, Any]) -> Any:
    """xgrammar's structural tag for a model's tool-call syntax, with each call's arguments held to
    its tool's parameter schema. xgrammar's `required` lets free text surround the calls; OpenAI's
    means calls alone, so there its calls are taken without the text (one a line). Harmony's is ringllm's own."""
    if TOOL_FORMATS[spec["parser"]] == "harmony":
        return _harmony_tag(spec)
    import xgrammar as xgr
    from xgrammar.structural_tag import Format, SequenceFormat, TagsWithSeparatorFormat, TriggeredTagsFormat

    tag = xgr.get_model_structural_tag(
        TOOL_FORMATS[spec["parser"]],
        tools=spec["tools"],
        tool_choice=spec["tool_choice"],
        reasoning="auto" if spec["reasoning"] else "disabled",
        parallel_tool_calls=spec["parallel_tool_calls"],
        max_whitespace_cnt=MAX_WHITESPACE,
    )
    if spec["tool_choice"] == "required":
        parts: list[Format] = tag.format.elements if isinstance(tag.format, SequenceFormat) else [tag.format]
        calls = parts[-1]
        assert isinstance(calls, TriggeredTagsFormat)
        parts[-1] = TagsWithSeparatorFormat(tags=calls.tags, separator="\n", at_least_one=True, stop_after_first=calls.stop_after_first)
        tag.format = SequenceFormat(elements=parts) if len(parts) > 1 else parts[0]
    return tag


def _harmony_tag(spec: dict[str, Any]) -> Any:
    """GPT-OSS's forced call: a message of reasoning if the output reasons, then one call's header,
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`, and arguments valid for the tool's
    schema. The markers are written as their text, which their special tokens match (xgrammar matches a token by
    the text it decodes to). A call's closing <|call|> is left out: it is one of GPT-OSS's stop tokens, which a
    grammar can end on but never match as text, so xgrammar's own harmony tag, which spells it, could never
    finish a call. Its stop ends the turn, so there is one call, whatever parallel_tool_calls says."""
    from xgrammar.structural_tag import (
        AnyTextFormat,
        ConstStringFormat,
        Format,
        JSONSchemaFormat,
        OptionalFormat,
        OrFormat,
        SequenceFormat,
        StructuralTag,
        TagFormat,
    )

    functions = [tool["function"] for tool in spec["tools"]]
    if isinstance(choice := spec["tool_choice"], dict):
        functions = [f for f in functions if f["name"] == choice["function"]["name"]]
    calls: list[Format] = [
        SequenceFormat(
            elements=[
                ConstStringFormat(value=HARMONY_CALL.format(name=f["name"])),
                # as xgrammar reads a tool's schema for the other formats: none, or strict false, holds it to JSON only
                JSONSchemaFormat(
                    json_schema=True if f.get("strict") is False or f.get("parameters") is None else f["parameters"],
                    max_whitespace_cnt=MAX_WHITESPACE,
                ),
            ]
        )
        for f in functions
    ]
    call = calls[0] if len(calls) == 1 else OrFormat(elements=calls)
    if spec["reasoning"]:
        begin, end, then = HARMONY_ANALYSIS
        text = AnyTextFormat(excludes=[marker for marker in HARMONY_MARKERS if marker != end])  # a message's text holds no marker
        analysis = SequenceFormat(elements=[TagFormat(begin=begin, content=text, end=end), ConstStringFormat(value=then)])
        call = SequenceFormat(elements=[OptionalFormat(content=analysis), call])
    return StructuralTag(format=call)


def _label(kind: str) -> str:
    return "forced tool call" if kind == "tools" else kind.replace("_", " ")


def _message(exc: Exception) -> str:
    """The library's words on one line, without its source position."""
    text = " ".join(_SOURCE_PREFIX.sub("", str(exc)).split()) or type(exc).__name__
    return text[:MAX_MESSAGE_CHARS]
