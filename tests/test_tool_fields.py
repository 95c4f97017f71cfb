"""A request's tools are checked field by field before anything renders or compiles them: each field of the
wrong type gets a 400 that names it as OpenAI does (`param`), not an error from deeper down (a forced choice
whose tool xgrammar could not read had answered "tool 'f' is not found in the tools list")."""

from __future__ import annotations

import pytest

from api.errors import ApiError
from api.guides import tools_of

GOOD = {"name": "f", "description": "adds", "parameters": {"type": "object"}, "strict": True}
WRONG = {
    "a tool that is no object": ([1], "tools[0]"),
    "a tool of another type": ([{"type": "fn", "function": GOOD}], "tools[0].type"),
    "a function that is no object": ([{"type": "function", "function": "f"}], "tools[0].function"),
    "a name that is no string": ([{"type": "function", "function": {**GOOD, "name": 5}}], "tools[0].function.name"),
    "a description that is an object": (
        [{"type": "function", "function": {**GOOD, "description": {"text": "adds"}}}],
        "tools[0].function.description",
    ),
    "a description that is a list": (
        [{"type": "function", "function": {**GOOD, "description": ["adds"]}}],
        "tools[0].function.description",
    ),
    "parameters that are a list": ([{"type": "function", "function": {**GOOD, "parameters": []}}], "tools[0].function.parameters"),
    "parameters that are null": ([{"type": "function", "function": {**GOOD, "parameters": None}}], "tools[0].function.parameters"),
    "strict that is a string": ([{"type": "function", "function": {**GOOD, "strict": "yes"}}], "tools[0].function.strict"),
    "the second tool's description": (
        [{"type": "function", "function": GOOD}, {"type": "function", "function": {"name": "g", "description": 7}}],
        "tools[1].function.description",
    ),
}


@pytest.mark.parametrize("case", WRONG)
@pytest.mark.parametrize("choice", ["auto", {"type": "function", "function": {"name": "f"}}])
def test_a_tool_field_of_the_wrong_type_gets_a_400_that_names_it(case, choice):
    tools, param = WRONG[case]
    with pytest.raises(ApiError) as refused:
        tools_of({"tools": tools, "tool_choice": choice})
    assert refused.value.status == 400 and refused.value.param == param
    assert refused.value.message.startswith(param + " must be"), refused.value.message


def test_optional_fields_may_be_absent_or_null():
    for function in ({"name": "f"}, {"name": "f", "description": None, "strict": None}, GOOD):
        assert tools_of({"tools": [{"type": "function", "function": function}]}).tools[0]["function"] == function
