"""GPT-OSS's harmony format (--reasoning-parser / --tool-call-parser gpt-oss, or vLLM's openai_gptoss / openai):
its parser over many ways of cutting the same output into deltas, the flags and the request fields, and one real
server under the real openai client, whose tiny random model (harmony's markers special tokens of its vocabulary)
a regex or a forced tool choice holds to harmony: reasoning, preamble and call come apart, streamed and whole, no
marker reaches the client, and the reasoning effort and earlier reasoning reach the chat template."""

from __future__ import annotations

import random
import re
import shutil
from collections.abc import Iterator

import openai
import orjson
import pytest

from actors.cli import build_parser
from actors.pipeline import ServeConfig
from api.errors import ApiError
from api.harmony import MARKERS, HarmonyParser
from api.protocol import Limits, parse
from tests.conftest import Server, launch, wait_for

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
}
CALL = '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}'
# per output: the request's tools, then the reasoning, content and calls (name, arguments) it reads as
CASES = {
    "reasoning, then the answer": (
        "<|channel|>analysis<|message|>Two and two: 4, so a<b.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
        {"add"},
        "Two and two: 4, so a<b.",
        "It is 4.",
        [],
    ),
    "reasoning, a preamble and a call": (
        "<|channel|>analysis<|message|>Use add.<|end|><|start|>assistant<|channel|>commentary<|message|>Adding.<|end|>"
        f"<|start|>assistant{CALL}<|call|>",
        {"add"},
        "Use add.",
        "Adding.",
        [("add", '{"a": 1}')],
    ),
    "the recipient before the channel, no <|constrain|>, the stop token's text dropped": (
        '<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2}',
        {"add"},
        "x",
        "",
        [("add", '{"a": 2}')],
    ),
    "two calls": (
        f"{CALL}<|call|><|start|>assistant{CALL.replace('1', '3')}<|call|>",
        {"add"},
        "",
        "",
        [("add", '{"a": 1}'), ("add", '{"a": 3}')],
    ),
    "a call of a tool the request lacks is content": (CALL.replace("add", "mul") + "<|call|>", {"add"}, "", '{"a": 1}', []),
    "no tools: a call is content": (CALL, set(), "", '{"a": 1}', []),
    "text that is not harmony (a response_format's JSON) is the answer": ('{"a": "x"}', set(), "", '{"a": "x"}', []),
    "a header cut short says nothing": ("<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>fin", set(), "hm", "", []),
    "a header broken by a newline: its markers dropped, the rest content": (
        "<|channel|>final\nhi<|message|>there",
        set(),
        "",
        "\nhithere",
        [],
    ),
    "a marker's beginning at the end is text": ("<|channel|>final<|message|>a <|", set(), "", "a <|", []),
    "another channel is content": ("<|channel|>other<|message|>z", set(), "", "z", []),
}


def read(text: str, names: set[str], cuts: list[int]) -> tuple[str, str, list[tuple[str, str]], list[dict]]:
    """The parser's reasoning, content and calls for `text` fed in the pieces `cuts` make, and every call delta."""
    parser = HarmonyParser(names)
    bounds = [0, *cuts, len(text)]
    reasoning = content = ""
    deltas: list[dict] = []
    for i in range(len(bounds) - 1):
        parts = parser.feed(text[bounds[i] : bounds[i + 1]], final=i == len(bounds) - 2)
        reasoning, content = reasoning + parts.get("reasoning_content", ""), content + parts["content"]
        deltas += parts.get("tool_calls", [])
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        calls.setdefault(delta["index"], [delta["function"].get("name", ""), ""])[1] += delta["function"]["arguments"]
    assert parser.calls == len(calls)
    return reasoning, content, [(name, arguments) for name, arguments in calls.values()], deltas


@pytest.mark.parametrize("case", CASES)
def test_every_cut_of_the_output_reads_the_same(case):
    """Whole, cut at any one point, a character a delta, and cut at random points, the parts are the same, exactly;
    a call's first delta alone names it (id, type, name), and no marker leaves the parser."""
    text, names, *expected = CASES[case]
    shuffled, points = random.Random(case), range(1, len(text))
    cuts = [[], *([i] for i in points), list(points)]
    cuts += [sorted(shuffled.sample(points, shuffled.randint(1, len(points)))) for _ in range(100)]
    for cut in cuts:
        reasoning, content, calls, deltas = read(text, names, cut)
        assert [reasoning, content, calls] == expected, cut
        assert not any(marker in part for marker in MARKERS for part in (reasoning, content, *(a for _, a in calls)))
        firsts = [d for d in deltas if "id" in d]
        assert len(firsts) == len(calls) and all(d["id"].startswith("call_") and d["type"] == "function" for d in firsts)


