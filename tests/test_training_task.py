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

    from bicache_sgl.training.model import LLaDAModelLM

    torch.set_num_threads(1)
    model = LLaDAModelLM.from_pretrained(ASSET_DIR).eval()
    ids = torch.tensor([tk.encode(task.heldout_items(1, 5, 0)[0]["prompt"]) + [tk.MASK_ID] * 4])
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, ids.shape[1], model.config.embedding_size)
    assert torch.isfinite(logits).all()
