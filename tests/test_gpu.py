"""The CUDA paths against the torch reference; skipped where there is no CUDA.

Attention and whole-model comparisons run in bf16: flashinfer's kernels have no fp32 path, and
bf16 is what the engine serves with on CUDA. The tiny model's peaked distributions keep bf16
rounding away from greedy ties.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import LLM, SamplingParams
from runtime.attention import ATTENTION_BACKENDS
from runtime.attention.backend import AttentionSpec
from runtime.attention.pool import KVPool
from runtime.batch import AttentionMeta, ForwardBatch, kv_rows
from tests.tiny_models import build

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("flashinfer")

HEADS, HEAD_DIM, PAGE, POOL_PAGES = 16, 128, 16, 256


def paged_batch(shapes: list[tuple[int, int]], generator: torch.Generator) -> ForwardBatch:
    """Sequences of (new tokens, tokens attended) on scattered pages."""
    pages = torch.randperm(POOL_PAGES, generator=generator).tolist()
    qo, kv_indptr, indices, out_pages, out_offsets, positions = [0], [0], [], [], [], []
    for q_len, kv_len in shapes:
        own, pages = pages[: -(-kv_len // PAGE)], pages[-(-kv_len // PAGE) :]
        indices += own
        for p in range(kv_len - q_len, kv_len):
            out_pages.append(own[p // PAGE])
            out_offsets.append(p % PAGE)
            positions.append(p)
        qo.append(qo[-1] + q_len)
        kv_indptr.append(len(indices))
    meta = AttentionMeta(*(np.array(a, dtype=np.int32) for a in (qo, kv_indptr, indices, [kv for _, kv in shapes])))
    cuda = lambda a: torch.tensor(a, device="cuda")  # noqa: E731
    rows = kv_rows(np.array(out_pages), np.array(out_offsets), PAGE)
    return ForwardBatch(cuda([0] * qo[-1]), cuda(positions), torch.from_numpy(rows).cuda(), meta)


def make_pool(kv_heads: int, fp8: bool, scales: tuple[float, float] = (0.5, 2.0)) -> KVPool:
    """A one-layer bf16 pool, or an FP8 one whose layer has the given K and V scales."""
    if not fp8:
        return KVPool(1, POOL_PAGES, PAGE, kv_heads, HEAD_DIM, torch.bfloat16, torch.device("cuda"))
    return KVPool(1, POOL_PAGES, PAGE, kv_heads, HEAD_DIM, torch.float8_e4m3fn, torch.device("cuda"), torch.bfloat16, [scales])


@pytest.mark.parametrize(("window", "softcap", "fp8"), [(0, None, False), (0, None, True), (24, None, False), (0, 30.0, False)])
@pytest.mark.parametrize("kv_heads", [4, 8])  # decode on tensor cores, and on CUDA cores
@pytest.mark.parametrize(
    "shapes",
    [
        [(37, 57), (1, 50), (1, 300), (16, 16)],  # a chunk over a cached prefix, decodes, a fresh prefill
        [(1, 50), (1, 300), (1, 1), (1, 17)],  # decode only
    ],
)
def test_flashinfer_matches_torch_attention_in_bf16(shapes, kv_heads, fp8, window, softcap):
    """bf16 queries over bf16 pages, and over FP8 pages with K and V scales (which torch attention
    dequantizes as it gathers them)."""
    generator = torch.Generator().manual_seed(0)
    batch = paged_batch(shapes, generator)
    tokens = len(batch.positions)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    kv = torch.randn(tokens, 2, kv_heads, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    history = torch.randn(POOL_PAGES, 2, PAGE, kv_heads, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    outputs = {}
    for name, backend_cls in ATTENTION_BACKENDS.items():
        pool = make_pool(kv_heads, fp8)
        pool.kv[0].copy_(history)
        pool.write(0, kv, batch.kv_rows)
        backend = backend_cls(pool, HEADS, AttentionSpec(0.8 / HEAD_DIM**0.5, softcap, (window,)))
        backend.prepare(batch.meta)
        outputs[name] = backend.forward(0, q, batch).float()
    error = (outputs["flashinfer"] - outputs["torch"]).norm() / outputs["torch"].norm()
    print(f"flashinfer vs torch attention, bf16, fp8 pages {fp8}, {kv_heads} kv heads, window {window}, cap {softcap}: {error:.2e}")
    assert error < 1e-2


def greedy_run(model_dir, **options) -> list[tuple[list[int], list[dict[int, float]]]]:
    return greedy_tokens(LLM(model_dir, device="cuda", dtype="bfloat16", page_size=PAGE, num_pages=512, max_prefill_tokens=32, **options))


def greedy_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (3, 17, 40, 64, 5, 29, 90, 11)]


def greedy_tokens(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)
    return [(o.token_ids, o.logprobs) for o in llm.generate(greedy_prompts(), params)]


def assert_same_greedy_tokens(reference, candidate, what: str, near_tie: float = 0.05, most: int = 2) -> None:
    """Equal tokens, except that two bf16 kernels may split a near-tie differently: at most `most` of
    the 8 sequences diverge, each only where the reference's top two log-probabilities are within
    `near_tie`."""
    diverged = 0
    for (ref_tokens, ref_logprobs), (tokens, _) in zip(reference, candidate):
        if tokens == ref_tokens:
            continue
        at = next(i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b)
        first, second = sorted(ref_logprobs[at].values(), reverse=True)[:2]
        print(f"{what}: diverged at token {at}, reference top-2 gap {first - second:.4f}")
        assert first - second < near_tie, (what, at, ref_logprobs[at])
        diverged += 1
    assert diverged <= most, what


def test_greedy_tokens_equal_between_torch_attention_flashinfer_and_cuda_graphs(tmp_path):
    model_dir = build("qwen3", tmp_path, head_dim=128)  # flashinfer's Hopper kernels take head dims 64, 128, 256
    reference = greedy_run(model_dir, attention_backend="torch")
    eager = greedy_run(model_dir, attention_backend="flashinfer", cuda_graph_max_bs=0, cuda_graph_max_prefill_tokens=0)
    assert_same_greedy_tokens(reference, eager, "flashinfer")
    assert_same_greedy_tokens(reference, greedy_run(model_dir, attention_backend="flashinfer"), "flashinfer + CUDA graphs")


def whole_sequence_scores(llm: LLM, sequences: list[list[int]]) -> torch.Tensor:
    """Every token's log-probability after the ones before it (prompt log-probabilities, through chunked prefill)."""
    outputs = llm.generate(sequences, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return torch.tensor([lp for o in outputs for lp, _, _ in o.prompt_logprobs])


def assert_same_log_probabilities(model_dir, runs: dict[str, dict], what: str, **common) -> None:
    """Each run (LLM options; the first the reference, on the torch backend) gives the reference's greedy ids, or parts
    from them only at near-ties, and scores the reference's sequences whole (prompt log-probabilities, through chunked
    prefill) within bf16's reach of the reference's scores."""
    reference, scores, greedy = None, {}, {}
    for name, options in runs.items():
        llm = LLM(model_dir, device="cuda", dtype="bfloat16", page_size=PAGE, num_pages=512, max_prefill_tokens=32, **options, **common)
        greedy[name] = greedy_tokens(llm)
        reference = reference or greedy[name]
        scores[name] = whole_sequence_scores(llm, [prompt + tokens for prompt, (tokens, _) in zip(greedy_prompts(), reference)])
    first = next(iter(scores.values()))
    for name, score in list(scores.items())[1:]:
        error = (score - first).abs()
        print(f"{what} {name}: prompt log-probabilities off by {error.mean():.4f} on average, {error.max():.4f} at most")
        assert error.mean() < 0.03 and error.max() < 0.3, name
    for name in list(runs)[1:]:
        assert_same_greedy_tokens(reference, greedy[name], f"{what} {name}", most=len(reference))


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_sliding_windows_and_soft_caps_give_the_log_probabilities_of_torch_attention(tmp_path, arch):
    """Windows of 16 on a window pool of a few pages (pages given back, idle ones taken back), Gemma 2's soft caps:
    flashinfer eager, and in decode and prefill graphs, against the torch backend. Gemma's random norms flatten the
    tiny model's distributions, and its bf16 logits tie exactly at many steps, so greedy ids may part at ties (only
    there); the whole sequences' scores move by far more than bf16 does past a wrong window or cap."""
    runs = {
        "torch": dict(attention_backend="torch"),
        "flashinfer": dict(attention_backend="flashinfer", cuda_graph_max_bs=0, cuda_graph_max_prefill_tokens=0),
        "graphs": dict(attention_backend="flashinfer"),
    }
    # a window pool of 10 pages: fewer than the sequences' windows together
    assert_same_log_probabilities(build(arch, tmp_path, head_dim=128), runs, arch, swa_full_tokens_ratio=0.02)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v3_q_whole"])
def test_mla_on_flashinfer_strays_from_float32_no_more_than_torch_attention(tmp_path, arch):
    """DeepSeek-V3's MLA at its latent widths (512 + 64) and 16 heads, tiny otherwise: flashinfer's MLA kernel over
    the pool's latents, eager and in decode and prefill graphs (with the experts' fused kernels), scoring whole
    sequences through chunked prefill. In bf16 this model's scores stray from float32's by 0.1-0.2 on average whatever
    the kernel (chunk sizes alone move the torch backend's by 0.04), so each run is held to the torch backend's own
    distance from float32; a wrong mask, page or scale lands far beyond it."""
    model_dir = build(arch, tmp_path, num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64)
    runs = {
        "float32": dict(attention_backend="torch", dtype="float32"),
        "torch": dict(attention_backend="torch"),
        "flashinfer": dict(attention_backend="flashinfer", cuda_graph_max_bs=0, cuda_graph_max_prefill_tokens=0),
        "graphs": dict(attention_backend="flashinfer"),
    }
    sequences, scores = None, {}
    for name, options in runs.items():
        llm = LLM(model_dir, device="cuda", **{"dtype": "bfloat16", **options}, page_size=PAGE, num_pages=512, max_prefill_tokens=32)
        sequences = sequences or [prompt + tokens for prompt, (tokens, _) in zip(greedy_prompts(), greedy_tokens(llm))]
        scores[name] = whole_sequence_scores(llm, sequences)
    truth = scores.pop("float32")
    bf16 = (scores.pop("torch") - truth).abs()
    for name, score in scores.items():
        error = (score - truth).abs()
        print(f"{arch} {name}: {error.mean():.4f} from float32 on average, {error.max():.4f} at most (torch: {bf16.mean():.4f})")
        assert error.mean() < 1.2 * bf16.mean() and error.max() < 1.5 * bf16.max(), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(("kv_heads", "custom_all_reduce"), [(2, True), (1, False)])  # KV heads split, and replicated
def test_two_gpu_ranks_give_the_tokens_of_one_with_cuda_graphs(tmp_path, kv_heads, custom_all_reduce):
    """All-reduces (the one-shot kernel's, or NCCL's) inside the decode and prefill graphs, and the
    vocabulary split over two GPUs. Each rank rounds its half of o_proj's and down_proj's sums to bf16
    before the all-reduce adds them, a rounding per projection that one GPU does not make: near-ties
    up to 0.15 apart may split differently (a wrong shard or a missing sum diverges at once)."""
    model_dir = build("qwen3", tmp_path, head_dim=128, num_key_value_heads=kv_heads)
    reference = greedy_run(model_dir, attention_backend="flashinfer")
    two = greedy_run(model_dir, attention_backend="flashinfer", tensor_parallel_size=2, custom_all_reduce=custom_all_reduce)
    assert_same_greedy_tokens(reference, two, "two ranks", near_tie=0.15)


@pytest.mark.parametrize(("tokens", "kernel"), [(1, "gemm"), (5, "gemm"), (300, "gemm"), (1, "gemv"), (5, "gemv")])
def test_fused_experts_match_the_grouped_experts(tokens, kernel):
    """The Triton expert GEMMs over sgl-kernel's alignment against the per-expert torch path: one
    token (decode), a few, and more pairs than any block size; and the unsorted GEMV path."""
    pytest.importorskip("sgl_kernel")
    from runtime.kernels.triton.fused_moe import Tiles, fused_experts, tiles_for
    from runtime.models.layers import torch_silu_and_mul
    from runtime.models.moe import Experts, route

    generator = torch.Generator(device="cuda").manual_seed(tokens)
    experts = Experts(64, 256, 96).to("cuda", torch.bfloat16)  # 96: not a whole number of GEMM tiles
    tiles = Tiles(1, 16, 32, kernel="gemv") if kernel == "gemv" else tiles_for(tokens, 64, 96, 8, torch.device("cuda"))
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, 0.05, generator=generator)
        experts.down_proj.normal_(0.0, 0.05, generator=generator)
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16, generator=generator)
        weights, ids = route(torch.randn(tokens, 64, device="cuda", generator=generator), 8, True)
        reference, counts = experts.grouped(x, weights, ids, torch_silu_and_mul)
        load = torch.zeros(64, dtype=torch.int32, device="cuda")
        fused = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids.int(), torch_silu_and_mul, tiles, load)
    error = (fused.float() - reference.float()).norm() / reference.float().norm()
    print(f"fused experts ({kernel}), {tokens} tokens: relative error {error:.2e}")
    assert error < 2e-2
    assert torch.equal(load.long(), counts) and int(counts.sum()) == tokens * 8


