"""Fast checks of the synthetic task, the tokenizer and the shipped default checkpoint."""

import json
import os
import random

import pytest

from bicache_sgl.training import task
from bicache_sgl.training import tokenizer as tk

ASSET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "bicache_sgl", "assets", "default_model")


# ----------------------------------------------------------------------------- task


def test_heldout_items_deterministic():
    a = task.heldout_items(60, num_shots=5, seed=0)
    b = task.heldout_items(60, num_shots=5, seed=0)
    c = task.heldout_items(60, num_shots=5, seed=1)
    assert a == b
    assert a != c
    assert len(a) == 60
    assert task.control_items(a, "shuffle", 0) == task.control_items(b, "shuffle", 0)


def test_training_samples_deterministic():
    s1 = [task.training_sample(random.Random(7), 4) for _ in range(3)]
    s2 = [task.training_sample(random.Random(7), 4) for _ in range(3)]
    assert s1 == s2


def test_item_shape_and_prompt_format():
    items = task.heldout_items(20, num_shots=4, seed=0)
    for it in items:
        assert set(it) >= {"prefix", "question", "answer", "family", "prompt", "examples"}
        assert it["prompt"] == task.build_prompt(it["prefix"], it["question"])
        assert it["prompt"] == task.build_prompt([tuple(e) for e in it["examples"]], it["question"])
        assert it["prompt"].startswith(it["prefix"] + "\n\nQuestion: ")
        assert it["prompt"].endswith("\nAnswer:")
        blocks = it["prefix"].split("\n\n")
        assert len(blocks) == 4
        for blk in blocks:
            q, a = blk.split("\n")
            assert q.startswith("Question: ") and a.startswith("Answer: ")
        assert len(it["prompt"]) == task.prompt_length(4)
    # consecutive items of a family share its prefix (several requests per prefix)
    fams = [it["family"] for it in items]
    assert fams[:4] == [fams[0]] * 4
    assert len(set(fams)) == 5


def test_heldout_disjoint_from_training():
    heldout = {it["family"] for it in task.heldout_items(400, num_shots=5, seed=0)}
    for it in task.heldout_items(50, num_shots=3, seed=3):
        assert task.is_heldout(tuple(map(tuple, it["examples"])))
    rng = random.Random(0)
    for _ in range(2000):
        fam = task.random_family(rng, rng.randint(1, 8), "train")
        assert not fam.heldout
        assert fam.name not in heldout


@pytest.mark.parametrize("kind", task.KINDS)
def test_answer_only_in_prefix(kind):
    items = task.heldout_items(300, num_shots=5, seed=0, kind=kind)
    answers_by_question = {}
    for it in items:
        mapping = dict(map(tuple, it["examples"]))
        assert mapping[it["question"]] == it["answer"]          # derivable from the prefix
        assert f"Question: {it['question']}\nAnswer: {it['answer']}" in it["prefix"]
        assert it["answer"] not in it["question"]               # not from the question
        answers_by_question.setdefault(it["question"], set()).add(it["answer"])
    # the same question has different answers in different families
    assert all(len(v) > 1 for v in answers_by_question.values())
    assert len(answers_by_question) > 10


def test_controls():
    items = task.heldout_items(50, num_shots=5, seed=0)
    removed = task.control_items(items, "remove")
    assert all(r["prompt"] == f"Question: {r['question']}\nAnswer:" for r in removed)
    shuffled = task.control_items(items, "shuffle", seed=0)
    for it, sh in zip(items, shuffled):
        assert sh["answer"] == it["answer"] and sh["question"] == it["question"]
        assert sh["prefix"] != it["prefix"]
        assert sh["prompt"] == task.build_prompt(sh["prefix"], sh["question"])


def test_prefix_fraction_in_range():
    # r = prefix / (prompt + generation) for the default 5-shot, 8-position setting
    items = task.heldout_items(10, num_shots=5, seed=0)
    for it in items:
        r = len(it["prefix"]) / (len(it["prompt"]) + 8)
        assert 0.75 <= r <= 0.9