def test_text_streams_as_it_comes_and_only_a_markers_beginning_is_held():
    """A header waits until it is whole; a body's text goes out as it comes, but for what may begin a marker."""
    parser = HarmonyParser({"add"})
    assert parser.feed("<|channel|>analysis<|mess", final=False) == {"content": ""}
    assert parser.feed("age|>thinking <", final=False) == {"content": "", "reasoning_content": "thinking "}
    assert parser.feed("|end|><|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json", final=False) == {"content": ""}
    (first,) = parser.feed('<|message|>{"a"', final=False)["tool_calls"]
    assert (first["index"], first["function"]) == (0, {"name": "add", "arguments": '{"a"'})
    assert parser.feed(": 1}", final=True) == {"content": "", "tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}


def test_each_parser_takes_sglangs_and_vllms_name_and_harmony_names_both(tmp_path):
    for flags in (
        ["--reasoning-parser", "openai_gptoss"],
        ["--tool-call-parser", "openai"],
        ["--reasoning-parser", "gpt-oss", "--tool-call-parser", "openai"],
    ):
        config = ServeConfig.from_cli_args(build_parser().parse_args(["serve", "--model", str(tmp_path), *flags]))
        assert (config.reasoning_parser, config.tool_call_parser) == ("gpt-oss", "gpt-oss")
        assert ServeConfig.from_cli_args(build_parser().parse_args(["serve", *config.to_cli_args()])) == config
    with pytest.raises(ValueError, match="cannot be mixed"):
        ServeConfig(model_dir=str(tmp_path), served_model_name="m", reasoning_parser="qwen3", tool_call_parser="openai")


def test_reasoning_effort_and_the_historys_reasoning_reach_the_template():
    limits = Limits(4096, 50_000, 0, tool_call_parser="gpt-oss", reasoning_parser="gpt-oss")
    turns = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "sum"}]
    c = parse({"messages": turns, "reasoning_effort": "high"}, True, "m", limits)
    assert c.template is not None and c.template["kwargs"] == {"reasoning_effort": "high"}
    assert c.prompts[0]["messages"][1] == {"role": "assistant", "content": "4", "reasoning_content": "sum", "thinking": "sum"}
    given = {"messages": turns, "reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}
    assert parse(given, True, "m", limits).template["kwargs"] == {"reasoning_effort": "low"}  # pyright: ignore[reportOptionalSubscript]
    for body, chat, param in (
        ({"messages": turns, "reasoning_effort": "max"}, True, "reasoning_effort"),
        ({"prompt": "x", "reasoning_effort": "low"}, False, "reasoning_effort"),
        ({"messages": [{**turns[1], "reasoning_content": 5}]}, True, "messages[0].reasoning_content"),
    ):
        with pytest.raises(ApiError) as refused:
            parse(body, chat, "m", limits)
        assert refused.value.param == param


# harmony's shape, as GPT-OSS's template renders it: the reasoning effort in the system message, an assistant's
# earlier reasoning (`thinking`) before its answer, and the generation prompt that the output's header continues
TEMPLATE = """<|start|>system<|message|>Reasoning: {{ reasoning_effort | default("medium") }}<|end|>
{%- for m in messages %}
{%- if m.role == "assistant" %}{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif -%}
<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}
{%- endfor %}<|start|>assistant"""
HELLO = [{"role": "user", "content": "Add one."}]
# reasoning, a preamble, then a call: what GPT-OSS writes
REGEX = (
    r"<\|channel\|>analysis<\|message\|>[a-z ]{1,12}<\|end\|><\|start\|>assistant<\|channel\|>commentary<\|message\|>[a-z]{1,6}"
    r'<\|end\|><\|start\|>assistant<\|channel\|>commentary to=functions\.add <\|constrain\|>json<\|message\|>\{"a": [1-9]\}'
)
VOCAB = 49152  # SmolLM2's: the markers come after it, in MARKERS' order
TINY = {"vocab_size": VOCAB + len(MARKERS), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512}
# a grammar lets each marker be written as its special token or as plain text; the random model takes the token
MARKERS_FIRST = {str(VOCAB + i): 100 for i in range(len(MARKERS))}


@pytest.fixture(scope="module")
def harmony(smollm2, tmp_path_factory) -> Iterator[Server]:
    """A tiny Llama of random weights (--dummy-weights: no checkpoint to write) over SmolLM2's vocabulary, with
    harmony's markers added as special tokens, <|call|> and <|return|> its stop tokens (as GPT-OSS's generation
    config has them) and a harmony chat template, served with vLLM's names for the parsers. The first test to ask
    for it waits only for its shared-memory segments (the supervisor starts its forkserver after them), so that the
    leak guard counts them as the module's; `client` waits for it to be ready."""
    from tokenizers import AddedToken, Tokenizer

    model = tmp_path_factory.mktemp("harmony")
    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(marker, special=True, normalized=False) for marker in MARKERS])
    tokenizer.save(str(model / "tokenizer.json"))
    shutil.copy(smollm2 / "tokenizer_config.json", model)
    config = orjson.loads((smollm2 / "config.json").read_bytes()) | TINY
    config["eos_token_id"] = [VOCAB + MARKERS.index("<|call|>"), VOCAB + MARKERS.index("<|return|>")]
    (model / "config.json").write_bytes(orjson.dumps(config))
    (model / "chat_template.jinja").write_text(TEMPLATE)
    flags = ("--dummy-weights", "--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai")
    server = launch(model, model / "serve.log", *flags, "--no-shared-kv-pool", ready=False)  # a kept pool's segment comes later
    wait_for(lambda: server.proc.poll() is not None or b'"forkserver_started"' in server.log.read_bytes(), 60, "the server's segments")
    yield server
    server.stop()


