"""LLaDA-MoE (models/families/llada_moe.py): its published config.json is recognised and parsed
(refusing what the runtime does not implement), the routed MoE FFN really routes (tokens pick
different experts) and equals the independent reference in every variant of the format (dense
layers, shared expert, expert bias) and dtype, batched equals alone, depth 0 equals cache off,
and its decoding is the model card's generate (LLaDA's low-confidence remasking), token for token.
The depth-d forward against the reference is tests/test_fidelity.py."""

from __future__ import annotations

import pytest
import torch

from bicache_sgl import Engine, SamplingParams
from bicache_sgl.io_struct import GenerateRequest
from bicache_sgl.models.config import CheckpointError, parse_model_config
from bicache_sgl.models.loader import load_model, load_tokenizer, read_config
from bicache_sgl.reference import load_reference_model, reference_logits
from bicache_sgl.testing import make_tiny_llada_moe
from bicache_sgl.testing.together import run_together

IDS = [5, 17, 200, 33, 33, 90, 4, 250, 11, 77, 3, 64, 128, 9, 41, 41]
PROMPTS = ["The quick brown fox jumps", "Q: what is 2+2?\nA:", "lorem ipsum dolor sit amet, consectetur", "x"]

# LLaDA-MoE-7B-A1B's published shape (config.json keys as inclusionAI ships them)
PUBLISHED = {
    "architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 16, "dense_intermediate_size": 8192,
    "expert_intermediate_size": 1024, "shared_expert_intermediate_size": None, "num_experts": 64,
    "num_experts_per_tok": 8, "norm_topk_prob": False, "moe_layer_freq": [1] * 16, "qk_layernorm": True,
    "moe_router_enable_expert_bias": False, "moe_router_score_function": "softmax", "attention_bias": False,
    "clip_qkv": None, "rope_theta": 50000, "rope_scaling": None, "partial_rotary_factor": 1,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "vocab_size": 157184, "tie_word_embeddings": False,
    "eos_token_id": 156892, "pad_token_id": 156892, "hidden_act": "silu", "torch_dtype": "bfloat16",
}


def test_the_published_config_is_llada_moe_although_its_model_type_is_llada():
    cfg = parse_model_config(PUBLISHED)
    assert cfg.arch == "llada_moe" and cfg.ffn == "moe" and cfg.qk_norm and cfg.logit_shift == 0
    assert (cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.expert_size) == (64, 8, 1024)
    assert all(cfg.moe.layers) and cfg.moe.shared_expert_size is None and not cfg.moe.norm_topk_prob
    assert cfg.mask_token_id == 156895  # the model card's mask id (config.json has none)
    assert cfg.eos_token_ids == (156892,) and cfg.head_dim == 128 and cfg.n_kv_heads == 16
    # the same model_type without architectures: the MoE keys decide
    no_arch = {k: v for k, v in PUBLISHED.items() if k != "architectures"}
    assert parse_model_config(no_arch).arch == "llada_moe"


