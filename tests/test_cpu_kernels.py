"""ringllm's CPU kernels against the torch ops they stand in for: the skinny GEMM against F.linear,
and decode attention on the paged pool against the SDPA path of the torch backend. The models'
parity with transformers (test_parity.py) runs through them too, wherever they build."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from runtime.attention.backend import AttentionSpec
from runtime.attention.pool import KVPool
from runtime.attention.torch_backend import TorchAttention
from runtime.batch import AttentionMeta, ForwardBatch
from runtime.kernels.cpu import build as cpu_kernels
from runtime.kernels.cpu.build import cpuinfo
from runtime.models.cpu_linears import SKINNY_ROWS, SkinnyLinear, prepack_linears
from tests.conftest import ROOT

BUILDS_HERE = {"avx2", "fma"} <= set(cpuinfo("flags").split()) and shutil.which("c++") is not None
pytestmark = pytest.mark.skipif(not BUILDS_HERE, reason="needs AVX2, FMA and a C++ compiler")


def test_the_kernels_build_and_load():
    assert cpu_kernels.available()


def test_a_build_killed_midway_does_not_block_later_loads():
    """torch's build baton (a file named "lock" in the build folder) outlives a process killed while it held
    it, and every later start of the engine had waited on it forever."""
    assert cpu_kernels.available()
    folder = cpu_kernels.build_directory()
    baton = folder / "lock"
    with cpu_kernels.build_lock(folder):  # engines in other test workers load the kernels too, and torch's baton is theirs then
        baton.touch()
    try:
        loaded = subprocess.run(
            [sys.executable, "-c", "from runtime.kernels.cpu import build; print(build.available())"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert loaded.stdout.strip() == "True", loaded.stderr
        with cpu_kernels.build_lock(folder):
            assert not baton.exists()
    finally:
        with cpu_kernels.build_lock(folder):
            baton.unlink(missing_ok=True)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17])
@pytest.mark.parametrize(("out_features", "in_features", "bias"), [(1001, 576, True), (7, 64, False), (300, 1536, True)])
def test_skinny_linear_matches_f_linear(rows, out_features, in_features, bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    torch.testing.assert_close(torch.ops.ringllm_cpu.skinny_linear(x, weight, b), F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


def test_skinny_linear_keeps_leading_dimensions_and_takes_strided_rows():
    x, weight = torch.randn(2, 3, 128), torch.randn(40, 128)
    assert torch.ops.ringllm_cpu.skinny_linear(x, weight, None).shape == (2, 3, 40)
    torch.testing.assert_close(torch.ops.ringllm_cpu.skinny_linear(x, weight, None), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    strided = torch.randn(4, 256)[:, ::2]
    torch.testing.assert_close(torch.ops.ringllm_cpu.skinny_linear(strided, weight, None), F.linear(strided, weight), rtol=1e-4, atol=1e-4)


def test_skinny_linear_refuses_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="divisible by 8"):
        torch.ops.ringllm_cpu.skinny_linear(torch.randn(2, 12), torch.randn(5, 12), None)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.ringllm_cpu.skinny_linear(torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(5, 16, dtype=torch.bfloat16), None)


@pytest.mark.parametrize("rows", [SKINNY_ROWS, SKINNY_ROWS + 1, 200])
def test_a_skinny_module_gives_the_same_rows_on_either_side_of_its_threshold(rows):
    linear = torch.nn.Linear(64, 96)
    module = SkinnyLinear(linear, tied=False)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        torch.testing.assert_close(module(x), linear(x), rtol=1e-4, atol=1e-4)


def test_a_tied_lm_head_shares_the_embedding_and_the_rest_are_swapped():
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(100, 32)
            self.proj = torch.nn.Linear(32, 48)
            self.lm_head = torch.nn.Linear(32, 100, bias=False)
            self.lm_head.weight = self.embed.weight

    model = Tiny()
    assert prepack_linears(model, torch.float32) == "skinny"
    assert isinstance(model.proj, SkinnyLinear) and model.proj.packed is not None
    assert model.lm_head.packed is None and model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()


def _decode_step(kv_lens: list[int], page_size: int, pool: KVPool, generator: torch.Generator) -> AttentionMeta:
    """A decode-only step's meta with each sequence on its own shuffled pages."""
    pages = torch.randperm(len(pool.kv[0]), generator=generator).numpy().astype(np.int32)
    counts = [-(-n // page_size) for n in kv_lens]
    kv_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return AttentionMeta(np.arange(len(kv_lens) + 1, dtype=np.int32), kv_indptr, pages[: kv_indptr[-1]], np.array(kv_lens, dtype=np.int32))


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 16), (16, 8, 128)])
@pytest.mark.parametrize("kv_lens", [[1], [17, 1, 600, 64], [33, 5]])
@pytest.mark.parametrize(("window", "softcap"), [(0, None), (20, None), (0, 5.0)])  # Gemma's windows, Gemma 2's cap
def test_paged_decode_attention_matches_sdpa_on_gathered_pages(heads, kv_heads, head_dim, kv_lens, window, softcap):
    generator = torch.Generator().manual_seed(sum(kv_lens) + heads)
    page_size = 16
    pool = KVPool(1, 64, page_size, kv_heads, head_dim, torch.float32, torch.device("cpu"))
    pool.kv[0].copy_(torch.randn(pool.kv[0].shape, generator=generator))
    meta = _decode_step(kv_lens, page_size, pool, generator)
    q = torch.randn(len(kv_lens), heads, head_dim, generator=generator)
    batch = ForwardBatch(
        torch.zeros(len(kv_lens), dtype=torch.int64),
        torch.zeros(len(kv_lens), dtype=torch.int64),
        torch.zeros(len(kv_lens), 2, dtype=torch.int64),
        meta,
    )
    spec = AttentionSpec(0.3 / head_dim**0.5, softcap, (window,))
    in_place, gathered = TorchAttention(pool, heads, spec), TorchAttention(pool, heads, spec)
    gathered.in_place = False
    assert in_place.in_place
    outputs = []
    for backend in (in_place, gathered):
        backend.prepare(meta)
        outputs.append(backend.forward(0, q, batch))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 700])
def test_the_cpu_op_set_matches_the_torch_set(rows):
    from runtime.models.layers import FUSED_OPS

    ops, reference = FUSED_OPS["ringllm_cpu"](), FUSED_OPS["torch"]()
    generator = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, 576, generator=generator), torch.randn(rows, 576, generator=generator)
    weight = torch.randn(576, generator=generator)
    close = lambda got, expected: torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # noqa: E731
    close(ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    heads = torch.randn(rows, 3 * 64, generator=generator).view(rows, 3, 64)[:, :2]  # q/k norms: a strided view of heads
    close(ops.rms_norm(heads, weight[:64], 1e-6), reference.rms_norm(heads, weight[:64], 1e-6))
    expected_normed, expected_residual = reference.add_rms_norm(x, residual, weight, 1e-5)
    normed, new_residual = ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    close(normed, expected_normed)
    close(new_residual, expected_residual)
    gate_up = torch.randn(rows, 2 * 1536, generator=generator) * 4
    close(ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