def test_fused_experts_take_deepseek_routing(tmp_path):
    """DeepSeek-V3's sparse layer (grouped sigmoid routing, correction bias, shared expert) through the fused
    kernels on CUDA against its per-expert path."""
    pytest.importorskip("sgl_kernel")
    from runtime.config import ModelConfig
    from runtime.models.loader import build_model

    model_dir = build("deepseek_v3", tmp_path, kv_lora_rank=512, qk_rope_head_dim=64)
    model = build_model(ModelConfig.load(model_dir), model_dir, torch.bfloat16, torch.device("cuda"), False)
    sparse = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "e_score_correction_bias"))
    assert sparse.fused is not None and sparse.shared_experts is not None
    x = torch.randn(37, sparse.gate.in_features, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        fused = sparse(x).float()
        sparse.fused = None
        reference = sparse(x).float()
    error = (fused - reference).norm() / reference.norm()
    print(f"DeepSeek's routing through the fused experts: relative error {error:.2e}")
    assert error < 2e-2


def test_moe_decode_and_prefill_graphs_give_the_tokens_of_eager_steps(tmp_path):
    """Qwen3-MoE's fused experts captured in the decode and prefill graphs, against eager steps."""
    pytest.importorskip("sgl_kernel")
    model_dir = build("qwen3_moe", tmp_path, head_dim=128)
    reference = greedy_run(model_dir, attention_backend="torch")
    graphs = greedy_run(model_dir, attention_backend="flashinfer")
    assert_same_greedy_tokens(reference, graphs, "moe graphs")


def test_prefill_graphs_give_the_tokens_of_eager_prefill(tmp_path):
    """Fresh prompts, chunks over a cached prefix, several sequences in a step and smaller steps after
    larger ones (whose rows linger in the static buffers): replayed as prefill graphs, they must give
    eager prefill's tokens, and their padding must write no live sequence's KV (later tokens read it)."""
    model_dir = build("qwen3", tmp_path, head_dim=128)
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (5, 40, 100, 127, 200, 300, 500)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    runs, shapes = {}, []
    for name, max_tokens in (("eager", 0), ("graphs", 3072)):
        llm = LLM(
            model_dir,
            device="cuda",
            dtype="bfloat16",
            attention_backend="flashinfer",
            page_size=PAGE,
            num_pages=1024,
            max_prefill_tokens=256,
            cuda_graph_max_prefill_tokens=max_tokens,
        )
        if max_tokens:
            graphs = llm.engine.prefill_graphs
            replay = graphs.replay
            graphs.replay = lambda shape, batch, replay=replay: (shapes.append(shape), replay(shape, batch))[1]
        runs[name] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    assert any(seqs == 8 for _, seqs in shapes) and len(shapes) >= 5, shapes
    assert_same_greedy_tokens(runs["eager"], runs["graphs"], "prefill graphs")


def test_seeded_sampling_is_batch_invariant_on_cuda(tmp_path):
    """A seeded request's noise is keyed by (seed, position), not by its row: first among fifteen others,
    then last among fifteen different ones of the same lengths, it samples the same tokens. (Alone, it
    may not: the kernels differ by batch size on CUDA, the one-row GEMV among them, so logits can move in
    their last bits and a near-tie go the other way, as in vLLM and SGLang.)"""
    model_dir = build("llama", tmp_path, head_dim=128)
    llm = LLM(model_dir, device="cuda", attention_backend="flashinfer", page_size=PAGE, num_pages=512)
    generator = torch.Generator().manual_seed(4)
    batch, other = ([torch.randint(0, 512, (n,), generator=generator).tolist() for n in range(5, 21)] for _ in range(2))
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    first = llm.generate(batch, params)[0].token_ids
    assert llm.generate([*other[1:], batch[0]], params)[-1].token_ids == first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64])
