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

from tests.conftest import Server, launch, ringllm, wait_for, with_tokenizer

KEYS = ("sk-first-key", "sk-second-key")
ENV_KEY = "sk-from-the-environment"
STARTUP_PREFIX = list(range(100, 140))  # 40 tokens: two whole pages of 16 pinned


@pytest.fixture(scope="module")
def keyed(tiny_model, smollm2, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("keyed")
    model = with_tokenizer(tiny_model("llama"), smollm2, folder / "model")
    os.environ["RINGLLM_API_KEY"] = ENV_KEY  # the server inherits it
    (folder / "prefixes.json").write_bytes(orjson.dumps([STARTUP_PREFIX]))
    try:
        keys = ("--api-key", KEYS[0], "--api-key", KEYS[1])
        server = launch(model, folder / "serve.log", *keys, "--warm-prefixes", str(folder / "prefixes.json"))
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
    # ignore_eos: the random model's sampled answer may otherwise end early
    answer = client(keyed, key).completions.create(model=keyed.model, prompt=[1, 2, 3], max_tokens=3, extra_body={"ignore_eos": True})
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


def _cached(server: Server, prompt: list[int]) -> int:
    answer = client(server, KEYS[0]).completions.create(model=server.model, prompt=prompt, max_tokens=1)
    return answer.usage.prompt_tokens_details.cached_tokens


def test_warmed_prefixes_stay_cached_through_flushes_until_unpinned(keyed):
    """--warm-prefixes at start-up and POST /warm_prefixes pin prefixes: a later prompt that starts with one
    reports its whole pages in cached_tokens, even after /flush_cache, and after a restart that empties
    the cache; DELETE /warm_prefixes lets them go. Both routes need a key."""
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    wait_for(lambda: keyed.get("/server_info", headers)["scheduler"]["pinned_prefixes"] == 1, 30, "the start-up prefix")
    posted = list(range(200, 250))
    answer = keyed.call("POST", "/warm_prefixes", {"prefixes": [posted, list(range(300, 320))]}, headers)
    assert answer["prefixes"] == [{"prompt_tokens": 50, "pinned_tokens": 48}, {"prompt_tokens": 20, "pinned_tokens": 16}]
    assert keyed.get("/server_info", headers)["scheduler"]["pinned_prefixes"] == 3
    keyed.call("POST", "/warm_prefixes", {"prefixes": [posted]}, headers)  # again: pinned once
    assert keyed.get("/server_info", headers)["scheduler"]["pinned_prefixes"] == 3
    keyed.call("POST", "/flush_cache", {}, headers)
    assert _cached(keyed, [*STARTUP_PREFIX, 7, 8, 9]) == 32 and _cached(keyed, [*posted, 7]) == 48
    rows = orjson.loads(ringllm("status", "--json", "--port", str(keyed.port)).stdout)
    warm_ups = keyed.log.read_bytes().count(b'"prefixes_warmed"')
    os.kill(next(row["pid"] for row in rows if row["name"] == "scheduler"), signal.SIGKILL)  # a new epoch, and an empty cache
    wait_for(lambda: keyed.log.read_bytes().count(b'"prefixes_warmed"') > warm_ups, 60, "the api worker to warm its prefixes again")
    assert keyed.get("/server_info", headers)["scheduler"]["pinned_prefixes"] == 3
    assert _cached(keyed, [*posted, 7]) == 48
    assert keyed.call("DELETE", "/warm_prefixes", None, {})["error"]["code"] == "invalid_api_key"
    assert keyed.call("DELETE", "/warm_prefixes", None, headers)["unpinned_pages"] == 2 + 3 + 1
    keyed.call("POST", "/flush_cache", {}, headers)
    assert _cached(keyed, [*posted, 7]) == 0 and keyed.get("/server_info", headers)["scheduler"]["pinned_pages"] == 0
    bad = keyed.call("POST", "/warm_prefixes", {"prefixes": [[100000]]}, headers)
    assert bad["error"]["param"] == "prefixes"
    # one prefix refused downstream (text whose tokens the tiny model lacks): a 400, the other aborted or done
    refused = keyed.call("POST", "/warm_prefixes", {"prefixes": [list(range(400, 440)), "Words past the vocabulary."]}, headers)
    assert refused["error"]["param"] == "prefixes" and "vocabulary" in refused["error"]["message"]