@pytest.mark.parametrize(("key", "value", "match"), [
    ("clip_qkv", 8.0, "clip_qkv"), ("rope_scaling", {"type": "linear", "factor": 2}, "rope_scaling"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor"), ("hidden_act", "gelu", "hidden_act"),
    ("num_experts_per_tok", 65, "num_experts_per_tok"), ("moe_layer_freq", [1] * 15, "moe_layer_freq"),
    ("num_experts", None, "missing num_experts"), ("expert_intermediate_size", "x", "expert_intermediate_size"),
])
def test_bad_or_unsupported_keys_are_refused_by_name(key, value, match):
    with pytest.raises(CheckpointError, match=match):
        parse_model_config({**PUBLISHED, key: value})


def test_routing_really_differs_between_tokens(tiny_llada_moe):
    """The tiny checkpoint's routers send tokens to different expert sets (several experts per
    token, many experts in use), so the comparisons below cannot pass on a degenerate router."""
    model, cfg = load_model(tiny_llada_moe, "float32")
    seen: list[torch.Tensor] = []
    hooks = [layer.router.register_forward_hook(lambda mod, inp, out: seen.append(out.detach()))
             for layer in model.layers]
    try:
        model.forward_dense(torch.tensor(IDS))
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == cfg.n_layers
    for logits in seen:
        chosen = logits.topk(cfg.moe.top_k, dim=-1).indices.sort(dim=-1).values  # [N, k]
        sets = {tuple(r) for r in chosen.tolist()}
        assert len(sets) >= len(IDS) // 3, sets  # many distinct expert sets among 16 tokens
        assert len(chosen.unique()) >= cfg.moe.n_experts // 2  # most experts in use
        probs = logits.softmax(-1).topk(cfg.moe.top_k, dim=-1).values
        assert float(probs[:, 1].median()) > 0.05  # the second expert carries real weight


@pytest.mark.parametrize("variant", [
    {}, {"moe_layer_freq": [1, 0, 1], "dense_size": 80}, {"shared_expert_size": 24}, {"expert_bias": True},
    {"n_kv_heads": 2, "top_k": 3},
])
def test_forward_matches_the_reference_in_every_variant_of_the_format(variant, tmp_path):
    folder = make_tiny_llada_moe(tmp_path / "m", n_layers=3, **variant)
    model, _ = load_model(folder, "float32")
    ref = reference_logits(load_reference_model(folder), IDS).float()
    ours = model.forward_dense(torch.tensor(IDS))
    assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5), (variant, (ours - ref).abs().max())
    cfg = read_config(folder)
    if "moe_layer_freq" in variant:  # the dense layer reads mlp.gate_proj etc., not experts
        assert cfg["moe_layer_freq"] == [1, 0, 1] and not hasattr(model.layers[1], "experts")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_forward_follows_float32(tiny_llada_moe, dtype):
    ref, _ = load_model(tiny_llada_moe, "float32")
    model, _ = load_model(tiny_llada_moe, dtype)
    assert next(model.parameters()).dtype == getattr(torch, dtype)
    a, b = ref.forward_dense(torch.tensor(IDS)), model.forward_dense(torch.tensor(IDS))
    assert torch.isfinite(b).all()
    assert float((a - b).abs().max()) < 0.1 * float(a.abs().max())
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) >= 0.75


def test_the_family_chat_template_is_used_without_one_in_the_tokenizer(tiny_llada_moe):
    tok = load_tokenizer(tiny_llada_moe)
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == "<role>SYSTEM</role>be brief<|role_end|><role>HUMAN</role>hi<|role_end|><role>ASSISTANT</role>"