def test_triton_draw_equals_its_torch_twin(rows, dtype):
    """The kernel reads the logits in the model's dtype; the twin widens them first. Each draw, noisy or
    greedy, twice: the second finds the row counts the first reset."""
    from runtime.engine.sampling import _torch_gumbel_argmax, gumbel_argmax, row_keys

    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(rows, 151_936, generator=generator) * 3).to("cuda", dtype)
    temperatures = torch.tensor([0.6, 0.0, 1.0, 1.7] * 16, device="cuda")[:rows]
    keys = torch.from_numpy(row_keys(list(range(rows)), list(range(100, 100 + rows)))).cuda()
    for _ in range(2):
        assert torch.equal(gumbel_argmax(logits, temperatures, keys), _torch_gumbel_argmax(logits.float(), temperatures, keys))
        assert torch.equal(gumbel_argmax(logits, None, None), logits.float().argmax(dim=-1))


def test_triton_draw_feeds_tokens_back_to_their_slots_and_to_pinned_host_memory():
    """The kernel's own stores: last_tokens at each row's slot on the device, and the pinned host copy,
    which it writes over the bus with no copy on the stream."""
    from runtime.engine.sampling import Feedback, gumbel_argmax

    logits = torch.randn(5, 151_936, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    last_tokens = torch.full((16,), -1, dtype=torch.int64, device="cuda")
    slots = torch.tensor([9, 2, 14, 0, 7], device="cuda")
    host = torch.full((5,), -1, dtype=torch.int64, pin_memory=True)
    tokens = gumbel_argmax(logits, None, None, Feedback(last_tokens, slots, host))
    torch.cuda.synchronize()
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(tokens, expected) and torch.equal(host, expected.cpu())
    assert torch.equal(last_tokens[slots], expected) and (last_tokens[[1, 3, 4, 5, 6, 8, 10, 11, 12, 13, 15]] == -1).all()


def test_host_copy_kernel_sends_pinned_tensors_whole():
    """Two copies of other sizes and dtypes in one launch; the device bytes after each end stay as they were."""
    from runtime.kernels.triton.host_copy import send

    sources = [torch.arange(3 * 1100, dtype=torch.int64).view(3, 1100).pin_memory(), torch.arange(7, dtype=torch.int32).pin_memory()]
    targets = [torch.full((3 * 1100 + 8,), -1, dtype=torch.int64, device="cuda"), torch.full((9,), -1, dtype=torch.int32, device="cuda")]
    send([(sources[0], targets[0][:-8].view(3, 1100)), (sources[1], targets[1][:7])])
    torch.cuda.synchronize()
    assert torch.equal(targets[0][:-8].cpu(), sources[0].flatten()) and (targets[0][-8:] == -1).all()
    assert torch.equal(targets[1][:7].cpu(), sources[1]) and (targets[1][7:] == -1).all()
    single = torch.tensor([5, 6], dtype=torch.int32).pin_memory()
    send([(single, targets[1][7:])])
    torch.cuda.synchronize()
    assert targets[1][7:].tolist() == [5, 6]


@pytest.mark.parametrize("name", ["sgl_kernel", "flashinfer"])
def test_fused_ops_match_torch(name):
    from runtime.config import RopeConfig
    from runtime.models.layers import FUSED_OPS, rope_cos_sin_cache

    try:
        ops = FUSED_OPS[name]()
    except ImportError:
        pytest.skip(f"{name} is not installed")
    reference = FUSED_OPS["torch"]()
    generator = torch.Generator().manual_seed(3)
    bf16 = lambda *shape: torch.randn(*shape, generator=generator).to("cuda", torch.bfloat16)  # noqa: E731

    weight = bf16(1024).abs()
    x, residual = bf16(37, 1024), bf16(37, 1024)
    close(ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), "rms_norm")
    heads = bf16(37, 16, 128)  # per-head q/k norms
    close(ops.rms_norm(heads, weight[:128], 1e-6), reference.rms_norm(heads, weight[:128], 1e-6), "rms_norm per head")
    expected_normed, expected_residual = reference.add_rms_norm(x, residual, weight, 1e-6)
    normed, new_residual = ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    close(normed, expected_normed, "add_rms_norm")
    close(new_residual, expected_residual, "add_rms_norm residual")
    gate_up = bf16(37, 2 * 3072)
    close(ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), "silu_and_mul")

    positions = torch.randint(0, 4000, (37,), generator=generator).cuda()
    cache = rope_cos_sin_cache(4096, 128, RopeConfig(theta=1e6)).cuda()
    cache = cache if name == "flashinfer" else cache.to(torch.bfloat16)  # sgl-kernel's rope takes the activation dtype
    tables = reference.rope_tables(positions, cache.to(torch.bfloat16))
    qk = bf16(37, (16 + 2 * 8) * 128)[:, : 24 * 128].view(37, 24, 128)  # q and k heads of a qkv row, as the model passes them
    expected = qk.clone()
    reference.rope(positions, expected, 16, tables)
    ops.rope(positions, qk, 16, ops.rope_tables(positions, cache))
    close(qk, expected, "rope")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("layout", ["eager", "graph"])
