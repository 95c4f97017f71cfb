"""Structured output and tools in a request: which guide (runtime.structured.grammars) constrains
its output, and the tools its chat template receives. Every spelling vLLM, SGLang and OpenAI use
reads into one (kind, spec) pair; the engine builds the grammar and refuses a bad one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from api.errors import ApiError

Guide = tuple[str, str]  # (kind, spec): runtime.structured.grammars.GUIDE_KINDS
STRUCTURED_OUTPUT_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}
# top-level spellings: vLLM's guided_* and SGLang's regex, ebnf and json_schema
TOP_LEVEL_GUIDES = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "regex": "regex",
    "ebnf": "grammar",
    "json_schema": "json_schema",
}
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")
# a tool's function fields beside its name, as OpenAI's API types them: the type, what an error calls it, and
# whether null stands for absent
TOOL_FUNCTION_FIELDS = {
    "description": (str, "a string", True),
    "parameters": (dict, "a JSON schema (an object)", False),
    "strict": (bool, "a boolean", True),
}
MAX_SPEC_CHARS = 64 << 10  # of a schema, regex, grammar, choice list or tool list: each slot of the request carries it


@dataclass(frozen=True)
class Tools:
    """A chat request's tools: what its template renders, and how its output is read back."""

    tools: list[dict]
    choice: str | dict  # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    parallel: bool

    @property
    def forced(self) -> bool:
        """Must the output be a call (required, or a named function)? The grammar then holds it to one."""
        return self.choice != "none" and self.choice != "auto"


def guide_of(body: dict) -> Guide | None:
    """The one output constraint the body asks for, if any; a 400 for two, or a malformed one."""
    found: list[tuple[str, Guide]] = []
    if (fmt := body.get("response_format")) is not None and (guide := _response_format(fmt)) is not None:
        found.append(("response_format", guide))
    if (outputs := body.get("structured_outputs")) is not None:
        found.append(("structured_outputs", _structured_outputs(outputs)))
    for name, kind in TOP_LEVEL_GUIDES.items():
        if (value := body.get(name)) is not None:
            found.append((name, _spec(name, kind, value)))
    if len(found) > 1:
        raise ApiError(f"only one output constraint may be given; this request has {', '.join(n for n, _ in found)}", param=found[1][0])
    return found[0][1] if found else None


def _response_format(fmt: Any) -> Guide | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", ""
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise ApiError(
                "'response_format' of type json_schema needs 'json_schema': {'name': ..., 'schema': {...}}", param="response_format"
            )
        return _spec("response_format.json_schema.schema", "json_schema", inner["schema"])
    raise ApiError("'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}", param="response_format")


def _structured_outputs(outputs: Any) -> Guide:
    given = [k for k, v in outputs.items() if v is not None and v is not False] if isinstance(outputs, dict) else []
    if len(given) != 1 or given[0] not in STRUCTURED_OUTPUT_KEYS:
        raise ApiError(
            f"'structured_outputs' must hold exactly one of {', '.join(STRUCTURED_OUTPUT_KEYS)} (other options are not supported)",
            param="structured_outputs",
        )
    key = given[0]
    if key == "json_object":
        return "json_object", ""
    return _spec(f"structured_outputs.{key}", STRUCTURED_OUTPUT_KEYS[key], outputs[key])


def _spec(name: str, kind: str, value: Any) -> Guide:
    """A guide's spec as the text the grammar builder reads: a schema as JSON, choices as a JSON list."""
    guide = _spec_text(name, kind, value)
    if len(guide[1]) > MAX_SPEC_CHARS:
        raise ApiError(f"'{name}' takes {len(guide[1])} characters, more than the {MAX_SPEC_CHARS} allowed", param=name)
    return guide


def _dumps(name: str, value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError as exc:  # nested past orjson's depth
        raise ApiError(f"'{name}' cannot be used: {exc}", param=name) from None


def _spec_text(name: str, kind: str, value: Any) -> Guide:
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise ApiError(f"'{name}' is not valid JSON: {exc}", param=name) from None
        if not isinstance(value, dict | bool):
            raise ApiError(f"'{name}' must be a JSON schema (an object)", param=name)
        return kind, _dumps(name, value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(f"'{name}' must be a non-empty list of non-empty strings", param=name)
        return kind, _dumps(name, value)
    if not isinstance(value, str) or not value:
        raise ApiError(f"'{name}' must be a non-empty string", param=name)
    return kind, value


def tools_of(body: dict) -> Tools | None:
    """The request's tools and tool choice; None when it has no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise ApiError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ApiError("'tool_choice' names a tool or requires one, but no 'tools' are given", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError("'tools' must be a list of {'type': 'function', 'function': {...}}", param="tools")
    names = [_tool_name(i, tool) for i, tool in enumerate(tools)]
    if len(set(names)) != len(names):
        raise ApiError("each tool's function needs a name of its own", param="tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ApiError("a named 'tool_choice' is {'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if name not in names:
            raise ApiError(f"'tool_choice' names the function '{name}', which is not among the tools", param="tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise ApiError("'tool_choice' must be 'none', 'auto', 'required' or a named function", param="tool_choice")
    return Tools(tools, choice, parallel)


def _tool_name(i: int, tool: Any) -> str:
    """A tool's name, once every field of it has the type OpenAI's API gives it (a field of the wrong type would
    reach the template, and the grammar of a forced choice would not see the tool)."""
    if not isinstance(tool, dict):
        raise ApiError(
            f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}", param=f"tools[{i}]"
        )
    if tool.get("type") != "function":
        raise ApiError(f"tools[{i}].type must be 'function'", param=f"tools[{i}].type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ApiError(f"tools[{i}].function must be an object with a 'name'", param=f"tools[{i}].function")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ApiError(
            f"tools[{i}].function.name must be a string of letters, digits, '_', '.' or '-' (at most 64)", param=f"tools[{i}].function.name"
        )
    for key, (kind, what, nullable) in TOOL_FUNCTION_FIELDS.items():
        if key in function and not isinstance(function[key], kind) and not (nullable and function[key] is None):
            raise ApiError(f"tools[{i}].function.{key} must be {what}", param=f"tools[{i}].function.{key}")
    return name


def tool_guide(tools: Tools, parser: str, reasoning: bool) -> Guide:
    """The grammar that holds a required or named tool choice to a valid call, in the parser's syntax."""
    spec = {
        "parser": parser,
        "tools": tools.tools,
        "tool_choice": tools.choice,
        "parallel_tool_calls": tools.parallel,
        "reasoning": reasoning,
    }
    text = _dumps("tools", spec)
    if len(text) > MAX_SPEC_CHARS:
        raise ApiError(f"'tools' take {len(text)} characters, more than the {MAX_SPEC_CHARS} a forced tool choice allows", param="tools")
    return "tools", text