def client(server: Server) -> openai.OpenAI:
    """The server's client, once it is ready."""
    wait_for(lambda: server.proc.poll() is not None or b'"topology_ready"' in server.log.read_bytes(), 180, "the server to be ready")
    assert server.proc.poll() is None, server.log.read_text()[-5000:]
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


@pytest.mark.slow
def test_reasoning_a_preamble_and_a_call_come_apart_whole_and_streamed_without_markers(harmony):
    """The model writes the markers as special tokens; the detokenizer keeps them for the parser, which keeps them
    from the client."""
    from tokenizers import Tokenizer

    ask = dict(model=harmony.model, messages=HELLO, tools=[ADD], max_tokens=60, seed=3, logit_bias=MARKERS_FIRST)
    ask |= dict(extra_body={"regex": REGEX, "return_token_ids": True})
    whole = client(harmony).chat.completions.create(**ask).choices[0]
    message, (call,) = whole.message, whole.message.tool_calls
    assert whole.finish_reason == "tool_calls" and re.fullmatch("[a-z ]{1,12}", message.reasoning_content)
    assert re.fullmatch("[a-z]{1,6}", message.content) and re.fullmatch(r'\{"a": [1-9]\}', call.function.arguments)
    assert (call.id[:5], call.function.name) == ("call_", "add")
    ids = whole.model_extra["token_ids"]
    assert {VOCAB + MARKERS.index(marker) for marker in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")} <= set(ids)
    generated = Tokenizer.from_file(str(harmony.log.parent / "tokenizer.json")).decode(ids, skip_special_tokens=False)
    assert generated.startswith(f"<|channel|>analysis<|message|>{message.reasoning_content}<|end|>")
    reasoning = content = arguments = ""
    for chunk in client(harmony).chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        reasoning, content = reasoning + (delta.model_extra.get("reasoning_content") or ""), content + (delta.content or "")
        arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or [])
        assert "<|" not in orjson.dumps(chunk.model_dump()).decode()
    assert (reasoning, content, arguments) == (message.reasoning_content, message.content, call.function.arguments)


@pytest.mark.slow
def test_a_forced_call_is_written_in_harmony(harmony):
    """The grammar of a named tool choice holds the model to the call (after its reasoning, if it reasons), and
    <|call|>, a stop token, ends it."""
    ask = dict(model=harmony.model, messages=HELLO, tools=[ADD], tool_choice={"type": "function", "function": {"name": "add"}})
    answer = client(harmony).chat.completions.create(**ask, max_tokens=60, seed=1, logit_bias=MARKERS_FIRST).choices[0]
    (call,) = answer.message.tool_calls
    assert answer.finish_reason == "tool_calls" and call.function.name == "add" and 1 <= orjson.loads(call.function.arguments)["a"] <= 9


@pytest.mark.slow
def test_the_reasoning_effort_and_earlier_reasoning_reach_the_template(harmony):
    """The prompt as the server encoded it (its tokens' text, from prompt_logprobs) is the template's, with the effort
    and the assistant's reasoning as `thinking`."""
    turns = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "two and two"}, *HELLO]
    answer = client(harmony).chat.completions.create(
        model=harmony.model, messages=turns, reasoning_effort="high", max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    prompt = "<|start|>" + "".join(next(iter(p.values()))["decoded_token"] for p in answer.model_extra["prompt_logprobs"][1:])
    assert prompt == (
        "<|start|>system<|message|>Reasoning: high<|end|><|start|>user<|message|>2+2?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>two and two<|end|><|start|>assistant<|channel|>final<|message|>4<|end|>"
        "<|start|>user<|message|>Add one.<|end|><|start|>assistant"
    )
