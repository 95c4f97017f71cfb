"""API keys: a server started with `--api-key` (twice) and RINGLLM_API_KEY answers the real openai
client only with one of those keys; a wrong or missing key gets a 401 in OpenAI's shape on every
guarded route, state-changing ones included, while the probes and the scraper stay open; no key
reaches the log. Also: every actor's restart counter and every finish reason are exported at 0."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import aiohttp
import openai
import orjson
import pytest

from tests.conftest import Server, launch, with_tokenizer

KEYS = ("sk-first-key", "sk-second-key")
ENV_KEY = "sk-from-the-environment"


@pytest.fixture(scope="module")
def keyed(tiny_model, smollm2, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("keyed")
    model = with_tokenizer(tiny_model("llama"), smollm2, folder / "model")
    os.environ["RINGLLM_API_KEY"] = ENV_KEY  # the server inherits it
    try:
        server = launch(model, folder / "serve.log", "--api-key", KEYS[0], "--api-key", KEYS[1])
    finally:
        del os.environ["RINGLLM_API_KEY"]
    yield server
    server.stop(signal.SIGINT)
    log = server.log.read_text()
    assert not any(key in log for key in (*KEYS, ENV_KEY)), "an API key reached the log"


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("key", [*KEYS, ENV_KEY])
def test_each_key_opens_the_api(keyed, key):
    answer = client(keyed, key).completions.create(model=keyed.model, prompt=[1, 2, 3], max_tokens=3)
    assert answer.usage.completion_tokens == 3
    assert [m.id for m in client(keyed, key).models.list()] == [keyed.model]


@pytest.mark.parametrize("key", ["sk-wrong", KEYS[0] + "x", KEYS[0][:-1], ""])
def test_a_wrong_key_gets_401_from_the_openai_client(keyed, key):
    with pytest.raises(openai.AuthenticationError) as refused:
        client(keyed, key or "unset").chat.completions.create(model=keyed.model, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


async def test_guarded_routes_refuse_while_probes_and_metrics_stay_open(keyed):
    guarded = [("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/flush_cache"), ("GET", "/server_info")]
    async with aiohttp.ClientSession(keyed.base_url) as http:
        for method, path in guarded:
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEYS[0]}"}):
                async with http.request(method, path, json={}, headers=headers) as reply:
                    body = await reply.json()
                assert reply.status == 401 and body["error"]["code"] == "invalid_api_key", (method, path, headers, body)
        async with http.post("/flush_cache", json={}, headers={"Authorization": f"Bearer {KEYS[1]}"}) as reply:
            assert reply.status == 200
        for path in ("/health", "/health/live", "/metrics", "/version"):
            async with http.get(path) as reply:
                assert reply.status == 200, path
                if path == "/metrics":
                    exposition = await reply.text()
    for actor in ("tokenizer", "scheduler", "engine", "detokenizer", "api0"):
        assert f'ringllm:actor_restarts_total{{actor="{actor}"}} 0.0' in exposition, actor
    for reason in ("stop", "length", "abort"):
        assert f'finished_reason="{reason}"' in exposition, reason


async def test_server_info_with_a_key_shows_no_key(keyed):
    async with aiohttp.ClientSession(keyed.base_url, headers={"Authorization": f"Bearer {ENV_KEY}"}) as http:
        async with http.get("/server_info") as reply:
            info = await reply.read()
    assert reply.status == 200 and orjson.loads(info)
    assert not any(key.encode() in info for key in (*KEYS, ENV_KEY))
