"""What ringllm repairs or refuses in xgrammar's grammars (runtime.structured.checks), read with
xgrammar's own matcher: JSON strings of every schema keyword hold no raw control character, quote or
backslash; a grammar that admits nothing is refused; and a grammar that allows no token while a
request runs fails that request instead of letting it draw free text."""

from __future__ import annotations

import orjson
import pytest

from runtime.structured.grammars import GuideError, build_grammar

# a string's schema per keyword, and a value it admits
KEYWORDS = {
    "none": ({"type": "string"}, "ab"),
    "minLength": ({"type": "string", "minLength": 1}, "ab"),
    "maxLength": ({"type": "string", "maxLength": 5}, "ab"),
    "minLength and maxLength": ({"type": "string", "minLength": 2, "maxLength": 8}, "ab"),
    "pattern": ({"type": "string", "pattern": "^a.{0,3}b$"}, "ab"),
    "pattern naming control characters": ({"type": "string", "pattern": "^[a\\x00-\\x1f]b$"}, "ab"),
    "pattern naming a quote or backslash": ({"type": "string", "pattern": '^[a"\\\\]b$'}, "ab"),
    "pattern of any character": ({"type": "string", "pattern": "^a[^]{0,3}$"}, "ab"),
    "format date": ({"type": "string", "format": "date"}, "2024-02-29"),
    "format email": ({"type": "string", "format": "email"}, "a@b.org"),
    "format json-pointer": ({"type": "string", "format": "json-pointer"}, "/a/b"),
    "format uri": ({"type": "string", "format": "uri"}, "http://a.b/c"),
    "enum": ({"enum": ["ab", "a\u001eb", 'a"b']}, "ab"),
    "const": ({"const": "ab"}, "ab"),
}
RAW = ["a\x1eb", "a\tb", "a\nb", "a\x00b", 'a"b', "a\\qb"]  # spelled raw between the quotes: never JSON


def _admits(kind: str, spec: str, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.deserialize_json(build_grammar(kind, spec)), text)


@pytest.mark.parametrize("keyword", KEYWORDS)
def test_strings_of_every_keyword_hold_no_raw_control_character_quote_or_backslash(keyword):
    string, value = KEYWORDS[keyword]
    schema = orjson.dumps({"type": "object", "properties": {"name": string}, "required": ["name"]}).decode()
    assert _admits("json_schema", schema, orjson.dumps({"name": value}).decode())
    for raw in RAW:
        assert not _admits("json_schema", schema, '{"name": "' + raw + '"}'), raw


def test_an_email_holds_no_invalid_escape():
    schema = orjson.dumps({"type": "string", "format": "email"}).decode()
    assert _admits("json_schema", schema, '"a.b@c.org"')
    assert not _admits("json_schema", schema, '"\\"\\a\\"@c.org"')  # xgrammar's quoted local part: `\a` is no JSON escape


