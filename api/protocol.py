"""The OpenAI protocol: request validation into one internal form, and response shapes.

Every validation failure is an ApiError, which the app turns into OpenAI's error body with a 4xx
status; nothing a client sends can reach the pipeline malformed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from api.chat_output import DEFAULT_TOOL_CALL_PARSER
from api.errors import ApiError
from api.guides import Guide, Tools, guide_of, tool_guide, tools_of
from runtime.sampling_params import InvalidParams, SamplingParams
from runtime.text.prompt_length import text_bytes
from transport import env

MAX_N = 64
MAX_STOPS = 16
MAX_STOP_CHARS = 256  # of one stop string: the detokenizer holds back up to this much text
MAX_STOP_TOKEN_IDS = 256
ROLES = {"system", "user", "assistant", "developer", "tool"}
# fields that change the output, refused with a 400 unless left at their no-op value: never accepted and ignored
UNSUPPORTED = {"best_of": 1, "suffix": None}
# prompt_logprobs entries (prompt tokens x (N + 2)) one request may ask for: the frames that carry them stay well inside a ring
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 15
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_WARM_PREFIXES = 64  # in one POST /warm_prefixes
# sampling fields a request sets as they are, with the JSON types each takes (SamplingParams checks their ranges)
SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "min_p": (int, float),
    "ignore_eos": (bool,),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "repetition_penalty": (int, float),
    "priority": (int,),
    "cache_salt": (str,),
}
# what the chat template takes, refused on /v1/completions rather than ignored
CHAT_ONLY = ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "reasoning_effort")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's, for chat completions
# chat_template_kwargs may not override what the server passes the template itself
TEMPLATE_OWN = {"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "continue_final_message", "chat_template"}


@dataclass(frozen=True)
class Limits:
    """What the served model allows, checked here so that no frame's size depends on a request
    beyond these bounds."""

    max_model_len: int
    vocab_size: int
    max_token_bytes: int  # the longest token's UTF-8 bytes (0: not known yet)
    priorities: bool = False  # the priority schedule policy: requests may carry a 'priority'
    tool_call_parser: str = DEFAULT_TOOL_CALL_PARSER  # how tool calls are written (api.chat_output), and forced ones held to it
    reasoning_parser: str | None = None  # how reasoning is set apart from the answer (api.chat_output)
    adapters: tuple[tuple[str, str], ...] = ()  # (name, path) of each LoRA adapter served: a request names one as its model
    sampling_defaults: tuple[tuple[str, Any], ...] = ()  # --override-generation-config: for the fields a request leaves out

    @property
    def max_prompt_bytes(self) -> int | None:
        """A prompt of more bytes has more tokens than the context holds."""
        return self.max_model_len * self.max_token_bytes or None


def context_overflow(limit: int, prompt_tokens: int, max_tokens: int | None) -> str | None:
    """vLLM's and OpenAI's words, which clients match on, for a prompt and max_tokens that outgrow the
    context; None when they fit. Without max_tokens (the rest of the context) the prompt must leave one."""
    if max_tokens is None:
        return prompt_overflow(limit, f"{prompt_tokens} tokens in the messages") if prompt_tokens >= limit else None
    if prompt_tokens + max_tokens <= limit:
        return None
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested {prompt_tokens + max_tokens} tokens "
        f"({prompt_tokens} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion."
    )


def prompt_overflow(limit: int, requested: str) -> str:
    """The same words for a prompt that alone outgrows the context, `requested` saying by how much as far
    as it was counted (a prompt refused before it is encoded whole has no exact count)."""
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested {requested}. "
        "Please reduce the length of the messages."
    )


@dataclass
class Completion:
    """One validated request: its prompts, and the sampling that applies to each of n choices."""

    chat: bool
    model: str
    prompts: list[dict]  # each {"messages": ...} | {"prompt": str} | {"ids": [...]}
    params: SamplingParams  # each choice's, but for its seed (api.app offsets it per choice)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk (with include_usage)
    stop: list[str] = field(default_factory=list)
    echo: bool = False  # completions: the prompt's text (and with logprobs, its tokens' log-probabilities) comes first
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-probability and the top N there
    echo_token_ids: bool = False
    skip_special_tokens: bool = True
    guide: Guide | None = None  # what the output is held to (api.guides)
    tools: Tools | None = None
    template: dict[str, Any] | None = None  # the chat template's options: tools, kwargs, add_generation_prompt, continue_final_message
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _get(body: dict, name: str, kinds: tuple[type, ...], default: Any = None, check=None, why: str = "") -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if int in kinds and float not in kinds and isinstance(value, float) and abs(value) >= 2**63:
        # orjson reads an integer literal past 64 bits as a float: say so, not that an integer was expected
        raise ApiError(f"'{name}' must be an integer of at most 64 bits", param=name)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__.replace("str", "string").replace("int", "integer").replace("float", "number") for k in kinds)
        raise ApiError(f"'{name}' must be {names}", param=name)
    if check is not None and not check(value):
        raise ApiError(f"'{name}' {why}", param=name)
    return value


def _is_id_list(value: Any, vocab_size: int) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value)


def _is_token_list(value: Any, limits: Limits) -> bool:
    if isinstance(value, list) and len(value) >= limits.max_model_len and isinstance(value[0], int):  # before reading every id
        raise ApiError(prompt_overflow(limits.max_model_len, f"{len(value)} tokens in the messages"), param="prompt")
    return bool(value) and _is_id_list(value, limits.vocab_size)


def _check_prompt_size(prompt: dict, max_tokens: int | None, limits: Limits) -> None:
    """Refuse a prompt that cannot fit the context before it costs any encoding."""
    if "ids" in prompt:
        if message := context_overflow(limits.max_model_len, len(prompt["ids"]), max_tokens):
            raise ApiError(message, param="max_tokens")
        return
    limit = limits.max_model_len
    if "messages" in prompt and len(prompt["messages"]) >= limit:  # the template gives each a token at least
        raise ApiError(prompt_overflow(limit, f"more than {limit} tokens in {len(prompt['messages'])} messages"), param="messages")
    if (bound := limits.max_prompt_bytes) is None:
        return
    texts = [m["content"] for m in prompt["messages"] if m["role"] != "assistant"] if "messages" in prompt else [prompt["prompt"]]
    if (size := sum(map(text_bytes, texts))) > bound:
        requested = f"more than {limit} tokens in the messages ({size} bytes, and no token is longer than {limits.max_token_bytes})"
        raise ApiError(prompt_overflow(limit, requested), param="messages" if "messages" in prompt else "prompt")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or message["role"] not in ROLES:
            raise ApiError(f"messages[{i}] needs a 'role' among {sorted(ROLES)}", param=f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"messages[{i}].content parts must be {{'type': 'text', 'text': ...}}", param=f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and message["role"] == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}].content")
        out.append({"role": message["role"], "content": content, **_reasoning_fields(i, message), **_tool_fields(i, message)})
    return out


def _reasoning_fields(i: int, message: dict) -> dict:
    """An assistant's reasoning_content (vLLM's and SGLang's field), under the names templates read it by: Qwen3's
    reasoning_content, GPT-OSS's thinking."""
    reasoning = message.get("reasoning_content") if message["role"] == "assistant" else None
    if reasoning is None:
        return {}
    if not isinstance(reasoning, str):
        raise ApiError(f"messages[{i}].reasoning_content must be a string", param=f"messages[{i}].reasoning_content")
    return {"reasoning_content": reasoning, "thinking": reasoning}


