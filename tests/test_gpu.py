"""The flashinfer backend against the torch reference, on CUDA; skipped where there is none.

Both run in bf16: flashinfer's kernels have no fp32 path, and bf16 is what the engine serves
with on CUDA. The tiny model's peaked distributions keep bf16 rounding away from greedy ties.
"""

from __future__ import annotations

import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.attention import ATTENTION_BACKENDS, ForwardBatch, KVPool, SeqSpan
from tests.tiny_models import build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("flashinfer")

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 4, 128, 16


def mixed_batch(generator: torch.Generator) -> ForwardBatch:
    """A chunk over a cached prefix, two decodes and a fresh prefill, on scattered pages."""
    shapes = [(37, 57), (1, 50), (1, 300), (16, 16)]  # (new tokens, tokens attended)
    pages = torch.randperm(256, generator=generator).tolist()
    seqs, out_slots, positions, start = [], [], [], 0
    for q_len, kv_len in shapes:
        own, pages = pages[: -(-kv_len // PAGE)], pages[-(-kv_len // PAGE) :]
        seqs.append(SeqSpan(start, q_len, kv_len, own))
        for p in range(kv_len - q_len, kv_len):
            out_slots.append(own[p // PAGE] * PAGE + p % PAGE)
            positions.append(p)
        start += q_len
    return ForwardBatch(
        input_ids=torch.zeros(start, dtype=torch.long, device="cuda"),
        positions=torch.tensor(positions, device="cuda"),
        out_slots=torch.tensor(out_slots, device="cuda"),
        seqs=seqs,
    )


def test_flashinfer_matches_torch_attention_in_bf16():
    generator = torch.Generator().manual_seed(0)
    batch = mixed_batch(generator)
    tokens = batch.out_slots.numel()
    q, k, v = (torch.randn(tokens, h, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
    history = torch.randn(256 * PAGE, KV_HEADS, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    outputs = {}
    for name, backend_cls in ATTENTION_BACKENDS.items():
        pool = KVPool(1, 256, PAGE, KV_HEADS, HEAD_DIM, torch.bfloat16, torch.device("cuda"))
        pool.k[0].copy_(history)
        pool.v[0].copy_(history.flip(0))
        backend = backend_cls(pool, HEADS)
        backend.prepare(batch)
        outputs[name] = backend.forward(0, q, k, v, batch).float()
    error = (outputs["flashinfer"] - outputs["torch"]).norm() / outputs["torch"].norm()
    print(f"flashinfer vs torch attention, bf16: relative error {error:.2e}")
    assert error < 1e-2


def test_greedy_tokens_equal_between_torch_and_flashinfer(tmp_path):
    model_dir = build("qwen3", tmp_path, head_dim=128)  # flashinfer's Hopper kernels take head dims 64, 128, 256
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (3, 17, 40, 64, 5, 29, 90, 11)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    runs = {
        backend: [o.token_ids for o in LLM(model_dir, device="cuda", dtype="bfloat16", page_size=PAGE,
                                           max_prefill_tokens=32, attention_backend=backend).generate(prompts, params)]
        for backend in ("torch", "flashinfer")
    }
    assert runs["flashinfer"] == runs["torch"]


@pytest.mark.parametrize("name", ["sgl_kernel", "flashinfer"])
def test_fused_rms_norm_matches_torch(name):
    from runtime.layers import FUSED_OPS, torch_rms_norm

    try:
        ops = FUSED_OPS[name]()
    except ImportError:
        pytest.skip(f"{name} is not installed")
    generator = torch.Generator().manual_seed(3)
    for shape in ((37, 1024), (37, 16, 128)):  # hidden states, and per-head q/k norms
        x = torch.randn(shape, generator=generator).to("cuda", torch.bfloat16)
        weight = torch.rand(shape[-1], generator=generator).to("cuda", torch.bfloat16)
        expected = torch_rms_norm(x, weight, 1e-6).float()
        error = (ops.rms_norm(x, weight, 1e-6).float() - expected).norm() / expected.norm()
        assert error < 1e-2, (name, shape, error)