@pytest.mark.parametrize("tokens", [1, 37, 8064])
@pytest.mark.parametrize("heads, kv_heads, norms", [(16, 8, True), (32, 8, True), (32, 8, False)])
def test_rope_kv_write_matches_the_torch_ops(tokens, layout, heads, kv_heads, norms, fp8):
    """The one-pass q/k norm, rope and KV write against the torch reference's norms, rope and
    index_put: q rotated in place, K and V at rows given as [T, 2] (eager steps) or as a transposed
    view of a [2, T] buffer (decode graphs), and every other pool row untouched. An FP8 pool gets K / 0.5
    and V / 2.0, as KVPool.write stores them."""
    from runtime.config import RopeConfig
    from runtime.kernels.triton.rope_kv import rope_kv_write
    from runtime.models.layers import FUSED_OPS, rope_cos_sin_cache

    reference = FUSED_OPS["torch"]()
    generator = torch.Generator().manual_seed(6)
    bf16 = lambda *shape: torch.randn(*shape, generator=generator).to("cuda", torch.bfloat16)  # noqa: E731
    qkv = bf16(tokens, (heads + 2 * kv_heads) * 128)
    positions = torch.randint(0, 4000, (tokens,), generator=generator).cuda()
    cache = rope_cos_sin_cache(4096, 128, RopeConfig(theta=1e6)).cuda()
    q_norm, k_norm = (bf16(128).abs(), bf16(128).abs()) if norms else (None, None)
    pool_rows = 2 * tokens + 64
    picked = torch.randperm(pool_rows, generator=generator)[: 2 * tokens]
    rows = (picked.view(tokens, 2) if layout == "eager" else picked.view(2, tokens).T).cuda()

    qk = qkv[:, : (heads + kv_heads) * 128].view(tokens, heads + kv_heads, 128).clone()
    if norms:
        qk = torch.cat((reference.rms_norm(qk[:, :heads], q_norm, 1e-6), reference.rms_norm(qk[:, heads:], k_norm, 1e-6)), 1)
    reference.rope(positions, qk, heads, reference.rope_tables(positions, cache.to(torch.bfloat16)))
    new_kv = torch.stack((qk[:, heads:].flatten(1), qkv[:, (heads + kv_heads) * 128 :]), 1)
    scales = (0.5, 2.0) if fp8 else (1.0, 1.0)
    if fp8:
        divisors = torch.tensor(scales, device="cuda")[:, None]
        new_kv = (new_kv.float() / divisors).clamp(-448, 448).to(torch.float8_e4m3fn)
    pool = torch.full((pool_rows, kv_heads * 128), 7.0, dtype=torch.bfloat16, device="cuda").to(new_kv.dtype)
    expected = pool.clone()
    expected.view(torch.uint8)[rows] = new_kv.view(torch.uint8)  # byte views: float8 lacks some indexing ops
    got = qkv.clone()
    rope_kv_write(got, positions, cache, q_norm, k_norm, 1e-6, pool, rows, heads, kv_heads, scales)

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    assert error(got[:, : heads * 128], qk[:, :heads].flatten(1)) < 1e-2
    assert error(pool, expected) < (3e-2 if fp8 else 1e-2)  # fp32 vs bf16 rope flips an FP8 rounding (1/8 or 1/16) now and then
    untouched = torch.ones(pool_rows, dtype=torch.bool)
    untouched[picked] = False
    assert torch.equal(pool.view(torch.uint8)[untouched.cuda()], expected.view(torch.uint8)[untouched.cuda()])
    assert torch.equal(got[:, heads * 128 :], qkv[:, heads * 128 :])  # K and V rows of qkv are left as they came


