"""The model-family registry (models/families/): how a config.json finds its family, that every
registered family has a tiny maker in its real format and a branch of the independent reference
that agrees with the runtime, and that a family's decoding declaration is what a request gets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bicache_sgl.config import ALGORITHMS, DecodeDefaults, SamplingParams
from bicache_sgl.decoding.plan import ALGORITHM_SPECS, DecodePlan, FamilyDecoding
from bicache_sgl.io_struct import GenerateRequest
from bicache_sgl.models.block_model import load_block_model
from bicache_sgl.models.config import CheckpointError, detect_arch
from bicache_sgl.models.families import FAMILIES, checkpoint_names, family_of, parse_model_config
from bicache_sgl.models.loader import load_model, read_config
from bicache_sgl.reference import load_block_reference, load_reference_model, reference_block_logits, reference_logits
from bicache_sgl.scheduler.validate import RequestLimits, validate_request
from bicache_sgl.testing import TINY_MAKERS

IDS = [5, 17, 200, 33, 33, 90, 4, 250, 11, 77, 3, 64]


@pytest.fixture(scope="module")
def tiny_of_each(tmp_path_factory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("families")
    return {name: TINY_MAKERS[name](base / name, n_layers=2) for name in FAMILIES}


def _is_block(name: str) -> bool:
    """Block-causal families (exact prefix reuse) run on the block-diffusion runtime."""
    return FAMILIES[name].prefix_reuse == "exact"


def test_every_family_has_a_tiny_maker_in_its_own_format(tiny_of_each):
    assert set(TINY_MAKERS) == set(FAMILIES)
    for name, folder in tiny_of_each.items():
        cfg = read_config(folder)
        assert family_of(cfg).name == name
        mc = parse_model_config(cfg)
        assert mc.arch == name
        if _is_block(name):
            # the block runtime stacks experts and fuses q/k/v: every named tensor is in the files,
            # and the strict load takes them all
            from pathlib import Path

            from safetensors import safe_open
            stored = set()
            for f in Path(folder).glob("*.safetensors"):
                with safe_open(str(f), "pt") as sf:
                    stored |= set(sf.keys())
            assert {ck for ck, _ in checkpoint_names(mc).values()} == stored
            assert mc.attention == "block_causal"
            with pytest.raises(CheckpointError, match="block-diffusion engine"):
                load_model(folder, "float32")
            load_block_model(folder)
            continue
        assert set(checkpoint_names(mc)) == {n for n, _ in load_model(folder, "float32")[0].named_parameters()}


def test_the_reference_covers_every_family(tiny_of_each):
    """reference.py keeps its own maps per family (no code shared): each registered family's
    tiny checkpoint is read by it and its logits equal the runtime's dense forward."""
    for name, folder in tiny_of_each.items():
        if _is_block(name):
            model = load_block_model(folder)
            ref = reference_block_logits(load_block_reference(folder), IDS, model.cfg.decode.block_length).float()
            ours = model.forward_dense(torch.tensor(IDS))
            assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5), (name, (ours - ref).abs().max())
            continue
        model, cfg = load_model(folder, "float32")
        ref = reference_logits(load_reference_model(folder), IDS).float()
        ours = model.forward_dense(torch.tensor(IDS))
        if cfg.logit_shift:
            ours = torch.cat([ours[:1], ours[:-1]], dim=0)
        assert torch.allclose(ours, ref, atol=1e-5, rtol=1e-5), (name, (ours - ref).abs().max())


def test_architectures_decide_before_model_type():
    # a Dream class name wins over a model_type another family claims
    assert detect_arch({"architectures": ["DreamModel"], "model_type": "llada"}) == "dream"
    assert detect_arch({"architectures": ["LLaDAModelLM"]}) == "llada"
    # without architectures the model_type decides, case-insensitively (Dream writes "Dream")
    assert detect_arch({"model_type": "Dream"}) == "dream"
    assert detect_arch({"model_type": "llada", "d_model": 8}) == "llada"
    with pytest.raises(CheckpointError, match="unsupported architecture.*GPT2") as e:
        family_of({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    for name in FAMILIES:  # the message lists what is supported
        assert name in str(e.value)


def test_every_family_declares_valid_decoding():
    for fam in FAMILIES.values():
        assert fam.decoding.family == fam.name
        assert fam.decoding.default_algorithm in fam.decoding.algorithms
        assert set(fam.decoding.algorithms) <= set(ALGORITHM_SPECS) == set(ALGORITHMS)


def _limits(folder: str) -> RequestLimits:
    return RequestLimits.of(parse_model_config(read_config(folder)), DecodeDefaults(block_length=8), 256)


def test_the_family_default_algorithm_applies_last(tiny_of_each):
    params = SamplingParams.from_dict({"max_new_tokens": 8}).resolved()
    fam = FamilyDecoding("x", "maskgit_plus", ("low_confidence", "maskgit_plus"))
    assert DecodePlan.resolve(params, DecodeDefaults(block_length=8), None, fam).algorithm == "maskgit_plus"
    # the server's flag (and the request, and generation_config.json) come first
    flag = DecodeDefaults(block_length=8, dllm_algorithm="low_confidence")
    assert DecodePlan.resolve(params, flag, None, fam).algorithm == "low_confidence"
    # the registered families: low_confidence when nothing names one (as before the registry)
    for folder in tiny_of_each.values():
        v = validate_request(GenerateRequest(input_ids=[1, 2, 3], params=params), _limits(folder))
        assert v.plan.algorithm == "low_confidence"


def test_an_algorithm_the_family_does_not_accept_is_refused(tiny_of_each):
    limits = dataclasses.replace(_limits(tiny_of_each["llada"]),
                                 family=FamilyDecoding("only_lc", "low_confidence", ("low_confidence",)))
    ok = SamplingParams.from_dict({"max_new_tokens": 8}).resolved()
    assert validate_request(GenerateRequest(input_ids=[1, 2], params=ok), limits).plan.algorithm == "low_confidence"
    bad = SamplingParams.from_dict({"max_new_tokens": 8, "dllm_algorithm": "entropy"}).resolved()
    with pytest.raises(ValueError, match=r"dllm_algorithm: 'entropy'.*\(only_lc\)"):
        validate_request(GenerateRequest(input_ids=[1, 2], params=bad), limits)
