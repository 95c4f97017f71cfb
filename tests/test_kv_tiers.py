"""KV tiers under the prefix cache (--enable-hierarchical-cache): pages evicted from a device pool too small
for the conversations come back from the host tier and from disk, every answer is the one the same workload
gives with no cache at all, and the moves survive an engine that dies with plans in flight."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import orjson
import pytest
import torch

from runtime import LLM, SamplingParams
from tests.conftest import KeptPool, Server, launch, ringllm, wait_for, with_tokenizer

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True)
CLIENTS, ROUNDS, USER_TOKENS = 6, 4, 24


def conversations(llm: LLM, rounds: int = ROUNDS) -> tuple[list[list[int]], list[int]]:
    """Each client's rounds, one batch a round: the prompt is the conversation so far and new user tokens.
    Returns every answer and every round's cached tokens."""
    rng = random.Random(0)
    history = [[rng.randrange(3, 500) for _ in range(USER_TOKENS)] for _ in range(CLIENTS)]
    answers, cached = [], []
    for _ in range(rounds):
        outputs = llm.generate(history, [GREEDY, SEEDED] * (CLIENTS // 2))
        for client, output in enumerate(outputs):
            answers.append(output.token_ids)
            cached.append(output.cached_tokens)
            history[client] = history[client] + output.token_ids + [rng.randrange(3, 500) for _ in range(USER_TOKENS)]
    return answers, cached


@pytest.fixture(scope="module")
def uncached(tiny_model) -> list[list[int]]:
    return conversations(LLM(tiny_model("llama"), dtype="float32", page_size=4, enable_prefix_cache=False))[0]


# 24 pages of 4 tokens hold about one conversation of the six (each ends near 140 tokens)
SMALL_POOL: dict[str, Any] = dict(dtype="float32", page_size=4, num_pages=40)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_later_rounds_come_back_from_the_host_tier_and_change_no_token(tiny_model, uncached, policy):
    llm = LLM(tiny_model("llama"), **SMALL_POOL, hierarchical_cache=True, hicache_ratio=8, hicache_write_policy=policy)
    answers, cached = conversations(llm)
    hits = llm.scheduler.tier_hits
    print(f"{policy}: tier hits {hits}, cached per round {cached}")
    assert answers == uncached
    assert hits["host"] > 0 and sum(cached[CLIENTS:]) > hits["device"]  # later rounds mostly from the host tier
    device_only = LLM(tiny_model("llama"), **SMALL_POOL)
    assert sum(conversations(device_only)[1]) < sum(cached) / 2  # the device pool alone keeps little of them
    assert llm.flush_cache() >= 0 and llm.scheduler.cache is not None and llm.scheduler.cache.host_cached_pages == 0


def test_a_disk_tier_serves_a_new_engine_and_keeps_what_the_host_tier_drops(tiny_model, uncached, tmp_path):
    tiers: dict[str, Any] = dict(hierarchical_cache=True, hicache_ratio=1.5, hicache_storage_backend="file")
    tiers["hicache_storage_dir"] = str(tmp_path)
    for policy in ("write_through", "write_back"):
        first = LLM(tiny_model("llama"), **SMALL_POOL, **tiers, hicache_write_policy=policy)
        answers, _ = conversations(first)
        assert answers == uncached
        assert first.scheduler.tier_hits["disk"] > 0, first.scheduler.tier_hits  # a host tier of 60 pages drops most
    files = list(tmp_path.rglob("*.kv"))
    assert files and not list(tmp_path.rglob("*.partial"))
    again = LLM(tiny_model("llama"), **SMALL_POOL, **tiers)  # a restarted server: the files are all it has
    answers, cached = conversations(again, rounds=1)
    assert answers == uncached[:CLIENTS]
    assert again.scheduler.tier_hits["disk"] == sum(cached) > 0


def test_an_engine_that_dies_with_moves_in_flight_leaves_no_wrong_page(tiny_model, uncached):
    """The host tier outlives the engine here as the keeper's does. Stores the dead engine may not have run
    are forgotten, its loads run again in the new engine's first plan, and the answers stay the same."""
    llm = LLM(tiny_model("llama"), **SMALL_POOL, hierarchical_cache=True, hicache_ratio=8)
    host: list[torch.Tensor] = []

    def kept_host(size: int) -> torch.Tensor:
        if not host:
            host.append(torch.zeros(size, dtype=torch.uint8))
        return host[0]

    pool = KeptPool(llm, host_memory=kept_host)
    rng = random.Random(0)
    history = [[rng.randrange(3, 500) for _ in range(USER_TOKENS)] for _ in range(CLIENTS)]
    answers: list[list[int]] = []
    killed = 0
    for round_ in range(ROUNDS):
        requests = [
            pool.scheduler.add(round_ * CLIENTS + client, prompt, params)
            for client, (prompt, params) in enumerate(zip(history, [GREEDY, SEEDED] * (CLIENTS // 2)))
        ]
        while pool.scheduler.has_work():
            plan = pool.scheduler.schedule()
            if plan.moves and killed < 3:  # dies with this plan unanswered: run, or lost before it ran
                if killed != 1:
                    pool.engine.launch(plan)
                pool.revive()
                pool.scheduler.reopen()
                killed += 1
                continue
            pool.scheduler.update(plan.step, pool.engine.launch(plan).result())
        for client, request in enumerate(requests):
            answers.append(request.output_ids)
            history[client] = history[client] + request.output_ids + [rng.randrange(3, 500) for _ in range(USER_TOKENS)]
    assert killed == 3
    assert answers == uncached


def test_pages_in_a_row_move_as_one_copy_and_pages_apart_one_by_one():
    from runtime.attention.pool import KVPool
    from runtime.engine.kv_tiers import HostTier, page_runs
    from runtime.step import KVMove

    assert page_runs([3, 4, 5, 9, 10, 1], [7, 8, 9, 2, 3, 0]) == [(3, 7, 3), (9, 2, 2), (1, 0, 1)]
    pool = KVPool(2, 40, 4, 2, 8, torch.float32, torch.device("cpu"))
    for layer in pool.kv:
        layer.normal_()
    tier = HostTier(pool, 24, None, None)
    device, host, back = [*range(6), 10, 13, 14], [*range(2, 8), 20, 1, 12], [*range(30, 36), 21, 25, 29]
    keys = [bytes([page]) * 16 for page in device]
    tier.run([KVMove("store", device, host, keys, bytes(16), 0, [5] * len(keys) * 4)])
    assert tier.run([KVMove("load", back, host)]) is None  # on CPU the copies have run
    for layer in pool.kv:
        assert torch.equal(layer[back], layer[device])
    assert tier.index.valid[host].all() and tier.index.valid.sum() == len(host)
    assert tier.take_stats()[0]["host_to_device"] == len(host) * tier.page_bytes


def test_the_tier_flags_are_checked():
    from runtime.config import EngineConfig

    with pytest.raises(ValueError, match="disable-prefix-cache"):
        EngineConfig(hierarchical_cache=True, enable_prefix_cache=False)
    with pytest.raises(ValueError, match="needs --enable-hierarchical-cache"):
        EngineConfig(hicache_storage_backend="file")
    with pytest.raises(ValueError, match="write_policy"):
        EngineConfig(hierarchical_cache=True, hicache_write_policy="write_around")
    assert EngineConfig(hierarchical_cache=True, hicache_size=2).host_tier_pages(100, 10**6) == 2000
    assert EngineConfig(hierarchical_cache=True).host_tier_pages(100, 10**6) == 200


class Conversations:
    """CLIENTS conversations against a server, one request at a time; each answer is checked against the
    same conversation run in this process with no prefix cache, and counts what it found cached."""

    def __init__(self, reference: LLM) -> None:
        self.reference = reference
        self.rng = random.Random(1)
        self.history = [[self.rng.randrange(3, 500) for _ in range(USER_TOKENS)] for _ in range(CLIENTS)]
        self.rounds: list[list[tuple[list[int], list[int]]]] = []  # each round's prompts and answers

    def round(self, server: Server) -> int:
        """The next round of every conversation; returns the cached tokens the server reported."""
        cached, sent = 0, []
        for client, prompt in enumerate(self.history):
            answer, hit = self._ask(server, client, prompt)
            assert answer == self.reference.generate([prompt], [GREEDY, SEEDED][client % 2])[0].token_ids, client
            cached += hit
            sent.append((prompt, answer))
            self.history[client] = prompt + answer + [self.rng.randrange(3, 500) for _ in range(USER_TOKENS)]
        self.rounds.append(sent)
        return cached

    def again(self, server: Server, index: int) -> int:
        """Round `index` once more: the same answers; returns the cached tokens."""
        cached = 0
        for client, (prompt, expected) in enumerate(self.rounds[index]):
            answer, hit = self._ask(server, client, prompt)
            assert answer == expected, client
            cached += hit
        return cached

    @staticmethod
    def _ask(server: Server, client: int, prompt: list[int]) -> tuple[list[int], int]:
        params = [GREEDY, SEEDED][client % 2]
        body = {"model": server.model, "prompt": prompt, "max_tokens": params.max_tokens, "temperature": params.temperature}
        body |= {"ignore_eos": True, "return_token_ids": True} | ({"seed": params.seed} if params.seed is not None else {})
        reply = server.call("POST", "/v1/completions", body)
        assert "choices" in reply, reply
        return reply["choices"][0]["token_ids"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def hits(server: Server) -> dict[str, int]:
    scheduler = server.get("/server_info")["scheduler"]
    hit = {tier: scheduler[f"{tier}_hit_tokens"] for tier in ("device", "host", "disk")}
    return hit | {"host_pages": scheduler["host_cached_pages"], "disk_pages": scheduler["disk_pages"]}


def kill(server: Server, actor: str) -> None:
    rows = orjson.loads(ringllm("status", "--json", "--port", str(server.port)).stdout)
    os.kill(next(row["pid"] for row in rows if row["name"] == actor), signal.SIGKILL)
    time.sleep(0.5)
    wait_for(lambda: server.get("/health")["status"] == "ok", 120, f"the server to recover from the {actor}'s death")


@pytest.mark.slow
def test_a_server_keeps_its_tiers_through_engine_and_scheduler_deaths_and_its_files_through_a_restart(tiny_model, smollm2, tmp_path):
    model = with_tokenizer(tiny_model("llama"), smollm2, tmp_path / "model")
    tiers = ("--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-write-policy", "write_back")
    disk = ("--hicache-storage-backend", "file", "--hicache-storage-dir", str(tmp_path / "disk"))
    args = ("--page-size", "4", "--num-pages", "40", *tiers, *disk, "--stats-interval", "1")
    talks = Conversations(LLM(model, dtype="float32", page_size=4, enable_prefix_cache=False))
    server = launch(model, tmp_path / "serve.log", *args)
    try:
        for _ in range(2):
            talks.round(server)
        before = hits(server)
        assert before["host"] > 0 and before["host_pages"] > 0, before
        for actor in ("engine", "scheduler"):  # each keeps the host tier: the next round finds its pages there
            kill(server, actor)
            seen = hits(server)
            assert talks.round(server) > 0
            after = hits(server)
            print(f"after the {actor}'s death: {seen} -> {after}")
            assert after["host"] > (seen["host"] if actor == "engine" else 0), (actor, seen, after)
        kill(server, "keeper")  # the host tier goes with it; the answers stay right
        assert hits(server)["host_pages"] == 0
        talks.round(server)
    finally:
        server.stop()
    assert list((tmp_path / "disk").rglob("*.kv"))
    server = launch(model, tmp_path / "serve2.log", *args)
    try:
        assert talks.again(server, 2) > 0  # prompts of 84 tokens, whose first pages disk has
        assert hits(server)["disk"] > 0
        files = len(list((tmp_path / "disk").rglob("*.kv")))
        wait_for(lambda: hits(server)["disk_pages"] == files, 10, "the disk tier's pages in /server_info")
    finally:
        server.stop()
