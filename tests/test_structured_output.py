"""Structured output, tool calls and reasoning, through the real openai client and a real server, on a
tiny random-weight Llama (SmolLM2's tokenizer, a chat template of its own that renders tools): only
the grammar can make its output valid. Bad constraints get a 400. (A kill of each actor kind in the
middle of constrained streams: tests/test_recovery.py, benchmarks.chaos --guided.)"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import orjson
import pytest

from tests.conftest import Server, launch, with_tokenizer

pytestmark = pytest.mark.slow  # grammars compiled for dozens of requests through two servers

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pet": {"enum": ["cat", "dog", "none"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"type": "integer", "maximum": 999}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
# Hermes-style tools and calls; enable_thinking false closes an empty think block, as Qwen3's does
TEMPLATE = """{%- if tools %}<|im_start|>system
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{%- if message.tool_calls %}{% for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}{% else %}
{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
HELLO = [{"role": "user", "content": "Describe someone."}]
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
NESTED: dict = {}
for _ in range(300):
    NESTED = {"type": "object", "properties": {"x": NESTED}}


@pytest.fixture(scope="module")
def guided_model(tiny_smol, smollm2, tmp_path_factory) -> Path:
    """The tiny model with SmolLM2's whole vocabulary (every token the template writes is its own) and a
    chat template that renders tools."""
    model = with_tokenizer(tiny_smol, smollm2, tmp_path_factory.mktemp("guided") / "model")
    (model / "chat_template.jinja").write_text(TEMPLATE)
    return model


@pytest.fixture(scope="module")
def guided(guided_model, tmp_path_factory) -> Iterator[Server]:
    flags = ("--reasoning-parser", "qwen3", "--schedule-policy", "priority", "--max-running-requests", "2")
    server = launch(guided_model, tmp_path_factory.mktemp("guided") / "serve.log", *flags)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def guided_wide(guided_model, tmp_path_factory) -> Iterator[Server]:
    """The same model and template, with room for 48 requests at once (`guided` runs two)."""
    server = launch(
        guided_model, tmp_path_factory.mktemp("guided") / "wide.log", "--reasoning-parser", "qwen3", "--max-running-requests", "48"
    )
    yield server
    server.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def test_json_schema_outputs_validate_with_n_choices_and_streamed(guided):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    answer = client(guided).chat.completions.create(model=guided.model, messages=HELLO, n=3, max_tokens=300, seed=1, response_format=fmt)
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(orjson.loads(choice.message.content), SCHEMA)
    texts = ["", ""]
    for chunk in client(guided).completions.create(
        model=guided.model, prompt=[5, 6, 7], n=2, max_tokens=300, seed=4, stream=True, extra_body={"response_format": fmt}
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    for text in texts:
        jsonschema.validate(orjson.loads(text), SCHEMA)


# bounded schemas (strings, arrays and numbers all have limits): every output ends within max_tokens
VARIED = {
    "person": SCHEMA,
    "strings": {
        "type": "object",
        "properties": {
            "short": {"type": "string", "minLength": 1, "maxLength": 6},
            "code": {"type": "string", "pattern": "^[a-z]{2,5}-[0-9]{2}$"},
            "color": {"type": "string", "enum": ["red", "light blue"]},
            "kind": {"const": "fixed"},
            "day": {"type": "string", "format": "date"},
            "id": {"type": "string", "format": "uuid"},
            "ip": {"type": "string", "format": "ipv4"},
        },
        "required": ["short", "code", "color", "kind", "day", "id", "ip"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "nick": {"type": "string", "minLength": 2, "maxLength": 8},
                },
                "required": ["id", "nick"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "points": {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "label": {"type": "string", "maxLength": 4}},
                    "required": ["x", "label"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["points"],
        "additionalProperties": False,
    },
    "matrix": {
        "type": "array",
        "maxItems": 2,
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}},
    },
    "numbers": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 100},
            "qty": {"type": "integer", "minimum": 1, "maximum": 20},
            "ratio": {"type": "number", "minimum": -1, "maximum": 1},
        },
        "required": ["price", "qty", "ratio"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {
            "note": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]},
            "count": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
        },
        "required": ["note", "count"],
        "additionalProperties": False,
    },
    "flags": {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "level": {"enum": [1, 2, 3, "high", None]},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
        },
        "required": ["ok", "level", "flags"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "a": {"type": "string", "minLength": 2, "maxLength": 4},
            "b": {"type": "string", "maxLength": 1},
            "c": {"type": "integer", "minimum": 0, "maximum": 5},
        },
        "required": ["a"],
        "additionalProperties": False,
    },
    "words": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "string", "pattern": "^[A-Za-z ]{1,6}$"}},
}
# per schema: (n, streamed) of each request, 20 outputs in all
VARIED_REQUESTS = [(1, False)] * 6 + [(4, False)] * 2 + [(1, True)] * 2 + [(4, True)]