def kernels_built_while_serving(model_dir: str, graphs: dict[str, int]) -> list[str]:
    """In a fresh process (earlier tests' builds stay in theirs): start an engine, then serve what a
    server sees, recording each Triton kernel variant built meanwhile."""
    from triton import knobs

    llm = LLM(model_dir, device="cuda", attention_backend="flashinfer", page_size=PAGE, num_pages=512, **graphs)
    built: list[str] = []
    knobs.runtime.jit_post_compile_hook = lambda **info: built.append(info["repr"])
    for n in (1, 7, 16, 37):  # prefills of every alignment
        llm.generate([list(range(3, 3 + n))], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    kinds = ({"temperature": 0}, {"temperature": 0.7}, {"temperature": 0, "logprobs": 2}, {"top_p": 0.9}, {"repetition_penalty": 1.2})
    shared = list(range(3, 40))
    for kind in kinds:  # each kind of draw, alone and among twenty; after the first, over a cached prefix
        for batch in ([shared], [shared + [i] for i in range(20)]):
            llm.generate(batch, SamplingParams(max_tokens=4, seed=1, ignore_eos=True, **kind))
    return built


@pytest.mark.parametrize(
    "graphs",
    [
        {"cuda_graph_max_bs": 0, "cuda_graph_max_prefill_tokens": 0},  # every step eager
        {"cuda_graph_max_bs": 31},  # an odd width once left the graphs' slots row unaligned for the draw
    ],
)
def test_serving_builds_no_triton_kernel_after_start_up(tmp_path, graphs):
    """Triton builds a kernel variant per argument class on first use, and one built mid-serving
    stalls its step: the rope and KV write once stalled a prefill 87 ms on the H200, and a first
    greedy draw after sampled ones waited 100 ms. Start-up's warm-up builds every variant serving
    takes."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    model_dir = str(build("qwen3", tmp_path, head_dim=128))
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as fresh:  # a dead child raises, not hangs
        built = fresh.submit(kernels_built_while_serving, model_dir, graphs).result()
    assert not built, built


def test_a_dropped_llm_gives_its_device_memory_back(tmp_path):
    """As on CPU (test_engine_core): start-up freezes the LLM out of the collector's reach, so nothing the
    CUDA path adds (graphs, flashinfer's wrappers, few-row kernels, pinned staging) may hold it in a cycle."""
    import gc
    import weakref

    model_dir = build("qwen3", tmp_path, head_dim=128)
    gc.collect()
    before = torch.cuda.memory_allocated()
    llm = LLM(model_dir, device="cuda", attention_backend="flashinfer", page_size=PAGE, num_pages=512)
    llm.generate([list(range(3, 40)), [5, 6]], SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True))
    held = torch.cuda.memory_allocated() - before
    engine = weakref.ref(llm.engine)
    del llm
    left = torch.cuda.memory_allocated() - before
    print(f"an LLM held {held / 2**20:.1f} MiB of device memory; {left / 2**20:.1f} MiB stayed after it was dropped")
    assert engine() is None and left < held / 100


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    error = (got.float() - want.float()).norm() / want.float().norm()
    assert error < 1e-2, (what, float(error))


def test_few_row_linears_match_cublas():
    """tinygemm, forced at every row count it may take, and the one-row GEMV, with and without a bias;
    then the timed swap keeps a model's outputs and takes a kernel only within its row limit."""
    from torch import nn

    from runtime.engine.gemm_tuner import FewRowLinear, _candidates, _gemv_kernels, load_tinygemm, use_few_row_gemms

    cuda = torch.device("cuda")
    tinygemm, gemv_kernel = load_tinygemm(cuda, torch.bfloat16), _gemv_kernels(cuda, torch.bfloat16)
    assert gemv_kernel is not None, "Triton ships with CUDA builds of torch"
    torch.manual_seed(8)
    model = nn.Sequential(
        nn.Linear(2048, 1024, bias=False),
        nn.Linear(1024, 2048, bias=True),
        nn.Linear(2048, 1024, bias=False),
        nn.Linear(1024, 96, bias=False),
    ).to(cuda, torch.bfloat16)
    row_counts = [1, 2, 4, 8, 16, 32]
    inputs = {rows: torch.randn(rows, 2048, device=cuda, dtype=torch.bfloat16) for rows in row_counts}
    expected = {rows: model(x) for rows, x in inputs.items()}
    for name in ("tinygemm", *("gemv{}x{}".format(*tile) for tile in gemv_kernel.TILES)):
        for linear in model[:2]:
            kernels = {
                rows: run for rows in row_counts if (run := _candidates(linear.weight, rows, tinygemm, gemv_kernel).get(name)) is not None
            }
            if not kernels:
                continue
            forced = FewRowLinear(linear, kernels)
            for rows in kernels:
                x = torch.randn(rows, linear.in_features, device=cuda, dtype=torch.bfloat16)
                close(forced(x), linear(x), f"{name}: {linear} at {rows} rows")
            graph = torch.cuda.CUDAGraph()  # as decode runs it: captured, then replayed on new rows
            with torch.cuda.graph(graph):
                captured = forced(x)
            x.copy_(torch.randn_like(x))
            graph.replay()
            close(captured, linear(x), f"{name}: {linear} in a CUDA graph")
    chosen = use_few_row_gemms(model, row_counts, cuda, torch.bfloat16)
    linears_of_shape = {"1024x2048": 2, "2048x1024": 1, "96x1024": 1}
    assert sum(isinstance(m, FewRowLinear) for m in model) == sum(linears_of_shape[shape] for shape in chosen), chosen
    assert all(rows <= 16 and (kernel == "tinygemm" or rows == 1) for won in chosen.values() for rows, kernel in won.items()), chosen
    for rows, x in inputs.items():
        close(model(x), expected[rows], f"swapped model at {rows} rows")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n, k", [(4096, 1024), (1024, 3072), (96, 64), (6, 512)])
def test_one_row_gemv_matches_torch(n, k, bias):
    """Each prologue of runtime.kernels.triton.gemv against the torch ops it replaces, in bf16: plain, RMSNorm,
    residual add + RMSNorm (and the new residual it writes), SiLU-and-mul; and the epilogue's add."""
    import torch.nn.functional as F

    from runtime.kernels.triton import gemv as g

    generator = torch.Generator().manual_seed(n + k)
    rand = lambda *shape: torch.randn(*shape, generator=generator).to("cuda", torch.bfloat16)  # noqa: E731
    weight, h, residual, gate_up = rand(n, k) * 0.05, rand(1, k), rand(1, k), rand(1, 2 * k)
    linear = torch.nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
    linear.weight.data.copy_(weight)
    norm = type("Norm", (), {"weight": torch.rand(k, generator=generator).to("cuda", torch.bfloat16) + 0.5, "eps": 1e-6})()
    rms = lambda x: F.rms_norm(x.float(), (k,), norm.weight.float(), norm.eps)  # noqa: E731
    added = (h.float() + residual.float()).to(torch.bfloat16)
    silu = (F.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()).to(torch.bfloat16)
    assert g.tiles(n, k)
    for tile in g.tiles(n, k):
        close(g.gemv(h, linear.weight, linear.bias, tile)[0], linear(h), f"plain {tile}")
        out, kept = g.norm_linear(h, None, norm, linear, tile)
        close(out, linear(rms(h).to(torch.bfloat16)), f"norm {tile}")
        assert kept is h
        out, new_residual = g.norm_linear(h, residual, norm, linear, tile)
        assert torch.equal(new_residual, added)
        close(out, linear(rms(added).to(torch.bfloat16)), f"add + norm {tile}")
        close(g.silu_linear(gate_up, linear, tile=tile), linear(silu), f"silu-and-mul {tile}")
        stream = rand(1, n)  # a block's end: the residual add in the epilogue, in bf16 as torch adds
        close(g.silu_linear(gate_up, linear, stream, tile=tile), linear(silu) + stream, f"silu-and-mul + add {tile}")
        close(g.linear_add(h, linear, stream, tile=tile), linear(h) + stream, f"plain + add {tile}")


@pytest.mark.parametrize("stream", [False, True])
def test_one_row_fusion_gives_the_tokens_of_torch_attention(tmp_path, monkeypatch, stream):
    """Start-up times each one-row kernel against cuBLAS, each fused norm→projection against the pair, and
    the summed stream against those choices; here the GEMV and every fusion are forced, with or without
    the summed stream, and one request at a time (batch-1 decode graphs) must give the torch
    reference's greedy tokens."""
    from runtime.engine import gemm_tuner as few_row_gemm

    model_dir = build("qwen3", tmp_path, head_dim=128)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (3, 40, 90)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)

    def alone(attention_backend: str) -> list[tuple[list[int], list[dict[int, float]]]]:
        llm = LLM(model_dir, device="cuda", dtype="bfloat16", attention_backend=attention_backend, page_size=PAGE, num_pages=512)
        if attention_backend == "flashinfer":
            layer = llm.engine.model.model.layers[0]
            assert None not in (layer.one_row.qkv, layer.one_row.gate_up, layer.one_row.down), layer.one_row
            assert (layer.one_row.o_proj is not None) == stream, layer.one_row
            assert 1 in layer.self_attn.o_proj.kernels and 1 in llm.engine.model.lm_head.kernels
        return [(o.token_ids, o.logprobs) for p in prompts for o in llm.generate([p], params)]

    reference = alone("torch")
    monkeypatch.setattr(
        few_row_gemm,
        "_winner",
        lambda times, baseline, *margin: next(
            (way for way in times if way.startswith(("gemv", "fused")) and (stream or way != "fused stream")), baseline
        ),
    )
    monkeypatch.setattr(few_row_gemm, "_fastest", lambda times: next(iter(times)))
    assert_same_greedy_tokens(reference, alone("flashinfer"), "one-row GEMV and fusions" + " (summed stream)" * stream)


