"""The decoding pieces a request is made of (issue 21): the denoiser chosen by step schedule,
its schedules, the rows a block step computes, logit processing, stop handling and the one
detokenizer. The end-to-end exactness of these against the references is tests/test_dream_algorithms.py
(Dream) and tests/test_engine.py / tests/test_fidelity.py (LLaDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bicache_sgl.config import ALGORITHMS, BIDIRECTIONAL_ALGORITHMS, DREAM_ALGORITHMS, DecodeDefaults, SamplingParams
from bicache_sgl.decoding import NEG_INF, num_transfer_schedule
from bicache_sgl.decoding.denoiser import DENOISERS, DreamDenoiser, LLaDADenoiser, make_denoiser
from bicache_sgl.decoding.dream import dream_timesteps, dream_transfer_count
from bicache_sgl.decoding.plan import DecodePlan
from bicache_sgl.decoding.sampling import LogitsProcessor
from bicache_sgl.decoding.stop import StopRule
from bicache_sgl.decoding.text import Detokenizer
from bicache_sgl.models.loader import load_tokenizer

MASK = 9
V = 12


def _plan(**sp) -> tuple[DecodePlan, SamplingParams]:
    decode = sp.pop("decode", DecodeDefaults(block_length=8, threshold=None))
    params = SamplingParams.from_dict({"max_new_tokens": 8, "temperature": 0, **sp}).resolved()
    return DecodePlan.resolve(params, decode), params


@pytest.mark.parametrize("alg", BIDIRECTIONAL_ALGORITHMS)
def test_the_denoiser_is_chosen_by_schedule(alg):
    plan, params = _plan(dllm_algorithm=alg)
    d = make_denoiser(plan, params, MASK)
    want = DreamDenoiser if alg in DREAM_ALGORITHMS else LLaDADenoiser
    assert type(d) is want and plan.schedule == want.schedule and DENOISERS[plan.schedule] is want
    assert d.bans_mask is (want is LLaDADenoiser)  # Dream keeps the mask in its confidence's distribution
    assert set(DENOISERS) == {"llada", "dream"}


@pytest.mark.parametrize("alg", sorted(set(ALGORITHMS) - set(BIDIRECTIONAL_ALGORITHMS)))
def test_block_only_algorithms_have_no_bidirectional_denoiser(alg):
    """joint_threshold runs only in the block engine (blockdiff/engine.py): its plan's schedule has
    no denoiser here, so the bidirectional engine cannot pick it up by accident."""
    plan, params = _plan(dllm_algorithm=alg)
    assert plan.schedule not in DENOISERS
    with pytest.raises(ValueError, match=f"dllm_algorithm {alg} runs only in the block-diffusion engine"):
        make_denoiser(plan, params, MASK)


def _run_block(d, n_masked: int, gen: torch.Generator) -> list[int]:
    """Drive one block of ``n_masked`` positions with random confidences: positions unmasked per forward."""
    per_step, left, first = [], n_masked, True
    while left:
        d.plan_forward(left, first, gen)
        first = False
        conf = torch.rand(left, dtype=torch.float64, generator=gen)
        chosen = d.select(conf, gen)
        assert len(set(chosen.tolist())) == len(chosen) and all(0 <= c < left for c in chosen.tolist())
        per_step.append(len(chosen))
        left -= len(chosen)
        if left:
            d.next_step()
    return per_step


def test_llada_runs_its_even_schedule_per_block():
    plan, params = _plan(max_new_tokens=20, steps_per_block=4, decode=DecodeDefaults(block_length=10, threshold=None))
    d = make_denoiser(plan, params, MASK)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # the schedule restarts at each block
        assert _run_block(d, 10, gen) == num_transfer_schedule(10, 4) == [3, 3, 2, 2]
    assert _run_block(d, 7, gen) == [2, 2, 2, 1]  # fewer masked (a block started partly decided)


def test_llada_threshold_replaces_the_schedule():
    plan, params = _plan(threshold=0.5)
    d = make_denoiser(plan, params, MASK)
    d.plan_forward(4, True, torch.Generator())
    assert d.select(torch.tensor([0.9, 0.1, 0.6, 0.2], dtype=torch.float64), None).tolist() == [0, 2]
    assert d.select(torch.tensor([0.1, 0.3], dtype=torch.float64), None).tolist() == [1]  # at least the best


@pytest.mark.parametrize("spb", [3, 8, 40])
def test_dream_skips_the_steps_that_unmask_nothing(spb):
    """Dream's forwards are exactly its schedule's steps that unmask something: step i unmasks
    int(n * (1 - s / t)) of the n still masked, the last every one left."""
    plan, params = _plan(dllm_algorithm="maskgit_plus", steps_per_block=spb)
    ts = dream_timesteps(spb, plan.eps)
    want, left = [], 8
    for i in range(spb):
        k = dream_transfer_count(left, i, ts)
        if k:
            want.append(k)
            left -= k
        if not left:
            break
    d = make_denoiser(plan, params, MASK)
    gen = torch.Generator().manual_seed(1)
    assert _run_block(d, 8, gen) == want
    assert _run_block(d, 8, gen) == want  # the next block walks the schedule from its start again
    if spb == 40:
        assert len(want) < spb  # steps were skipped without a forward


def test_dream_origin_decides_only_its_draw():
    plan, params = _plan(dllm_algorithm="origin", steps_per_block=4)
    d = make_denoiser(plan, params, MASK)
    d.plan_forward(6, True, torch.Generator().manual_seed(3))
    lg = torch.randn(6, V, generator=torch.Generator().manual_seed(4))
    x0, conf, lp = d.decide(lg, torch.Generator())
    drawn = d.drawn.tolist()
    assert drawn and d.select(conf, None).tolist() == drawn
    undrawn = [i for i in range(6) if i not in drawn]
    assert all(x0[i] == 0 and lp[i] == 0 for i in undrawn)
    assert all(int(x0[i]) == int(lg[i].argmax()) for i in drawn if int(lg[i].argmax()) != MASK)


def test_guidance_pushes_away_from_the_unconditional_logits():
    plan, params = _plan(cfg_scale=1.5)
    d = make_denoiser(plan, params, MASK)
    cond, uncond = torch.tensor([[2.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    assert torch.equal(d.guide(cond, uncond), torch.tensor([[3.5, -1.5]]))  # uncond + 2.5 * (cond - uncond)


def test_step_positions_per_cache_mode():
    masked, last = np.array([12, 14]), np.array([13])

    def rows(mode: str, step_rows: str = "block", shift: int = 0, step: int = 1, refresh_interval: int = 0):
        plan, _ = _plan(cache_mode=mode, step_rows=step_rows, refresh_interval=refresh_interval)
        refresh = plan.refreshes(step)
        return refresh, plan.step_positions(refresh, (10, 18), 26, shift, masked, last).tolist()

    assert rows("none") == (True, list(range(26)))
    assert rows("prefix", step=0) == (True, list(range(26)))  # a block's first step: the whole sequence
    assert rows("prefix") == (False, list(range(10, 26)))
    assert rows("prefix", shift=1) == (False, list(range(9, 26)))
    assert rows("dual") == (False, list(range(10, 18)))
    assert rows("dual", shift=1) == (False, list(range(9, 18)))  # the row before gives the first's logits
    assert rows("dual", "active") == (False, [12, 13, 14])
    assert rows("dual", "active", shift=1) == (False, [11, 12, 13, 14])
    assert rows("dual", step=4, refresh_interval=2) == (True, list(range(26)))
    assert rows("dual", step=3, refresh_interval=2)[0] is False


def test_logits_processor_bans():
    prompt = [1, 2, 3]
    x = torch.tensor(prompt + [MASK] * 4)
    lg = torch.zeros(4, V)
    pos = np.arange(3, 7)

    p = SamplingParams(max_new_tokens=4, min_new_tokens=2, stop_token_ids=(5,))
    out = LogitsProcessor(p, prompt, 4, mask_id=MASK, eos_ids=(7,))(lg, x, pos)
    assert torch.all(out[:, MASK] == NEG_INF)
    assert torch.all(out[:2, [5, 7]] == NEG_INF) and torch.all(out[2:, [5, 7]] == 0)  # only before min_new_tokens
    assert torch.all(lg == 0)  # a new tensor
    kept = LogitsProcessor(p, prompt, 4, mask_id=MASK, eos_ids=(7,))(lg, x, pos, ban_mask=False)
    assert torch.all(kept[2:, MASK] == 0)  # kept, but early positions ban it with the end ids

    p = SamplingParams(max_new_tokens=4, ignore_eos=True)
    out = LogitsProcessor(p, prompt, 4, mask_id=MASK, eos_ids=(7,))(lg, x, pos)
    assert torch.all(out[:, 7] == NEG_INF)  # EOS is never output with ignore_eos

    p = SamplingParams(max_new_tokens=4, frequency_penalty=1.0, logit_bias=((4, 2.0),))
    x = torch.tensor(prompt + [6, 6, MASK, 7])  # 6 twice in the output; EOS (7) padding not counted
    out = LogitsProcessor(p, prompt, 4, mask_id=MASK, eos_ids=(7,))(lg, x, pos)
    assert torch.all(out[:, 6] == -2.0) and torch.all(out[:, 4] == 2.0) and torch.all(out[:, 7] == 0)


def test_stop_rule(tiny_llada):
    tok = load_tokenizer(tiny_llada)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    detok = Detokenizer(tok, skip_special_tokens=True)
    body = tok.encode("Answer 42\nQuestion: next")

    def check(gen, **sp):
        p = SamplingParams(max_new_tokens=sp.pop("max_new_tokens", 64), **sp)
        return StopRule(p, (eos,), sp.pop("gen_len", 64), detok).check(gen)

    ids, text, reason = check(body + [eos] + tok.encode("junk"))
    assert (ids, text, reason) == (body, tok.decode(body), {"type": "stop", "matched": eos})
    ids, text, reason = check(body, stop=("Question",))
    assert text == "Answer 42\n" and reason == {"type": "stop", "matched": "Question"}
    assert tok.decode(ids).startswith("Answer 42\nQuestion")  # ids reach the end of the stop string
    assert check(body)[2] is None  # the region is not done: it goes on
    assert check(body, max_new_tokens=len(body))[2] == {"type": "length", "length": len(body)}
    assert check([eos] + body, min_new_tokens=1, max_new_tokens=len(body) + 1)[2]["type"] == "length"
    assert check([eos] + body, ignore_eos=True, max_new_tokens=len(body) + 1)[0] == [eos] + body


def test_one_detokenizer(tiny_llada):
    tok = load_tokenizer(tiny_llada)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = tok.encode("ab") + [eos]
    assert Detokenizer(tok, True).text(ids) == "ab"
    assert Detokenizer(tok, False).text(ids) == tok.decode(ids, skip_special_tokens=False) != "ab"
    assert Detokenizer(tok, True).token(eos) == tok.decode([eos])  # a token's own text keeps specials


@pytest.mark.parametrize("same_bans", [True, False])
def test_greedy_decisions_made_together_equal_each_requests_own(same_bans):
    """The scheduler decides every greedy threshold request of a step with one
    ``decide_greedy`` call; each request's tokens and confidences must be bit-equal to what its own
    LogitsProcessor + ``decide`` give (rows of different counts, an empty one, different bans)."""
    from bicache_sgl.decoding import decide, decide_greedy

    gen = torch.Generator().manual_seed(3)
    rows = [5, 1, 0, 8, 3]
    parts = [torch.randn(n, V, generator=gen) * 4 for n in rows]
    parts[3][2] = parts[3][2].max() + 1  # a row where the mask would win unbanned
    parts[3][2, MASK] = 100.0
    ignore = [False] * len(rows) if same_bans else [False, True, False, True, False]
    procs, banned = [], []
    for ig in ignore:
        _, params = _plan(ignore_eos=ig)
        lp = LogitsProcessor(params, [1, 2, 3], 8, mask_id=MASK, eos_ids=(0,))
        procs.append(lp)
        banned.append(lp.suppress_ids if ig else (MASK,))
    together = decide_greedy(parts, banned)
    for lg, proc, (x0, conf) in zip(parts, procs, together):
        want_x0, want_conf, _ = decide(proc(lg, torch.zeros(12, dtype=torch.long), np.arange(len(lg)) + 3),
                                       temperature=0, top_k=-1, top_p=1.0, remasking="low_confidence", generator=None)
        assert torch.equal(x0, want_x0) and torch.equal(conf, want_conf)
    assert int(together[3][0][2]) != MASK  # the ban applied
    assert all(lg.shape[0] == n for lg, n in zip(parts, rows))  # the forward's logits untouched


def test_threshold_selection_orders_ties_by_position_as_torchs_stable_sort():
    """``select_transfer``'s threshold rule (numpy on CPU) against torch's stable descending
    argsort, on confidences with many ties."""
    from bicache_sgl.decoding import select_transfer

    conf = torch.tensor([0.5, 0.95, 0.95, 0.2, 0.99], dtype=torch.float64)
    assert select_transfer(conf, 1, 0.9).tolist() == [4, 1, 2]
    assert select_transfer(torch.tensor([0.3, 0.7, 0.7], dtype=torch.float64), 1, 0.9).tolist() == [1]
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        conf = (torch.randint(0, 6, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen) / 5.0).double()
        order = torch.argsort(conf, descending=True, stable=True)
        keep = conf[order] >= 0.6
        keep[0] = True
        assert torch.equal(select_transfer(conf, 1, 0.6), order[keep])