async def test_200_json_schema_outputs_of_varied_schemas_parse_and_validate(guided_wide):
    """200 outputs of VARIED, n=1 and n=4, streamed and not, sent at once: each one finishes, parses with
    json.loads (strict: no raw control character in a string) and validates. Greedy draws from prompts
    that differ: on CPU a greedy step skips the sampler's noise, which costs more than the model."""
    http = openai.AsyncOpenAI(base_url=f"{guided_wide.base_url}/v1", api_key="none", max_retries=0)

    async def outputs(name: str, at: int, n: int, stream: bool) -> list[tuple[str, str | None, str]]:
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": VARIED[name]}}
        messages = [{"role": "user", "content": f"Describe someone, {at}."}]
        ask = dict(model=guided_wide.model, messages=messages, n=n, max_tokens=400, temperature=0, response_format=fmt)
        if not stream:
            answer = await http.chat.completions.create(**ask)
            return [(name, c.finish_reason, c.message.content) for c in answer.choices]
        texts, finishes = [""] * n, [None] * n
        async for chunk in await http.chat.completions.create(**ask, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                finishes[c.index] = c.finish_reason or finishes[c.index]
        return [(name, finish, text) for finish, text in zip(finishes, texts)]

    asks = [(name, 100 * i + j, *request) for i, name in enumerate(VARIED) for j, request in enumerate(VARIED_REQUESTS)]
    done = [o for many in await asyncio.gather(*(outputs(*ask) for ask in asks)) for o in many]
    assert len(done) == 200
    failed = []
    for name, finish, text in done:
        try:
            assert finish == "stop", f"finish {finish}"
            jsonschema.validate(json.loads(text), VARIED[name])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failed.append((name, text, str(exc)[:200]))
    assert not failed, failed


CHOICES = ["red", "green", "light blue"]
SPELLINGS = {
    # an object's keys and strings are unbounded, and the random model rarely closes one: a cut-off object still opens with {
    "json_object": ({"response_format": {"type": "json_object"}}, lambda text: text.startswith("{")),
    "guided_json": ({"guided_json": SCHEMA}, lambda text: jsonschema.validate(orjson.loads(text), SCHEMA) is None),
    "structured_outputs.json": (
        {"structured_outputs": {"json": orjson.dumps(SCHEMA).decode()}},
        lambda text: jsonschema.validate(orjson.loads(text), SCHEMA) is None,
    ),
    "regex": ({"regex": r"[a-z]{2,5}-\d{3}"}, lambda text: re.fullmatch(r"[a-z]{2,5}-\d{3}", text)),
    "guided_regex": ({"guided_regex": r"(yes|no), [0-9]{2}"}, lambda text: re.fullmatch(r"(yes|no), [0-9]{2}", text)),
    "guided_choice": ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
    "structured_outputs.choice": ({"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
    "guided_grammar": (
        {"guided_grammar": 'root ::= "(" digit ("+" digit){0,3} ")"\ndigit ::= [0-9]'},
        lambda text: re.fullmatch(r"\(\d(\+\d){0,3}\)", text),
    ),
}


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("chat", [True, False])
def test_every_spelling_of_a_constraint_holds_the_output_to_it(guided, spelling, chat):
    body, valid = SPELLINGS[spelling]
    for seed in range(2):
        if chat:
            answer = client(guided).chat.completions.create(model=guided.model, messages=HELLO, max_tokens=120, seed=seed, extra_body=body)
            text = answer.choices[0].message.content
        else:
            answer = client(guided).completions.create(model=guided.model, prompt="Say", max_tokens=120, seed=seed, extra_body=body)
            text = answer.choices[0].text
        finish = answer.choices[0].finish_reason
        assert (finish == "stop" or spelling == "json_object") and valid(text), (spelling, text)
        assert finish == "length" or spelling != "json_object" or isinstance(orjson.loads(text), dict)


BAD = {
    "a schema of an unknown type": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        "nonsense",
    ),
    "a schema that is not JSON": ({"guided_json": "{not json"}, "not valid JSON"),
    "json_schema without its schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema"),
    "an unknown response_format": ({"response_format": {"type": "yaml"}}, "response_format"),
    "an unclosed regex": ({"regex": "a(b"}, "parenthesis"),
    "an EBNF rule never defined": ({"guided_grammar": "root ::= item"}, "item"),
    "an empty choice": ({"guided_choice": []}, "non-empty"),
    "two constraints": ({"regex": "a", "guided_choice": ["b"]}, "only one"),
    "an unsupported structured_outputs key": ({"structured_outputs": {"structural_tag": "{}"}}, "exactly one"),
    "a named tool that is not given": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    "a tool without a name": ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0]"),
    "a named tool whose description is an object": (
        {
            "tools": [{"type": "function", "function": {"name": "f", "description": {}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools[0].function.description must be a string",
    ),
    "a tool schema of an unknown type": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"},
        "nonsense",
    ),
    "a forced tool beside a schema": (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    "template kwargs that set the template's own": ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    "a schema of more than 64 KB": (
        {"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}},
        "65536",
    ),
    "a schema nested past what can be sent on": ({"guided_json": NESTED}, "cannot be used"),
    "continuing a message while adding a generation prompt": ({"continue_final_message": True}, "add_generation_prompt"),
    "a schema whose $ref points to itself": ({"guided_json": CYCLE}, "admits no output"),
    "EBNF rules that refer only to each other": ({"guided_grammar": "root ::= a\na ::= b\nb ::= a"}, "admits no output"),
    "a regex of no character": ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "admits no output"),
    "a forced tool whose parameters point to themselves": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": CYCLE}}], "tool_choice": "required"},
        "admits no output",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_constraint_gets_a_400_that_says_why(guided, case):
    body, says = BAD[case]
    with pytest.raises(openai.BadRequestError) as refused:
        client(guided).chat.completions.create(model=guided.model, messages=HELLO, max_tokens=8, extra_body=body)
    assert says in refused.value.message, refused.value.message
    assert guided.get("/health")["status"] == "ok"


def _arguments_valid(call) -> None:
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(orjson.loads(call.function.arguments), schema)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_validate_whole_and_streamed(guided, tool_choice):
    for seed, parallel in ((1, False), (2, True)):
        ask = dict(
            model=guided.model,
            messages=HELLO,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=160,
            seed=seed,
            parallel_tool_calls=parallel,
        )
        whole = client(guided).chat.completions.create(**ask)
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason in ("tool_calls", "length") and message.tool_calls
        for call in message.tool_calls if whole.choices[0].finish_reason == "tool_calls" else message.tool_calls[:-1]:
            assert call.type == "function" and call.id.startswith("call_")
            assert isinstance(tool_choice, str) or call.function.name == "add"
            _arguments_valid(call)
        if not parallel:
            assert len(message.tool_calls) == 1 and whole.choices[0].finish_reason == "tool_calls"
            streamed, finish = [], None
            for chunk in client(guided).chat.completions.create(**ask, stream=True):
                streamed += chunk.choices[0].delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
            assert finish == "tool_calls" and {c.index for c in streamed} == {0} and streamed[0].id.startswith("call_")
            arguments = "".join(c.function.arguments or "" for c in streamed)
            assert (streamed[0].function.name, arguments) == (message.tool_calls[0].function.name, message.tool_calls[0].function.arguments)


COUNT = [
    {
        "type": "function",
        "function": {
            "name": "count",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    }
]


def test_tool_arguments_are_the_generated_text_and_stream_as_generated(guided, guided_model):
    """The arguments are the model's JSON as generated (blanks, integers and all), and stream in
    fragments after a first delta that names the call."""
    from transformers import AutoTokenizer

    ask = dict(model=guided.model, messages=HELLO, tools=COUNT, tool_choice={"type": "function", "function": {"name": "count"}})
    ask |= dict(max_tokens=60, seed=16, extra_body={"return_token_ids": True})
    whole = client(guided).chat.completions.create(**ask).choices[0]
    (call,) = whole.message.tool_calls
    assert (
        whole.finish_reason == "tool_calls"
        and call.function.arguments.strip() != orjson.dumps(orjson.loads(call.function.arguments)).decode()
    )
    assert call.function.arguments in AutoTokenizer.from_pretrained(guided_model).decode(whole.model_extra["token_ids"])
    assert all(type(value) is int for value in orjson.loads(call.function.arguments).values())
    streamed = [c for chunk in client(guided).chat.completions.create(**ask, stream=True) for c in chunk.choices[0].delta.tool_calls or []]
    assert (streamed[0].id[:5], streamed[0].function.name) == ("call_", "count") and all(c.id is None for c in streamed[1:])
    assert len(streamed) > 3 and "".join(c.function.arguments for c in streamed) == call.function.arguments


def test_tools_tool_results_and_template_options_reach_the_template(guided, guided_model):
    """The prompt the server encodes is the template's, for each option: counted in usage."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(guided_model)
    arguments = '{"city": "Oslo", "unit": "C"}'
    turn = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 and snowing"},
    ]
    rendered = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": orjson.loads(arguments)}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 and snowing"},
    ]
    final = [*HELLO, {"role": "assistant", "content": "Someone who"}]
    cases = [
        (dict(messages=turn, tools=TOOLS), dict(conversation=rendered, tools=TOOLS)),
        (
            dict(messages=HELLO, extra_body={"chat_template_kwargs": {"enable_thinking": False}}),
            dict(conversation=HELLO, enable_thinking=False),
        ),
        (
            dict(messages=final, extra_body={"continue_final_message": True, "add_generation_prompt": False}),
            dict(conversation=final, continue_final_message=True, add_generation_prompt=False),
        ),
    ]
    for ask, template in cases:
        expected = tokenizer.apply_chat_template(**{"add_generation_prompt": True, **template}, tokenize=False)
        assert "-3 and snowing" in expected or "tools" not in ask
        answer = client(guided).chat.completions.create(model=guided.model, max_tokens=2, **ask)
        assert answer.usage.prompt_tokens == len(tokenizer(expected, add_special_tokens=False).input_ids), template


def test_reasoning_is_set_apart_whole_and_streamed(guided):
    """A grammar makes the random model think first; the qwen3 parser splits it off, in both forms alike."""
    ask = dict(
        model=guided.model, messages=HELLO, max_tokens=60, seed=5, extra_body={"regex": r"<think>[a-z ]{1,20}</think>\n\n[a-z]{1,10}"}
    )
    message = client(guided).chat.completions.create(**ask).choices[0].message
    assert re.fullmatch(r"[a-z ]{1,20}", message.reasoning_content) and re.fullmatch(r"[a-z]{1,10}", message.content)
    reasoning = content = ""
    for chunk in client(guided).chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


def test_logit_bias_moves_greedy_draws_and_is_checked(guided):
    ask = dict(model=guided.model, prompt="Say", max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    plain = client(guided).completions.create(**ask).choices[0].model_extra["token_ids"]
    favoured = client(guided).completions.create(**ask, logit_bias={"1234": 100}).choices[0].model_extra["token_ids"]
    assert favoured == [1234] * 6
    banned = client(guided).completions.create(**ask, logit_bias={str(plain[0]): -100}).choices[0].model_extra["token_ids"]
    assert banned[0] != plain[0]
    for bad in ({"49152": 1}, {"12": 101}, {"x": 1}, {"12": "high"}, {"²": 1}, {"7": 1, "07": 2}, {"9" * 5000: 1}):
        with pytest.raises(openai.BadRequestError):
            client(guided).completions.create(**ask, logit_bias=bad)


CALL_TEXTS = {  # per parser: the output, the content left, each call's name and arguments
    "llama3_json": (
        '{"name": "Alice", "age": 3} then {"name": "add", "parameters": {"a": 322074169996479800000, "b": [1, {"c": "}"}]}}; '
        '{"name": "mul", "parameters": {}} end',
        '{"name": "Alice", "age": 3} then {"name": "mul", "parameters": {}} end',
        [("add", '{"a": 322074169996479800000, "b": [1, {"c": "}"}]}')],
    ),
    "hermes": (
        'Hi <tool_call>\n{"name": "add", "arguments": {"a": 1,\t"b": "x}\\"{"}}\n</tool_call>\n'
        '<tool_call>{"arguments": {"a": 2e3}, "name": "add"}</tool_call> <tool_call>{"name": "mul", "arguments": {}}</tool_call>',
        'Hi  <tool_call>{"name": "mul", "arguments": {}}</tool_call>',
        [("add", '{"a": 1,\t"b": "x}\\"{"}'), ("add", '{"a": 2e3}')],
    ),
}


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("parser", CALL_TEXTS)
def test_only_calls_of_the_requests_tools_leave_the_content(parser, size):
    """JSON that names no tool of the request, or has no arguments, is content, however the text is cut;
    a call's arguments are its text as generated (an integer past 64 bits stays an integer), streamed as
    fed once the call has named its tool; a call whose keys come the other way goes out whole."""
    from api.chat_output import ChatOutput

    text, content, expected = CALL_TEXTS[parser]
    out = ChatOutput(None, parser, {"add"}, constrained=False)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    parts = [out.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    assert "".join(p["content"] for p in parts) == content
    calls: dict[int, list[dict]] = {}
    for delta in (d for p in parts for d in p.get("tool_calls", [])):
        calls.setdefault(delta["index"], []).append(delta["function"])
    assert [(c[0]["name"], "".join(f["arguments"] for f in c)) for c in calls.values()] == expected
    assert (len(calls[0]) > 1) == (size < len(text))  # one delta only when the whole text came at once


async def test_priorities_order_a_saturated_queue(guided):
    """Two long requests hold both running slots; six short ones queue behind them with shuffled
    priorities, and run two at a time, lowest priority value first."""
    http = openai.AsyncOpenAI(base_url=f"{guided.base_url}/v1", api_key="none", max_retries=0)
    ask = dict(model=guided.model, prompt="Say")
    finished: list[int] = []

    async def short(priority: int) -> None:
        await http.completions.create(**ask, max_tokens=4, extra_body={"ignore_eos": True, "priority": priority})
        finished.append(priority)

    blockers = [asyncio.create_task(http.completions.create(**ask, max_tokens=400, extra_body={"ignore_eos": True})) for _ in range(2)]

    async def until(gauge: str, value: int) -> None:
        for _ in range(1000):
            if guided.get("/server_info")["scheduler"][gauge] >= value:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{gauge} never reached {value}")

    await until("running", 2)
    queued = [asyncio.create_task(short(priority)) for priority in (5, -3, 2, 9, 0, 1)]
    await until("waiting", 6)
    await asyncio.gather(*blockers, *queued)
    assert [sorted(finished[i : i + 2]) for i in (0, 2, 4)] == [[-3, 0], [1, 2], [5, 9]], finished