# ----------------------------------------------------------------------------- tokenizer


def _assert_roundtrip(tok):
    texts = [task.heldout_items(1, 8, 0)[0]["prompt"] + " 7",
             "  two  spaces\n\nnew\tlines ~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./",
             "Answer: 0123456789"]
    for s in texts:
        ids = tok.encode(s, add_special_tokens=False)
        assert ids == tk.encode(s)
        assert len(ids) == len(s)
        assert tok.decode(ids) == s


def test_tokenizer_roundtrip(tmp_path):
    from transformers import AutoTokenizer

    tk.save_tokenizer(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).exists()
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    _assert_roundtrip(tok)
    assert tok.eos_token_id == tk.EOS_ID and tok.pad_token_id == tk.PAD_ID
    assert tok.mask_token_id == tk.MASK_ID
    assert tok.decode([tk.EOS_ID, tk.MASK_ID], skip_special_tokens=True) == ""
    assert tk.decode(tk.encode("Answer: 7") + [tk.EOS_ID, tk.EOS_ID]) == "Answer: 7"


# ----------------------------------------------------------------------------- checkpoint


def _shipped():
    if not os.path.exists(os.path.join(ASSET_DIR, "model.safetensors")):
        pytest.skip("default model not trained yet")
    with open(os.path.join(ASSET_DIR, "config.json")) as f:
        return json.load(f)


def test_shipped_model_trained_on_default_kind():
    _shipped()
    with open(os.path.join(ASSET_DIR, "train_info.json")) as f:
        info = json.load(f)
    assert info["args"]["task"] == task.DEFAULT_KIND
    assert info["finished"]


def test_shipped_tokenizer_matches():
    cfg = _shipped()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSET_DIR)
    _assert_roundtrip(tok)
    assert tok.mask_token_id == cfg["mask_token_id"]
    assert tok.eos_token_id == cfg["eos_token_id"]
    assert tok.pad_token_id == cfg["pad_token_id"]
    assert len(tok) == cfg["vocab_size"]


def test_shipped_checkpoint_llada_format():
    cfg = _shipped()
    expected = {"architectures": ["LLaDAModelLM"], "model_type": "llada", "include_bias": False,
                "include_qkv_bias": False, "layer_norm_type": "rms", "activation_type": "silu",
                "block_type": "llama", "rope": True, "scale_logits": False}
    for k, v in expected.items():
        assert cfg[k] == v, k
    for k in ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size", "mlp_ratio",
              "max_sequence_length", "rope_theta", "rms_norm_eps", "vocab_size", "embedding_size",
              "mask_token_id", "eos_token_id", "pad_token_id", "weight_tying", "torch_dtype"):
        assert k in cfg, k
    assert cfg["n_layers"] >= 8
    d, L, nkv = cfg["d_model"], cfg["n_layers"], cfg["n_kv_heads"]
    hd = d // cfg["n_heads"]
    mlp, E = cfg["mlp_hidden_size"], cfg["embedding_size"]
    shapes = {"model.transformer.wte.weight": (E, d), "model.transformer.ln_f.weight": (d,)}
    if not cfg["weight_tying"]:
        shapes["model.transformer.ff_out.weight"] = (E, d)
    for i in range(L):
        p = f"model.transformer.blocks.{i}."
        shapes.update({
            p + "attn_norm.weight": (d,), p + "q_proj.weight": (d, d),
            p + "k_proj.weight": (nkv * hd, d), p + "v_proj.weight": (nkv * hd, d),
            p + "attn_out.weight": (d, d), p + "ff_norm.weight": (d,),
            p + "ff_proj.weight": (mlp, d), p + "up_proj.weight": (mlp, d),
            p + "ff_out.weight": (d, mlp),
        })
    from safetensors import safe_open

    path = os.path.join(ASSET_DIR, "model.safetensors")
    assert os.path.getsize(path) <= 21 * 1024 * 1024
    dtype_name = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[cfg["torch_dtype"]]
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        assert keys == set(shapes)
        for k in keys:
            sl = f.get_slice(k)
            assert tuple(sl.get_shape()) == shapes[k], k
            assert sl.get_dtype() == dtype_name, k