def test_programmatic_dependent_launch_changes_no_bit_of_decode(tmp_path, monkeypatch):
    """With the one-row kernels, every fusion and the split-KV attention forced, a batch-1 decode graph
    chains Triton kernels launched with PDL, each started before the one ahead of it ends. A kernel
    that touched another's data before its wait would race: 64 tokens of three requests, alone, must
    come out bit for bit as without PDL."""
    from runtime.engine import cuda_graph
    from runtime.engine import gemm_tuner as few_row_gemm
    from runtime.kernels.triton import pdl

    if not pdl.enabled(torch.cuda.current_device()):
        pytest.skip("PDL needs compute capability 9 or later")
    model_dir = build("qwen3", tmp_path, head_dim=128)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (5, 70, 300)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=3)
    monkeypatch.setattr(
        few_row_gemm,
        "_winner",
        lambda times, baseline, *margin: next((way for way in times if way.startswith(("gemv", "fused"))), baseline),
    )
    monkeypatch.setattr(few_row_gemm, "_fastest", lambda times: next(iter(times)))  # the summed stream's tiles: both runs alike
    monkeypatch.setattr(cuda_graph, "fastest", lambda graphs: "triton")

    def alone() -> list[tuple[list[int], list[dict[int, float]]]]:
        llm = LLM(
            model_dir, device="cuda", dtype="bfloat16", attention_backend="flashinfer", page_size=PAGE, num_pages=512, cuda_graph_max_bs=16
        )
        assert llm.engine.graphs.attention_kernels[1] == "triton", llm.engine.graphs.attention_kernels
        return [(o.token_ids, o.logprobs) for p in prompts for o in llm.generate([p], params)]

    with_pdl = alone()
    monkeypatch.setattr(pdl, "enabled", lambda device_index: False)
    assert alone() == with_pdl


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 8, 16])
@pytest.mark.parametrize("shapes", [[(1, 2000)], [(1, 50), (1, 2000), (1, 1), (1, 17), (1, 300)]])
def test_triton_decode_attention_matches_torch(shapes, kv_heads, fp8):
    """Sequences of 1 to 2,000 tokens on scattered pages (bf16, or FP8 with K and V scales), query heads
    read from a strided qkv view, into an output poisoned with NaN: every row must be written."""
    from runtime.kernels.triton.decode_attention import decode_attention

    generator = torch.Generator().manual_seed(kv_heads)
    batch = paged_batch(shapes, generator)
    tokens = len(batch.positions)
    qkv = torch.randn(tokens, HEADS + 2 * kv_heads, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    pool = make_pool(kv_heads, fp8)
    pool.kv[0].copy_(torch.randn(pool.kv[0].shape, generator=generator))
    reference = ATTENTION_BACKENDS["torch"](pool, HEADS, AttentionSpec(HEAD_DIM**-0.5))
    reference.prepare(batch.meta)
    want = reference.forward(0, qkv[:, :HEADS], batch).float()
    device = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    got = decode_attention(
        qkv[:, :HEADS],
        pool.kv[0],
        device(batch.meta.kv_indptr),
        device(batch.meta.kv_indices),
        device(batch.meta.kv_lens),
        HEAD_DIM**-0.5,
        torch.full_like(qkv[:, :HEADS], float("nan")),
        kv_scales=pool.scales[0],
    )
    error = (got.float() - want).norm() / want.norm()
    print(f"triton decode vs torch attention, fp8 pages {fp8}, {kv_heads} kv heads, {shapes}: relative error {error:.2e}")
    assert error < 1e-2


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads, kv_heads, norms", [(16, 8, True), (32, 8, True), (32, 8, False)])
def test_triton_decode_attention_folds_in_the_rope_pass(heads, kv_heads, norms, fp8):
    """Given the raw qkv rows, the split-KV kernel norms and rotates q and writes each sequence's new K
    and V itself (into bf16 pages, or FP8 ones with scales): the same output and pool as
    runtime.kernels.triton.rope_kv's pass and then the plain kernel, and the qkv rows left as they were."""
    from runtime.config import RopeConfig
    from runtime.kernels.rope import Rope
    from runtime.kernels.triton.decode_attention import decode_attention
    from runtime.kernels.triton.rope_kv import rope_kv_write
    from runtime.models.layers import rope_cos_sin_cache

    generator = torch.Generator().manual_seed(heads + kv_heads + norms)
    batch = paged_batch([(1, 2000), (1, 50), (1, 1), (1, 17), (1, 300)], generator)
    tokens = len(batch.positions)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16)
    cache = rope_cos_sin_cache(4096, HEAD_DIM, RopeConfig(theta=1e6)).cuda()
    q_norm, k_norm = (torch.rand(2, HEAD_DIM, generator=generator).to("cuda", torch.bfloat16) + 0.5) if norms else (None, None)
    pool = make_pool(kv_heads, fp8)
    pool.kv[0].copy_(torch.randn(pool.kv[0].shape, generator=generator))
    device = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
    lists = (device(batch.meta.kv_indptr), device(batch.meta.kv_indices), device(batch.meta.kv_lens))
    scales = pool.scales[0]
    untouched, two_pass_pool = qkv.clone(), pool.kv[0].clone()

    rotated = qkv.clone()
    rope_kv_write(
        rotated.view(tokens, -1),
        batch.positions,
        cache,
        q_norm,
        k_norm,
        1e-6,
        two_pass_pool.view(-1, kv_heads * HEAD_DIM),
        batch.kv_rows,
        heads,
        kv_heads,
        scales,
    )
    out = lambda: torch.empty_like(qkv[:, :heads])  # noqa: E731
    want = decode_attention(rotated[:, :heads], two_pass_pool, *lists, HEAD_DIM**-0.5, out(), kv_scales=scales)
    got = decode_attention(qkv, pool.kv[0], *lists, HEAD_DIM**-0.5, out(), Rope(cache, q_norm, k_norm, 1e-6), scales)
    close(got, want, "output")
    rows, (got_rows, want_rows) = batch.kv_rows.flatten(), (kv.view(-1, kv_heads * HEAD_DIM) for kv in (pool.kv[0], two_pass_pool))
    picked = lambda pool_rows: pool_rows.view(torch.uint8)[rows].view(pool_rows.dtype)  # noqa: E731
    close(picked(got_rows), picked(want_rows), "the new K and V")
    others = torch.ones(len(got_rows), dtype=torch.bool, device="cuda")
    others[rows] = False
    assert torch.equal(got_rows.view(torch.uint8)[others], want_rows.view(torch.uint8)[others])
    assert torch.equal(qkv, untouched)