def test_keys_and_tool_arguments_hold_no_raw_control_character():
    keys = {"type": "object", "propertyNames": {"maxLength": 4}, "additionalProperties": {"type": "integer"}}
    assert _admits("json_schema", orjson.dumps(keys).decode(), '{"ab": 1}')
    assert not _admits("json_schema", orjson.dumps(keys).decode(), '{"a\x1eb": 1}')
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 9}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    spec = {"parser": "hermes", "tools": tools, "tool_choice": "required", "parallel_tool_calls": False, "reasoning": False}
    call = '<tool_call>\n{"name": "f", "arguments": {"city": "%s"}}\n</tool_call>'
    assert _admits("tools", orjson.dumps(spec).decode(), call % "Oslo")
    assert not _admits("tools", orjson.dumps(spec).decode(), call % "Os\x1elo")


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
NOTHING = {
    "a schema whose $ref points to itself": ("json_schema", CYCLE),
    "an optional property whose schema points to itself": (
        "json_schema",
        {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": CYCLE["$defs"]},
    ),
    "a pattern of an empty character class": ("json_schema", {"type": "string", "pattern": "^[^\\x00-\\U0010FFFF]$"}),
    "a pattern that needs a raw control character": ("json_schema", {"type": "string", "pattern": "^\\t$"}),
    "a pattern that needs a raw quote": ("json_schema", {"type": "string", "pattern": '^a"b$'}),
    "EBNF rules that refer only to each other": ("grammar", "root ::= a\na ::= b\nb ::= a"),
    "an EBNF rule that never ends": ("grammar", 'root ::= "x" root'),
    "a regex of an empty character class": ("regex", "[^\\x00-\\U0010FFFF]"),
    "a forced tool whose parameters point to themselves": (
        "tools",
        {
            "parser": "hermes",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": CYCLE}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "parallel_tool_calls": True,
            "reasoning": True,
        },
    ),
}


@pytest.mark.parametrize("case", NOTHING)
def test_a_grammar_that_admits_nothing_is_refused(case):
    kind, spec = NOTHING[case]
    with pytest.raises(GuideError, match="admits no output"):
        build_grammar(kind, spec if isinstance(spec, str) else orjson.dumps(spec).decode())


SOMETHING = {
    "a list that may end": (
        "json_schema",
        {
            "$defs": {"n": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}},
            "$ref": "#/$defs/n",
        },
    ),
    "a tree": ("json_schema", {"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "$ref": "#/$defs/t"}),
    "a recursive grammar with a way out": ("grammar", 'root ::= "(" root ")" | "x"'),
    "a dead rule nothing refers to": ("grammar", 'root ::= "x"\nunused ::= unused'),
    "a tool call in free text": (
        "tools",
        {
            "parser": "llama3_json",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "reasoning": True,
        },
    ),
}


@pytest.mark.parametrize("case", SOMETHING)
def test_a_grammar_that_admits_something_is_kept(case):
    kind, spec = SOMETHING[case]
    build_grammar(kind, spec if isinstance(spec, str) else orjson.dumps(spec).decode())


def test_a_grammar_that_allows_no_token_fails_its_slot_and_its_request(tiny_smol, monkeypatch):
    """A dead end the build cannot see (here a grammar that skipped the build's check): the slot's row
    is left unmasked, its error goes with the step's result, and the scheduler ends the request with it."""
    import numpy as np
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    import runtime.structured.masks as masks_module
    from runtime.config import EngineConfig
    from runtime.sampling_params import SamplingParams
    from runtime.scheduler.scheduler import Scheduler
    from runtime.step import Sampled, results_from_wire, results_to_wire

    dead = xgr.Grammar.from_ebnf('root ::= "a" b\nb ::= c\nc ::= b').serialize_json()
    monkeypatch.setattr(masks_module, "build_grammar", lambda kind, spec: dead if spec == "dead" else build_grammar(kind, spec))
    tokenizer = AutoTokenizer.from_pretrained(tiny_smol)
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b"))
    vocab = 49152
    masks = masks_module.GrammarMasks(tiny_smol, vocab, (tokenizer.eos_token_id,))
    masks.open(0, SamplingParams(guide=("grammar", "dead")))
    masks.open(1, SamplingParams(guide=("regex", "a")))
    logits = torch.zeros(3, vocab)
    masks.apply(logits, [0, 1, 2], [[], [], []])
    assert masks.take_errors() == {} and logits[0, a] == 0 and logits[0, b] == -torch.inf and logits[2].eq(0).all()
    logits = torch.zeros(3, vocab)
    masks.apply(logits, [0, 1, 2], [[a], [b], []])  # slot 0 is stuck after "a"; slot 1's grammar refuses "b"
    errors = masks.take_errors()
    assert sorted(errors) == [0, 1] and "allows no token" in errors[0] and logits.eq(0).all()
    assert not masks.constrains(np.array([0, 1]))

    scheduler = Scheduler(EngineConfig(page_size=4, max_prefill_tokens=64), num_pages=16, eos_token_ids=(0,), max_position=256)
    request = scheduler.add(7, [11, 12, 13], SamplingParams(max_tokens=4, temperature=0))
    plan = scheduler.schedule()
    meta, arrays = results_to_wire(plan.step, [Sampled(request.slot, 99, None, error=errors[0])])
    (sent,) = results_from_wire(orjson.loads(orjson.dumps(meta)), [np.array(a) for a in arrays])
    assert scheduler.update(plan.step, [sent]) == [request]
    assert (request.finish_reason, request.error, request.output_ids, request.slot) == ("abort", errors[0], [], None)
    assert not scheduler.running and not scheduler.has_work()