def test_shipped_checkpoint_loads_and_runs():
    _shipped()
    import torch

    from bicache_sgl.models.loader import load_model

    torch.set_num_threads(1)
    model, cfg = load_model(ASSET_DIR, "float32")
    ids = torch.tensor([tk.encode(task.heldout_items(1, 5, 0)[0]["prompt"]) + [tk.MASK_ID] * 4])
    logits = model.forward_dense(ids[0])
    assert logits.shape == (ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_shipped_model_scores_through_the_serving_engine():
    """evaluate.py decodes with bicache_sgl.Engine; on a slice of the held-out set the shipped model
    is as accurate as docs/default_model.md says (100%), and the shuffle control is near chance."""
    _shipped()
    from bicache_sgl.training import evaluate

    engine = evaluate.make_engine(ASSET_DIR, threads=1)
    try:
        items = task.heldout_items(20, 5, seed=0)
        r = evaluate.score(engine, items, gen_length=8)
        assert (r["accuracy"], r["invalid"], r["n"]) == (1.0, 0.0, 20)
        assert r["outputs"][0].startswith(" " + items[0]["answer"])
        shuffled = evaluate.score(engine, task.control_items(items, "shuffle"), gen_length=8)
        assert shuffled["accuracy"] <= 0.5
    finally:
        engine.shutdown()


# ----------------------------------------------------------------------------- training


def _llada(seed=0):
    """A freshly initialised 2-layer training model and its config.json dict."""
    import torch

    from bicache_sgl.models.config import parse_model_config
    from bicache_sgl.models.model import DiffusionLM
    from bicache_sgl.training import train

    config = train.llada_config(train.parse_args(["--out", "-", "--d-model", "16", "--n-layers", "2",
                                                  "--n-heads", "2"]))
    model = DiffusionLM(parse_model_config(config))
    train.init_weights(model, torch.Generator().manual_seed(seed))
    return model, config


def test_training_forward_is_the_serving_model_and_differentiable():
    """DiffusionLM.forward (training, batched) matches forward_dense per sequence with the padding
    keys masked out, and gradients reach every parameter. (tests/test_models.py checks forward_dense
    and the packed serving forward against an independent reference.)"""
    import torch

    torch.manual_seed(0)
    model, _ = _llada()
    a, b = [5, 9, 33, 40, 1, 1], [7, 8, 1]
    ids = torch.full((2, 6), tk.EOS_ID)
    ids[0], ids[1, :3] = torch.tensor(a), torch.tensor(b)
    mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    mask[1, ..., 3:] = False
    logits = model(ids, mask)
    assert logits.shape == (2, 6, tk.VOCAB_SIZE) and logits.requires_grad
    logits.float().logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with torch.no_grad():
        for row, seq in ((0, a), (1, b)):
            dense = model.forward_dense(torch.tensor(seq))
            assert torch.allclose(logits[row, :len(seq)], dense, atol=1e-5)


def test_checkpoint_roundtrip_through_the_loader(tmp_path):
    """save_checkpoint writes LLaDA's tensor names and config keys; load_model reads it back exactly."""
    import torch
    from safetensors import safe_open

    from bicache_sgl.models.loader import load_model
    from bicache_sgl.training import train

    model, config = _llada(seed=3)
    train.save_checkpoint(model, config, str(tmp_path), "float32")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.transformer.wte.weight" in keys and "model.transformer.blocks.1.ff_out.weight" in keys
    assert "model.transformer.ff_out.weight" in keys and len(keys) == len(model.state_dict())
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["LLaDAModelLM"] and saved["d_model"] == 16
    loaded, _ = load_model(str(tmp_path), "float32")
    ids = torch.tensor([5, 9, 33, tk.MASK_ID])
    with torch.no_grad():
        assert torch.equal(loaded.forward_dense(ids), model.forward_dense(ids))


def test_train_runs_and_checkpoints(tmp_path):
    """A few steps of the real training loop: the loss is finite, the quick evaluation decodes
    through the engine, and the folder serves (load_model) with the same weights on a rerun."""
    import torch

    from bicache_sgl.models.loader import load_model
    from bicache_sgl.training import train

    argv = ["--steps", "3", "--batch-size", "4", "--d-model", "16", "--n-layers", "2", "--n-heads", "2",
            "--eval-every", "3", "--eval-questions", "10", "--max-shots", "5", "--max-gen", "8",
            "--save-every-min", "100"]
    train.main(["--out", str(tmp_path / "a"), *argv])
    train.main(["--out", str(tmp_path / "b"), *argv])
    info = json.loads((tmp_path / "a" / "train_info.json").read_text())
    assert info["finished"] and info["step"] == 3 and len(info["evals"]) == 1
    ev = info["evals"][0]
    assert 0.0 <= ev["acc@5shot"] <= 1.0 and ev["loss_ema"] > 0
    ma, _ = load_model(str(tmp_path / "a"), "float32")
    mb, _ = load_model(str(tmp_path / "b"), "float32")
    for (name, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_continuation_text_repeats_the_question_in_format():
    assert task.continuation_text("K", "7", 2) == " 7"
    text = task.continuation_text("K", "7", 60)
    assert len(text) == 60
    assert text.startswith(" 7\n\nQuestion: K\nAnswer: 7\n\nQuestion: K\nAnswer: 7")
    period = len(task.EXAMPLE_SEP + task.format_example("K", "7"))
    assert all(text[i] == text[i - period] for i in range(period, 60))  # a copy one example back
    assert task.in_format(text, "7") and task.in_format(text.replace(": K", ": G"), "7")
    assert not task.in_format(text.replace(": K", ": g"), "7") and not task.in_format(text, "3")
    assert not task.in_format(" 7\n\n\n\n", "7")


def test_format_prob_sets_the_region_past_the_answer():
    """--format-prob 1: the region is the format continuation (no EOS); 0: the answer + EOS padding,
    drawing the same random numbers as before the option existed (older runs replay)."""
    from bicache_sgl.training import train

    ids, start, _ = train.make_sequence(random.Random(5), 3, 30, 2, "code", format_prob=1.0)
    prompt = tk.decode(ids[:start])
    key, answer = prompt[-9], tk.decode(ids[start:start + 2]).strip()
    assert ids[start:] == tk.encode(task.continuation_text(key, answer, 30))
    assert tk.EOS_ID not in ids[start:]
    rng_a, rng_b = random.Random(5), random.Random(5)
    plain = train.make_sequence(rng_a, 3, 30, 2, "code")
    assert train.make_sequence(rng_b, 3, 30, 2, "code", format_prob=0.0) == plain
    assert rng_a.random() == rng_b.random()
    assert plain[0][plain[1] + 2:] == [tk.EOS_ID] * 28


def test_train_init_starts_from_a_checkpoint(tmp_path):
    """--init loads a checkpoint's weights by their LLaDA names: zero steps from it save it back
    unchanged."""
    import torch

    from bicache_sgl.models.loader import load_model
    from bicache_sgl.training import train

    argv = ["--batch-size", "4", "--d-model", "16", "--n-layers", "2", "--n-heads", "2",
            "--eval-every", "100", "--max-gen", "8", "--save-every-min", "100"]
    train.main(["--out", str(tmp_path / "a"), "--steps", "1", "--seed", "3", *argv])
    train.main(["--out", str(tmp_path / "b"), "--steps", "0", "--init", str(tmp_path / "a"), *argv])
    ma, _ = load_model(str(tmp_path / "a"), "float32")
    mb, _ = load_model(str(tmp_path / "b"), "float32")
    for (name, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(pa, pb), name