def test_decode_graphs_on_triton_attention_give_the_tokens_of_torch_attention(tmp_path, monkeypatch):
    """Start-up times both attention kernels at every graph size up to 16 and keeps the faster; here
    the split-KV kernel is forced at all of them, and greedy tokens must be the torch reference's."""
    from runtime.engine import cuda_graph

    model_dir = build("qwen3", tmp_path, head_dim=128)
    reference = greedy_run(model_dir, attention_backend="torch")
    chosen = {}
    llm = LLM(model_dir, device="cuda", attention_backend="flashinfer", page_size=PAGE, num_pages=512, cuda_graph_max_bs=32)
    assert sorted(llm.engine.graphs.attention_kernels) == [1, 2, 4, 8, 16], llm.engine.graphs.attention_kernels
    monkeypatch.setattr(cuda_graph, "fastest", lambda graphs: chosen.setdefault(len(chosen), "triton"))
    triton = greedy_run(model_dir, attention_backend="flashinfer", cuda_graph_max_bs=32)
    assert len(chosen) == 5
    assert_same_greedy_tokens(reference, triton, "triton decode attention in CUDA graphs")


def test_fp8_gemm_kernels_match_the_dequantized_weight():
    """Every FP8 kernel start-up may choose (the Triton GEMM at each tile, W8A16 and W8A8, flashinfer's
    block-scaled GEMM where the shape allows, the one-row GEMV) against F.linear over the dequantized weight: 128 x 128
    blocks, partial blocks, scales per row, a bias; one row to a prefill's worth."""
    import torch.nn.functional as F
    from torch import nn

    from runtime.engine.gemm_tuner import _fp8_candidates
    from runtime.models.fp8 import Fp8Linear, dequantize_blockwise

    generator = torch.Generator().manual_seed(8)
    for n, k, block, bias in [(4096, 4096, (128, 128), False), (200, 96, (128, 128), True), (1000, 1536, (1, 1536), False)]:
        linear = nn.Linear(k, n, bias=bias)
        with torch.no_grad():  # blocks of very different magnitudes: a misread scale cannot hide
            spread = torch.randn(-(-n // block[0]), -(-k // block[1]), generator=generator).exp()
            linear.weight *= spread.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        linear = linear.to("cuda", torch.bfloat16)
        fp8 = Fp8Linear(linear, block)
        weight = dequantize_blockwise(fp8.weight, fp8.weight_scale, block)
        for rows in (1, 7, 64, 300):
            x = torch.randn(rows, k, generator=generator).to("cuda", torch.bfloat16)
            want = F.linear(x.float(), weight, None if linear.bias is None else linear.bias.float())
            for name, kernel in _fp8_candidates(fp8, rows).items():  # FP8 activations cost ~3% on random inputs
                error = float((kernel(x, fp8).float() - want).norm() / want.norm())
                assert error < (1e-2 if name.startswith(("w8a16", "gemv")) else 5e-2), (name, n, k, block, rows, error)


def test_fp8_checkpoint_on_cuda_gives_the_tokens_of_its_dequantized_weights(tmp_path, monkeypatch):
    """A block-quantized FP8 checkpoint runs its projections as Fp8Linear (one byte a weight, FP8 GEMMs
    chosen at start-up) and, with bf16 activations, gives the greedy tokens of the bf16 model of its
    dequantized weights, up to near-ties 0.15 apart: the W8A16 kernels scale the FP8 weight in fp32 where the
    reference's weight was rounded to bf16 once (a split at a 0.125 gap was seen on an H100). (This model's
    logits are large enough that the FP8-activation kernels' ~3% rounding flips tokens;
    test_fp8_gemm_kernels_match_the_dequantized_weight bounds their error.)"""
    from safetensors.torch import load_file, save_file

    from runtime.engine import gemm_tuner
    from runtime.models.fp8 import Fp8Linear
    from tests.test_fp8 import quantize_checkpoint

    source = build("qwen3", tmp_path / "source", head_dim=128, hidden_size=256, intermediate_size=384)
    weights, generator = load_file(source / "model.safetensors"), torch.Generator().manual_seed(9)
    for name, weight in weights.items():  # 128 x 128 blocks of different magnitudes: a misread scale shows
        if name.endswith("proj.weight"):
            spread = (0.5 * torch.randn(-(-weight.shape[0] // 128), -(-weight.shape[1] // 128), generator=generator)).exp()
            weight *= spread.repeat_interleave(128, 0)[: weight.shape[0]].repeat_interleave(128, 1)[:, : weight.shape[1]]
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    quantize_checkpoint(source, tmp_path / "fp8", tmp_path / "dequantized")
    reference = greedy_run(tmp_path / "dequantized", attention_backend="flashinfer")
    all_kernels = gemm_tuner._fp8_candidates
    monkeypatch.setattr(gemm_tuner, "_fp8_candidates", lambda *a: {k: f for k, f in all_kernels(*a).items() if k.startswith("w8a16")})
    llm = LLM(tmp_path / "fp8", device="cuda", dtype="bfloat16", page_size=PAGE, num_pages=512, max_prefill_tokens=32)
    assert sum(isinstance(module, Fp8Linear) for module in llm.engine.model.modules()) == 4 * llm.engine.model_config.num_layers
    assert_same_greedy_tokens(reference, greedy_tokens(llm), "FP8 GEMMs with bf16 activations", near_tie=0.15)


def test_fp8_kv_cache_on_cuda_gives_the_tokens_of_torch_attention_over_it(tmp_path):
    """FP8 pages written by the rope pass (or the split-KV kernel) and read by flashinfer's prefill and
    decode and by the split-KV kernel, eager and in CUDA graphs, against torch attention dequantizing
    the same pages."""
    model_dir = build("qwen3", tmp_path, head_dim=128)
    reference = greedy_run(model_dir, attention_backend="torch", kv_cache_dtype="fp8_e4m3")
    no_graphs = {"cuda_graph_max_bs": 0, "cuda_graph_max_prefill_tokens": 0}
    eager = greedy_run(model_dir, attention_backend="flashinfer", kv_cache_dtype="fp8_e4m3", **no_graphs)
    assert_same_greedy_tokens(reference, eager, "flashinfer over FP8 pages", most=4)  # FP8 keys make exact ties common
    graphs = greedy_run(model_dir, attention_backend="flashinfer", kv_cache_dtype="fp8_e4m3")
    assert_same_greedy_tokens(reference, graphs, "FP8 pages in CUDA graphs", most=4)


@pytest.mark.parametrize("scattered", ["sgl-kernel", "torch"])
def test_tier_copies_wait_for_the_forward_before_them_and_each_layer_waits_for_its_own(scattered, monkeypatch):
    """The copy stream's stores read what the device's stream wrote before them, though that was slow to come;
    a load's layer is in the pool once the device's stream has waited for it. Pages in a row and pages apart."""
    from runtime.engine import kv_tiers
    from runtime.step import KVMove

    if scattered == "torch":
        monkeypatch.setattr(kv_tiers, "_sgl_copier", lambda: None)
    elif kv_tiers._sgl_copier() is None:  # pyright: ignore[reportPrivateUsage]
        pytest.skip("sgl-kernel's page transfer is not installed")
    layers = 4
    device_pages, host_pages, loaded = [*range(8), 20, 23, 26], [*range(10, 18), 30, 33, 36], [*range(40, 48), 50, 52, 54]
    pool = KVPool(layers, 64, PAGE, 8, HEAD_DIM, torch.bfloat16, torch.device("cuda"))
    tier = kv_tiers.HostTier(pool, 40, None, None)
    assert tier.copies == f"runs + {scattered}"
    late = [torch.randn_like(pool.kv[layer][device_pages]) for layer in range(layers)]
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    for _ in range(20):  # the device's stream is still busy when the copies are queued
        busy = busy @ busy / 64
    for layer in range(layers):
        pool.kv[layer][device_pages] = late[layer]
    keys = [bytes([page]) * 16 for page in device_pages]
    tier.run([KVMove("store", device_pages, host_pages, keys, bytes(16), 0, [7] * len(keys) * PAGE)])
    waits = tier.run([KVMove("load", loaded, host_pages)])
    assert waits is not None
    landed = []
    for layer in range(layers):
        waits.layer(layer)
        landed.append(pool.kv[layer][loaded].clone())
    torch.cuda.synchronize()
    for layer in range(layers):
        assert torch.equal(tier.pool.kv[layer][host_pages], late[layer].cpu())
        assert torch.equal(landed[layer], late[layer])
    tier.finish_stores(wait=True)
    assert tier.index.valid[host_pages].all() and tier.index.valid.sum() == len(host_pages)


def test_the_host_tier_on_cuda_changes_no_token(tmp_path):
    """Conversations through a device pool too small for them, with the tiers' copies on their own stream, eager
    and in graphs: the tokens of the same conversations with no prefix cache."""
    from tests.test_kv_tiers import SMALL_POOL, conversations

    model_dir = build("llama", tmp_path)
    options = {**SMALL_POOL, "attention_backend": "torch", "device": "cuda"}
    uncached = conversations(LLM(model_dir, **options, enable_prefix_cache=False))[0]
    llm = LLM(model_dir, **options, hierarchical_cache=True, hicache_ratio=8)
    answers, _ = conversations(llm)
    assert llm.scheduler.tier_hits["host"] > 0
    assert answers == uncached


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_eagle_heads_on_cuda_change_no_token(tmp_path, kind):
    """An EAGLE head drafts for the tiny model on CUDA (flashinfer, graphs for plain steps; under deterministic
    inference a verify row's logits are a decode's bit for bit): the tokens of plain decoding."""
    from tests.tiny_models import build_eagle_head

    model_dir = build("llama", tmp_path / "target", hidden_size=256, intermediate_size=512)  # head dim 64: FA3's, for deterministic
    head = build_eagle_head(kind, model_dir, tmp_path / kind)
    prompts = [[int(t) for t in np.random.default_rng(n).integers(3, 500, n)] for n in (20, 33, 7)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    options = {"device": "cuda", "deterministic": True, "num_pages": 256}
    plain = LLM(model_dir, **options).generate(prompts, params)
    llm = LLM(model_dir, **options, speculative_algorithm=kind, speculative_draft_model_path=str(head))
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.engine.speculation.steps > 0


@pytest.mark.parametrize(("deterministic", "kernel"), [(False, "timed"), (False, "triton"), (True, "timed")])
def test_verify_and_catch_up_chunks_in_decode_graphs_give_the_tokens_of_plain_decoding(tmp_path, monkeypatch, deterministic, kernel):
    """A verify step's chunk and a draft model's catch-up run in decode graphs, each row attending as a sequence
    of its own after every row's K and V is written: STANDALONE drafting with the target itself keeps nearly every
    draft token and gives plain decoding's tokens (bit for bit under deterministic inference, else but for
    near-ties split differently by kernels of other batch sizes). `triton`: the split-KV kernel forced at every
    size, so that chunk steps run its graphs that attend after the rope pass."""
    from runtime.engine import cuda_graph

    if kernel == "triton":
        monkeypatch.setattr(cuda_graph, "fastest", lambda graphs: "triton" if "triton" in graphs else next(iter(graphs)))
    model_dir = build("qwen3", tmp_path, head_dim=128)
    options = {"device": "cuda", "dtype": "bfloat16", "page_size": PAGE, "num_pages": 512, "deterministic": deterministic}
    plain = greedy_tokens(LLM(model_dir, **options))
    llm = LLM(model_dir, **options, speculative_algorithm="STANDALONE", speculative_draft_model_path=str(model_dir))
    if kernel == "triton":
        graphs = llm.engine.graphs
        assert graphs is not None and sorted(graphs.in_order) == [1, 2, 4, 8, 16], graphs
    verifies = []  # per target step that verifies drafts: did a decode graph run it?
    host_step = llm.engine._host_step
    llm.engine._host_step = lambda *args: (step := host_step(*args), step.drafts and verifies.append(step.row_seqs))[0]
    drafted = greedy_tokens(llm)
    stats = llm.engine.speculation
    assert len(verifies) > 4 and sum(verifies) >= len(verifies) - 1 and stats.kept >= 0.9 * stats.drafted
    if deterministic:
        assert [tokens for tokens, _ in drafted] == [tokens for tokens, _ in plain]
    else:
        assert_same_greedy_tokens(plain, drafted, "verify in decode graphs")


def test_a_weak_draft_model_drafting_ahead_of_each_verify_changes_no_token(tmp_path):
    """A draft model of the target's first layer drafts 4 tokens a step: of the catch-up and branches queued behind
    each verify, the next draft takes one branch's draws, and none where a request ends (their pinned draws are
    held until written). The tokens stay plain decoding's but for near-ties."""
    model_dir = build("qwen3", tmp_path / "target", head_dim=128)
    draft_dir = build("qwen3", tmp_path / "draft", head_dim=128, num_hidden_layers=1)
    options = {"device": "cuda", "dtype": "bfloat16", "page_size": PAGE, "num_pages": 512}
    plain = greedy_tokens(LLM(model_dir, **options))
    drafting = {"speculative_draft_model_path": str(draft_dir), "speculative_num_draft_tokens": 4}
    llm = LLM(model_dir, **options, speculative_algorithm="STANDALONE", **drafting)
    for _ in range(3):
        drafted = greedy_tokens(llm)
        assert_same_greedy_tokens(plain, drafted, "weak draft model")
    assert llm.engine.speculation.drafted > 0