def _tool_fields(i: int, message: dict) -> dict:
    """An assistant's tool calls (arguments as objects, which templates expect) and a tool result's call id."""
    if message["role"] == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str | None):
            raise ApiError(f"messages[{i}].tool_call_id must be a string", param=f"messages[{i}].tool_call_id")
        return {"tool_call_id": call_id} if call_id is not None else {}
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not calls:
        return {}
    out = []
    for call in calls if isinstance(calls, list) else [None]:
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise ApiError(
                f"messages[{i}].tool_calls must be a list of {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                param=f"messages[{i}].tool_calls",
            )
        try:
            arguments = orjson.loads(function["arguments"])
        except orjson.JSONDecodeError:
            arguments = function["arguments"]
        out.append({"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return {"tool_calls": out}


def _template(body: dict, messages: list[dict], tools: Tools | None) -> dict[str, Any]:
    kwargs = _get(body, "chat_template_kwargs", (dict,), default={})
    if own := sorted(TEMPLATE_OWN & kwargs.keys()):
        raise ApiError(f"'chat_template_kwargs' may not set {', '.join(own)}", param="chat_template_kwargs")
    effort = _get(
        body, "reasoning_effort", (str,), check=REASONING_EFFORTS.__contains__, why=f"must be one of {', '.join(REASONING_EFFORTS)}"
    )
    if effort is not None:  # a template variable (GPT-OSS's reads it); chat_template_kwargs, which speak to the template, win
        kwargs = {"reasoning_effort": effort, **kwargs}
    generation_prompt = _get(body, "add_generation_prompt", (bool,), default=True)
    continue_final = _get(body, "continue_final_message", (bool,), default=False)
    if continue_final and (generation_prompt or messages[-1]["role"] != "assistant"):
        raise ApiError(
            "'continue_final_message' continues a final assistant message, and needs 'add_generation_prompt': false",
            param="continue_final_message",
        )
    return {
        "tools": tools.tools if tools else None,
        "kwargs": kwargs,
        "add_generation_prompt": generation_prompt,
        "continue_final_message": continue_final,
    }


def _prompts(body: dict, limits: Limits) -> list[dict]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if _is_token_list(prompt, limits):
        return [{"ids": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [{"prompt": p} for p in prompt]
    if isinstance(prompt, list) and prompt and all(_is_token_list(p, limits) for p in prompt):
        return [{"ids": p} for p in prompt]
    raise ApiError(
        f"'prompt' must be a string, a list of strings, or (lists of) token ids below the vocabulary's {limits.vocab_size}", param="prompt"
    )


def parse_prefixes(body: Any, limits: Limits) -> list[dict]:
    """POST /warm_prefixes: {"prefixes": [text or token ids, ...]}, each a prompt of its own."""
    prefixes = body.get("prefixes") if isinstance(body, dict) else None
    if not isinstance(prefixes, list) or not 0 < len(prefixes) <= MAX_WARM_PREFIXES:
        raise ApiError(f"the body must be {{'prefixes': [text or token ids, ...]}} with 1 to {MAX_WARM_PREFIXES} of them", param="prefixes")
    out = []
    for prefix in prefixes:
        if not prefix or not (isinstance(prefix, str) or _is_id_list(prefix, limits.vocab_size)):
            raise ApiError("each prefix must be a non-empty string or list of token ids in the vocabulary", param="prefixes")
        prompt = {"prompt": prefix} if isinstance(prefix, str) else {"ids": prefix}
        _check_prompt_size(prompt, 1, limits)
        out.append(prompt)
    return out


def model_not_found(message: str, param: str) -> ApiError:
    """OpenAI's 404 for a model (or LoRA adapter) this server does not serve."""
    return ApiError(message, 404, param=param, code="model_not_found", kind="NotFoundError")


def parse(body: Any, chat: bool, served_model: str, limits: Limits) -> Completion:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    model = _get(body, "model", (str,), default=served_model)  # omitted: the served model, as vLLM does
    adapters = [name for name, _ in limits.adapters]
    lora = _get(body, "lora_path", (str,))  # SGLang's field: an adapter by name, whatever the model says
    if model in adapters:  # vLLM's way: the adapter's name as the model
        lora = lora or model
    elif model != served_model:
        served = ", ".join(f"'{name}'" for name in (served_model, *adapters))
        raise model_not_found(f"the model '{model}' does not exist; this server serves {served}", "model")
    if lora is not None and lora not in adapters:
        raise model_not_found(f"no LoRA adapter named '{lora}' is loaded; loaded: {adapters}", "lora_path")
    for name, default in UNSUPPORTED.items():
        if body.get(name, default) not in (default, None):
            raise ApiError(f"'{name}' is not supported by this server", param=name)
    if not chat and (given := [name for name in CHAT_ONLY if body.get(name) is not None]):
        raise ApiError(f"'{given[0]}' is for chat completions (/v1/chat/completions)", param=given[0])
    if chat and body.get("echo") not in (None, False):
        raise ApiError("'echo' is for completions (/v1/completions)", param="echo")
    guide, tools = guide_of(body), tools_of(body)  # completions have no tools: refused above
    if tools is not None and tools.forced:
        if guide is not None:
            raise ApiError(
                "a required or named 'tool_choice' already constrains the output; drop the other constraint", param="tool_choice"
            )
        guide = tool_guide(tools, limits.tool_call_parser, limits.reasoning_parser is not None)
    prompts = [{"messages": _messages(body)}] if chat else _prompts(body, limits)
    echo = _get(body, "echo", (bool,), False)
    prompt_logprobs = _get(body, "prompt_logprobs", (int,))
    params = replace(_sampling(body, chat, limits, echo, prompt_logprobs), lora=lora)
    stop = _get(body, "stop", (str, list), default=[])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOPS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise ApiError(
            f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters", param="stop"
        )
    for prompt in prompts:
        _check_prompt_size(prompt, params.max_tokens, limits)
    stream = _get(body, "stream", (bool,), default=False)
    options = _get(body, "stream_options", (dict,))
    if options is not None and not stream:
        raise ApiError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include_usage = _get(options or {}, "include_usage", (bool,), default=False)
    continuous_usage = _get(options or {}, "continuous_usage_stats", (bool,), default=False)
    if params.priority and not limits.priorities:
        raise ApiError("'priority' needs a server started with --schedule-policy priority", param="priority")
    return Completion(
        chat=chat,
        model=model,
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        stop=stop,
        n=_get(body, "n", (int,), 1, lambda v: 1 <= v <= MAX_N, f"must be between 1 and {MAX_N}"),
        echo=echo,
        prompt_logprobs=prompt_logprobs,
        echo_token_ids=_get(body, "return_token_ids", (bool,), False),
        skip_special_tokens=_get(body, "skip_special_tokens", (bool,), True),
        guide=guide,
        tools=tools,
        template=_template(body, prompts[0]["messages"], tools) if chat else None,
    )


def _sampling(body: dict, chat: bool, limits: Limits, echo: bool, prompt_logprobs: int | None) -> SamplingParams:
    """The request's sampling: the fields' JSON types are checked here, their ranges by SamplingParams,
    whose refusal becomes a 400 naming the field as the request sent it."""
    given: dict[str, Any] = {name: value for name, kinds in SAMPLING_FIELDS.items() if (value := _get(body, name, kinds)) is not None}
    # frames carry a seed as a 64-bit integer (offline, any integer seeds)
    given["seed"] = _get(body, "seed", (int,), check=lambda v: -(2**63) <= v < 2**63, why="must fit in 64 bits")
    if (crash_at := _get(body, "crash_at", (int,))) is not None:
        if not env.fault_injection():
            raise ApiError("'crash_at' is a fault-injection hook for tests: serve with RINGLLM_FAULT_INJECTION=1", param="crash_at")
        given["crash_at"] = crash_at
    sent_as = {"logprobs": "top_logprobs"} if chat else {}
    max_tokens = _get(body, "max_tokens", (int,))
    if chat and (newer := _get(body, "max_completion_tokens", (int,))) is not None:
        max_tokens, sent_as["max_tokens"] = newer, "max_completion_tokens"  # OpenAI's newer name wins
    if chat or max_tokens is not None:  # left out: the rest of the context for chat, SamplingParams' default for completions
        given["max_tokens"] = max_tokens
    # the server's defaults, where the request gives none; but max_tokens, as vLLM's, caps every request, and one that
    # gives none draws the rest of the context within it (the scheduler fills that in)
    for name, value in limits.sampling_defaults:
        if name == "max_tokens":
            given[name] = None if given.get(name) is None else min(given[name], value)
        elif given.get(name) is None:
            given[name] = value
    stop_ids = _get(body, "stop_token_ids", (list,), default=[])
    if len(stop_ids) > MAX_STOP_TOKEN_IDS or not _is_id_list(stop_ids, limits.vocab_size):
        raise ApiError(
            f"'stop_token_ids' must be a list of up to {MAX_STOP_TOKEN_IDS} token ids below the vocabulary's {limits.vocab_size}",
            param="stop_token_ids",
        )
    logprobs, bias = _logprobs(body, chat), _logit_bias(body, limits.vocab_size)
    try:
        params = SamplingParams(**given, stop_token_ids=stop_ids, logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=bias)
    except InvalidParams as exc:
        name = sent_as.get(exc.param, exc.param)
        raise ApiError(f"'{name}' {exc.why}", param=name) from None
    if echo and params.logprobs is not None:  # the engine computes the prompt's log-probabilities for an echo's too
        params = replace(params, prompt_logprobs=max(params.logprobs, params.prompt_logprobs or 0))
    return params


def _logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}: ids in the vocabulary, biases added to the logits (SamplingParams bounds them)."""
    bias = _get(body, "logit_bias", (dict,), default={})
    out = []
    for key, value in bias.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (key.isascii() and key.isdigit() and len(key) <= 9 and int(key) < vocab_size and number):
            raise ApiError(
                f"'logit_bias' maps token ids below the vocabulary's {vocab_size} to numbers; not {key!r}: {value!r}", param="logit_bias"
            )
        out.append((int(key), float(value)))
    if len({token for token, _ in out}) < len(out):  # "7" and "07"
        raise ApiError("'logit_bias' names a token id twice", param="logit_bias")
    if len(out) > MAX_LOGIT_BIAS:
        raise ApiError(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens", param="logit_bias")
    return tuple(sorted(out))


def _logprobs(body: dict, chat: bool) -> int | None:
    """The alternatives asked for per token: completions' logprobs N, or chat's top_logprobs once logprobs is true."""
    if not chat:
        return _get(body, "logprobs", (int,))
    top = _get(body, "top_logprobs", (int,))
    if not _get(body, "logprobs", (bool,), False):
        if top is not None:
            raise ApiError("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
        return None
    return top or 0


# -- responses ------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def logprobs_block(chat: bool, entries: list[dict], text_offset: int) -> dict:
    """OpenAI's logprobs object for `entries` (one per token: token, logprob, top)."""
    if chat:

        def item(token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [{**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for _, t, lp in e["top"]]} for e in entries]}
    offsets, at = [], text_offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        # the top N and the token itself (up to N + 1, as OpenAI and vLLM give); none at an echoed prompt's first token
        "top_logprobs": [None if e["logprob"] is None else {t: lp for _, t, lp in e["top"]} | {e["token"]: e["logprob"]} for e in entries],
        "text_offset": offsets,
    }


def prompt_logprobs_block(entries: list[dict], top: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token {token id: {logprob,
    rank, decoded_token}} for the token itself and the `top` likeliest there."""
    out: list[dict | None] = [None]
    for e in entries[1:]:
        position = {str(i): {"logprob": lp, "rank": rank, "decoded_token": t} for rank, (i, t, lp) in enumerate(e["top"][:top], 1)}
        position[str(e["token_id"])] = {"logprob": e["logprob"], "rank": e["rank"], "decoded_token": e["token"]}
        out.append(position)
    return out


def envelope(c: Completion, chunk: bool) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if c.chat else "text_completion"
    return {"id": ("chatcmpl-" if c.chat else "cmpl-") + c.id, "object": kind, "created": c.created, "model": c.model}


def choice(
    c: Completion,
    index: int,
    text: str | None,
    finish: str | None,
    logprobs: dict | None,
    token_ids: list[int] | None,
    delta: bool,
    first: bool = False,
    parts: dict | None = None,
    matched_stop: str | int | None = None,
) -> dict:
    """One choice of a response or a chunk; `parts`: a chat message's other fields (reasoning_content, tool_calls);
    `matched_stop`: SGLang's field, the stop string or token id that ended a "stop" choice (null for "length"),
    on a whole choice and on a streamed choice's last chunk."""
    if c.chat:
        body = {"content": text} if delta else {"role": "assistant", "content": text}
        if parts:
            body.update(parts)
        if delta and first:
            body = {"role": "assistant", **body}
        out = {"index": index, ("delta" if delta else "message"): body, "logprobs": logprobs, "finish_reason": finish}
    else:
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if not delta or finish is not None:
        out["matched_stop"] = matched_stop
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out
