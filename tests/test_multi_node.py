"""Tensor parallelism over two nodes on one machine: two `ringllm serve` process trees on 127.0.0.1 (--nnodes 2,
gloo, --tp 2, one rank on each) serve the tokens one rank gives; SIGKILL of node 1's rank mid-stream restarts the
group on both nodes and the stream goes on unchanged; node 0's end ends node 1; a layout that cannot run is
refused before anything starts."""

from __future__ import annotations

import asyncio
import signal
import subprocess

import orjson
import pytest

from runtime.llm import LLM
from tests.conftest import free_port, launch, ringllm, wait_for, with_tokenizer
from tests.test_serving import _stream_text, complete_ids
from tests.test_tensor_parallel import GREEDY, PROMPTS, SPLIT, assert_same_greedy
from tests.tiny_models import build
from transport.segment import list_segments, server_prefix

pytestmark = pytest.mark.slow  # two process trees, and a group restarted across them


def engines(port: int) -> dict[str, dict]:
    """`ringllm status` of the server on `port`: its engine rows by name."""
    rows = orjson.loads(ringllm("status", "--json", "--port", str(port)).stdout)
    return {row["name"]: row for row in rows if row["name"].startswith("engine")}


def test_two_nodes_serve_the_tokens_one_rank_gives_and_a_dead_rank_restarts_the_group(smollm2, tmp_path):
    served = with_tokenizer(build("qwen3", tmp_path / "qwen3", num_key_value_heads=1), smollm2, tmp_path / "model")
    reference = LLM(served, **SPLIT).generate(PROMPTS, GREEDY)
    meeting = f"127.0.0.1:{free_port()}"
    nodes = ("--tp", "2", "--nnodes", "2", "--dist-init-addr", meeting, "--page-size", "16", "--max-prefill-tokens", "24")
    second = launch(served, tmp_path / "node1.log", *nodes, "--node-rank", "1", ready=False)
    first = None
    try:
        first = launch(served, tmp_path / "node0.log", *nodes, "--node-rank", "0")
        wait_for(lambda: b'"topology_ready"' in second.log.read_bytes(), 60, "node 1 to be ready")
        assert list(engines(first.port)) == ["engine0"] and list(engines(second.port)) == ["engine1"]
        ids = asyncio.run(complete_ids(first.base_url, first.model, PROMPTS, max_tokens=GREEDY.max_tokens))
        for ours, theirs in zip(ids, reference):
            assert_same_greedy(ours, theirs.token_ids, theirs.logprobs)

        before, _ = asyncio.run(_stream_text(first))
        after, pause = asyncio.run(_stream_text(first, engines(second.port)["engine1"]["pid"]))
        assert after == before and pause < 30
        wait_for(lambda: first.get("/health")["status"] == "ok", 30, "the group to be back")
        assert engines(first.port)["engine0"]["restarts"] == 1 and engines(second.port)["engine1"]["restarts"] == 1
    finally:
        if first is None:
            second.stop()
        else:
            first.stop()
            try:
                second.proc.wait(30)  # node 0's store went with it: node 1 ends by itself
            except subprocess.TimeoutExpired:
                second.stop(signal.SIGKILL)
                raise AssertionError("node 1 outlived node 0") from None
    assert b'"node_store_failed"' in second.log.read_bytes()
    for server in (first, second):
        assert not list_segments(server_prefix(str(server.port)))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--nnodes", "2", "--tp", "2"), "nnodes above 1 needs dist_init_addr"),
        (("--nnodes", "2", "--tp", "3", "--dist-init-addr", "127.0.0.1:1"), "tensor_parallel_size 3 does not split over 2 nodes"),
        (("--nnodes", "2", "--node-rank", "2", "--tp", "2", "--dist-init-addr", "127.0.0.1:1"), "node_rank must be from 0 to nnodes - 1"),
        (("--nnodes", "2", "--tp", "2", "--dist-init-addr", "node0"), "an address is HOST:PORT, not 'node0'"),
        (("--nnodes", "2", "--tp", "2", "--dp", "2", "--dist-init-addr", "127.0.0.1:1"), "replicas do not span nodes"),
    ],
)
def test_a_layout_that_cannot_run_is_refused_before_anything_starts(tiny_model, flags, message):
    done = ringllm("serve", "--model", str(tiny_model("qwen3")), "--port", "1", *flags, check=False, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]