def _model_card_generate(model, prompt: list[int], mask_id: int, gen_length: int, steps: int,
                         block_length: int) -> tuple[list[int], int]:
    """The model card's generate (LLaDA's), re-stated: temperature 0, cfg_scale 0, low-confidence
    remasking. Per block, ``steps // n_blocks`` steps each unmasking an even share (remainder to
    the first steps) of the block's masked positions: those whose top-1 softmax probability is
    highest, later blocks excluded. Returns the generated ids and how often the mask token was
    a position's top-1 (where the server, which never emits the mask, would differ)."""
    x = torch.tensor(prompt + [mask_id] * gen_length)
    P = len(prompt)
    n_blocks = gen_length // block_length
    spb = steps // n_blocks
    mask_top = 0
    for b in range(n_blocks):
        lo, hi = P + b * block_length, P + (b + 1) * block_length
        n = int((x[lo:hi] == mask_id).sum())
        share = [n // spb + (1 if i < n % spb else 0) for i in range(spb)]
        for i in range(spb):
            masked = x == mask_id
            logits = model.forward_dense(x).double()
            p = torch.softmax(logits, dim=-1)
            x0 = p.argmax(-1)
            mask_top += int((x0[masked] == mask_id).sum())
            conf = p.gather(1, x0[:, None])[:, 0]
            conf[hi:] = float("-inf")
            conf = torch.where(masked, conf, torch.tensor(float("-inf"), dtype=conf.dtype))
            pick = torch.topk(conf, share[i]).indices
            x[pick] = x0[pick]
    return x[P:].tolist(), mask_top


def test_the_default_algorithm_is_the_model_card_generate_token_for_token(tiny_llada_moe):
    """With the family's default algorithm (low_confidence) and the model card's settings (no
    threshold, no in-request cache: the server's default dual cache is Fast-dLLM's
    approximation), the server's tokens are the model card's generate's, for several block
    layouts and tokens per step."""
    model, cfg = load_model(tiny_llada_moe, "float32")
    eng = Engine(tiny_llada_moe, prefix_cache="off", threshold=None, cache_mode="none")
    try:
        assert eng.model_config.arch == "llada_moe"
        for text, gen, steps, block in [(PROMPTS[0], 16, 16, 8), (PROMPTS[1], 12, 6, 12), (PROMPTS[3], 16, 8, 4)]:
            ids, mask_top = _model_card_generate(model, eng.encode(text), cfg.mask_token_id, gen, steps, block)
            assert mask_top == 0  # the comparison is exact: the mask is never a top-1
            out = eng.generate(text, {"temperature": 0, "max_new_tokens": gen, "steps": steps, "block_length": block,
                                      "ignore_eos": True})
            assert out["output_ids"] == ids, (text, gen, steps, block)
            assert out["meta_info"]["forward_passes"] == steps
    finally:
        eng.shutdown()


def test_batched_equals_alone(tiny_llada_moe):
    """Requests of different lengths, block sizes, cache modes and thresholds in one running batch
    (the MoE groups all their rows per expert in each forward) give the tokens each gives alone."""
    eng = Engine(tiny_llada_moe, prefix_cache="off", block_length=8, threshold=None)
    try:
        specs = [(PROMPTS[0], {"max_new_tokens": 16}), (PROMPTS[1], {"max_new_tokens": 8, "cache_mode": "none"}),
                 (PROMPTS[2], {"max_new_tokens": 24, "block_length": 4, "cache_mode": "prefix"}),
                 (PROMPTS[3], {"max_new_tokens": 16, "threshold": 0.05})]
        alone = [eng.generate(p, {"temperature": 0, **sp})["output_ids"] for p, sp in specs]
        greqs = [GenerateRequest(eng.encode(p), SamplingParams.from_dict({"temperature": 0, **sp})) for p, sp in specs]
        before = eng.get_stats()["num_forward_passes"]
        together = run_together(eng, greqs)
        assert [e.output_ids for e in together] == alone
        assert eng.get_stats()["num_forward_passes"] - before < sum(e.meta_info["forward_passes"] for e in together)
    finally:
        eng.shutdown()


SHARED = "System: answer briefly. Examples follow.\nQ: a\nA: 1\n\n" * 2


def test_depth_zero_equals_cache_off(tiny_llada_moe):
    """A then B sharing a long prefix: at depth 0 B's tokens are cache off's, and B did match
    the prefix."""
    outs, mode = {}, "fixed:0"
    for m in ("off", mode):
        eng = Engine(tiny_llada_moe, prefix_cache=m, device="cpu", threshold=None, block_length=8)
        try:
            eng.generate(SHARED + "Q: b", {"temperature": 0, "max_new_tokens": 8})
            outs[m] = eng.generate(SHARED + "Q: c", {"temperature": 0, "max_new_tokens": 8})
        finally:
            eng.shutdown()
    assert outs[mode]["meta_info"]["cached_tokens"] > len(SHARED) // 2
    assert outs[mode]["meta_info"]["bicache_depth"] == 0
    assert outs[mode]["output_ids"] == outs["off"]["output_ids"]
