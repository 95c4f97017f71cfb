"""EAGLE and EAGLE-3 draft heads (--speculative-algorithm EAGLE|EAGLE3): random heads saved in their published
layouts load, draft by the head's own arithmetic over the target's features, and change no token of plain
decoding (runtime.models.eagle, runtime.engine.engine.EagleDraft)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from runtime import LLM, SamplingParams

SEEDED = SamplingParams(max_tokens=40, temperature=0.8, top_k=50, seed=5, ignore_eos=True)


@pytest.mark.parametrize(
    "kind, draft_vocab", [("EAGLE", None), ("EAGLE3", 200), ("EAGLE3", None)], ids=["EAGLE", "EAGLE3", "EAGLE3-full-vocab"]
)
def test_eagle_heads_load_from_their_published_layouts_and_change_no_token(tiny_model, tmp_path, kind, draft_vocab):
    """Random EAGLE and EAGLE-3 heads, saved as the published ones are (an EAGLE-3 head over a draft vocabulary with
    its id map, or over the whole one without), draft for the tiny Llama: their weights are the checkpoint's, and
    the output is plain decoding's, greedy and seeded."""
    from safetensors.torch import load_file

    from tests.tiny_models import build_eagle_head

    model = tiny_model("llama")
    head_dir = build_eagle_head(kind, model, tmp_path / kind, draft_vocab=draft_vocab)
    prompts = [[random.Random(n).randrange(3, 500) for _ in range(n)] for n in (20, 33, 7)]
    for params in (SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), SEEDED):
        plain = LLM(model, dtype="float32", page_size=4).generate(prompts, params)
        llm = LLM(model, dtype="float32", page_size=4, speculative_algorithm=kind, speculative_draft_model_path=str(head_dir))
        spec = llm.generate(prompts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        stats = llm.engine.speculation
        assert stats.steps > 0 and stats.drafted > 3 * stats.steps
    drafter = llm.engine.drafter
    assert drafter is not None
    head = drafter.engine.model
    stored = torch.load(head_dir / "pytorch_model.bin") if kind == "EAGLE" else load_file(head_dir / "model.safetensors")
    assert torch.equal(head.fc.weight, stored["fc.weight"])
    assert head.model.embed_tokens is llm.engine.model.model.embed_tokens  # the target's, not a copy
    if kind == "EAGLE3":
        assert torch.equal(head.d2t, stored["d2t"] if draft_vocab else torch.zeros(512, dtype=torch.int64))
        assert llm.engine.model.capture == (1, 1, 2)


def reference_drafts(kind: str, target: Path, head_dir: Path, prompt: list[int], drawn: int, count: int) -> list[int]:
    """The head's greedy drafts after a prefill of `prompt` that drew `drawn`, computed whole in torch from the
    checkpoints and transformers' target (its hidden states as features): rows 0..n-1 read the prompt's next
    token and the target's feature, each row after reads the draft before it and the feature the row before
    handed on."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv

    hf = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    cfg = hf.config
    w = torch.load(head_dir / "pytorch_model.bin") if kind == "EAGLE" else load_file(head_dir / "model.safetensors")
    w = {k.removeprefix("layers.0.").removeprefix("midlayer."): v for k, v in w.items()}
    heads, kv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        features = states[-1][0] if kind == "EAGLE" else torch.cat([states[1][0]] * 3, dim=-1)  # EAGLE3 reads layers 1, 1, 1
        features = features if kind == "EAGLE" else features @ w["fc.weight"].T
        tokens, drafts = [*prompt[1:], drawn], []
        for _ in range(count):
            n = len(tokens)
            emb = hf.get_input_embeddings()(torch.tensor(tokens))
            if kind == "EAGLE":
                x = torch.cat([emb, features], -1) @ w["fc.weight"].T + w["fc.bias"]
                pair, residual = x, x
            else:
                pair, residual = torch.cat([norm(emb, w["input_layernorm.weight"]), norm(features, w["hidden_norm.weight"])], -1), features
            q, k, v = ((pair @ w[f"self_attn.{p}_proj.weight"].T).view(1, n, -1, dim).transpose(1, 2) for p in ("q", "k", "v"))
            cos, sin = LlamaRotaryEmbedding(cfg)(v, torch.arange(n)[None])
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k, v = repeat_kv(k, heads // kv), repeat_kv(v, heads // kv)
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = residual + attended.transpose(1, 2).reshape(n, -1) @ w["self_attn.o_proj.weight"].T
            m = norm(h, w["post_attention_layernorm.weight"])
            gated = torch.nn.functional.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)
            out = h + gated @ w["mlp.down_proj.weight"].T
            if kind == "EAGLE":
                token = int(hf.lm_head(out[-1]).argmax())
            else:
                best = int((norm(out[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
                token = best + int(w["d2t"][best])
            drafts.append(token)
            tokens, features = [*tokens, token], torch.cat([features[:n], out[-1:]])
    return drafts


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_an_eagle_heads_drafts_are_the_heads_own_arithmetic(tiny_model, tmp_path, kind):
    """The drafts of the first verify step equal the head's arithmetic done whole in torch over transformers'
    hidden states: the features reach the rows they belong to, and each draft row reads the one before."""
    from tests.tiny_models import build_eagle_head

    model = tiny_model("llama")
    head_dir = build_eagle_head(kind, model, tmp_path / kind, aux_layers=(0, 0, 0))
    prompt = [random.Random(1).randrange(3, 500) for _ in range(19)]
    llm = LLM(model, dtype="float32", page_size=4, speculative_algorithm=kind, speculative_draft_model_path=str(head_dir))
    drafter = llm.engine.drafter
    assert drafter is not None
    seen = []
    draft = drafter.draft
    drafter.draft = lambda plan, targets: seen.append(draft(plan, targets)) or seen[-1]  # pyright: ignore[reportAttributeAccessIssue]
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    plan, drafted = next((plan, drafted) for plan, drafted in seen if any(chunk.drafts for chunk in plan.chunks))
    (verify,) = plan.chunks
    assert verify.token_ids[0] == output.token_ids[0]
    assert drafted is not None and drafted.tokens.tolist() == reference_drafts(kind, model, head_dir, prompt, output.token_ids[0], 4)


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_an_eagle_head_catches_up_in_prefill_sized_steps_and_redoes_rows_read_before_their_features(tiny_model, tmp_path, kind):
    """Requests through a pool so small that some are preempted and prefill again, the last chunk of that carrying
    a draft: the head's catch-up steps stay within --max-prefill-tokens, a head row read with a zero feature whose
    target feature came with that step is redone with it at the next draft, and the output is plain decoding's."""
    from runtime.engine.engine import EagleDraft
    from tests.tiny_models import build_eagle_head

    model = tiny_model("llama")
    head_dir = build_eagle_head(kind, model, tmp_path / kind)
    prompts = [[random.Random(n).randrange(3, 500) for _ in range(n)] for n in (30, 31, 32, 33, 29, 40)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    options = dict(dtype="float32", page_size=4, num_pages=40, max_prefill_tokens=16)
    plain = LLM(model, **options).generate(prompts, params)
    llm = LLM(model, **options, speculative_algorithm=kind, speculative_draft_model_path=str(head_dir))
    drafter = llm.engine.drafter
    assert isinstance(drafter, EagleDraft)
    rows, zeros, features = [], {}, {}  # per head step; slot -> positions read with a zero feature; slot -> positions given
    launch, catch_up, take, mirror = drafter.engine.launch, drafter._catch_up, drafter.take_features, drafter.mirror

    def counting_launch(plan):
        rows.append(sum(len(c.token_ids) for c in plan.chunks))
        return launch(plan)

    def watched_catch_up(slot, target):
        tokens, given = catch_up(slot, target)
        begin = int(drafter.engine.lengths[slot])
        assert given is not None
        blank = {begin + i for i, row in enumerate(given) if not row.any()}
        read = set(range(begin, begin + len(given))) - blank
        came = features.get(slot, set())
        assert not (blank & came), "a row is read with a zero feature after its feature came"
        assert zeros.get(slot, set()) & came <= read, "a row read with a zero feature is not redone once its feature came"
        zeros[slot], features[slot] = blank, set()
        return tokens, given

    def watched_take(plan, step, hidden):
        take(plan, step, hidden)
        for i, chunk in enumerate(plan.chunks):
            first = int(step.positions[int(step.qo_indptr[i])])
            features.setdefault(chunk.slot, set()).update(range(first, first + len(chunk.token_ids)))

    def watched_mirror(plan):
        mirror(plan)
        for slot in [*plan.freed, *(n.slot for n in plan.new_slots)]:  # another request's slot now
            features.pop(slot, None)
            zeros.pop(slot, None)

    drafter.engine.launch, drafter._catch_up, drafter.take_features = counting_launch, watched_catch_up, watched_take  # pyright: ignore[reportAttributeAccessIssue]
    drafter.mirror = watched_mirror  # pyright: ignore[reportAttributeAccessIssue]
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert max(rows) <= 16 and llm.scheduler.preemptions > 0
