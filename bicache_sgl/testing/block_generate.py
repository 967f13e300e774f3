"""Independent re-statements of the published block-diffusion generate loops, for the
token-for-token tests: LLaDA2's ``generate`` (its modeling file) and SDAR's
``block_diffusion_generate`` (its generate.py), greedy branch, written from their descriptions
(docs/block_diffusion.md) over any ``logits_fn(ids) -> [N, V]`` of the whole window (the
published loops run the full window every step, with no K/V cache; the tests pass the float64
reference forward, so nothing here touches the serving code).

Each loop takes an optional ``trace`` dict: it receives, for every position a step writes, the
written token's float64 log-softmax under that step's logits (a later write replaces it), which
is the output-logprob definition the tests check the engine against."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

LogitsFn = Callable[[list[int]], torch.Tensor]
Trace = dict[int, float]  # absolute position -> logprob of the token written there, at the writing step


def _note(trace: Trace | None, logits: torch.Tensor, a: int, writes: dict[int, int]) -> None:
    """Record the writes ``{position: token}`` of a step whose block logits [B, V] start at ``a``."""
    if trace is None:
        return
    lsm = torch.log_softmax(logits.double(), dim=-1)
    for i, t in writes.items():
        trace[i] = float(lsm[i - a, t])


def _steps_plan(block_length: int, steps: int) -> list[int]:
    per = [block_length // steps] * steps
    for s in range(block_length % steps):
        per[s] += 1
    return per


def _greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.double(), dim=-1)
    tok = logits.argmax(dim=-1)
    return tok, probs[torch.arange(len(tok)), tok]


def _window(prompt: Sequence[int], mask_id: int, gen_length: int, block_length: int) -> tuple[int, int, list[int]]:
    """(P, n_blocks, x): the prompt (P tokens) followed by masks up to whole blocks from position 0
    that cover P + gen_length positions."""
    P = len(prompt)
    n_blocks = -(-(P + gen_length) // block_length)
    return P, n_blocks, list(prompt) + [mask_id] * (n_blocks * block_length - P)


def _answer(x: list[int], P: int, gen_length: int, stop_ids: Sequence[int]) -> list[int]:
    """The generated part of the window, at most gen_length tokens, up to and including the
    first stop id."""
    out = []
    for t in x[P:P + gen_length]:
        out.append(t)
        if t in stop_ids:
            break
    return out


def llada2_generate(logits_fn: LogitsFn, prompt: Sequence[int], *, mask_id: int, eos_id: int, gen_length: int,
                    block_length: int = 32, steps: int = 32, threshold: float = 0.95, minimal_topk: int = 1,
                    trace: Trace | None = None) -> list[int]:
    """LLaDA2's generate(), temperature 0, eos_early_stop False: returns the generated tokens up
    to and including the first eos (at most gen_length)."""
    steps = min(steps, gen_length // minimal_topk)
    P, n_blocks, x = _window(prompt, mask_id, gen_length, block_length)
    plan = _steps_plan(block_length, steps)
    for blk in range(P // block_length, n_blocks):
        end = (blk + 1) * block_length
        for s in range(steps):
            window = x[:end]
            active = [i for i in range(end - block_length, end) if window[i] == mask_id]
            if not active:
                break
            lg = logits_fn(window)[end - block_length:end]
            tok, p = _greedy(lg)
            conf = {i: float(p[i - (end - block_length)]) for i in active}
            high = [i for i in active if conf[i] > threshold]
            if len(high) >= plan[s]:
                pick = high
            else:
                pick = sorted(active, key=lambda i: -conf[i])[:min(plan[s], len(active))]
            for i in pick:
                x[i] = int(tok[i - (end - block_length)])
            _note(trace, lg, end - block_length, {i: x[i] for i in pick})
        if eos_id in x[P:end]:
            break
    return _answer(x, P, gen_length, (eos_id,))


def sdar_generate(logits_fn: LogitsFn, prompt: Sequence[int], *, mask_id: int, stop_ids: Sequence[int],
                  gen_length: int, block_length: int = 4, denoising_steps: int = 4,
                  confidence_threshold: float = 0.85, trace: Trace | None = None) -> list[int]:
    """SDAR's block_diffusion_generate(), greedy, low_confidence_dynamic. It returns the whole
    window; the answer here is its generated part up to and including the first stop id (at most
    gen_length), which is what a server returns."""
    P, n_blocks, x = _window(prompt, mask_id, gen_length, block_length)
    plan = _steps_plan(block_length, denoising_steps)
    for blk in range(P // block_length, n_blocks):
        a, end = blk * block_length, (blk + 1) * block_length
        for s in range(denoising_steps + 1):
            masked = [i for i in range(a, end) if x[i] == mask_id]
            if not masked:
                break
            lg = logits_fn(x[:end])[a:end]
            tok, p = _greedy(lg)
            conf = [float(p[i - a]) if x[i] == mask_id else float("-inf") for i in range(a, end)]
            high = [i for i in range(a, end) if conf[i - a] > confidence_threshold]
            if len(high) >= plan[s]:
                pick = high
            else:
                pick = sorted(range(a, end), key=lambda i: -conf[i - a])[:plan[s]]
            for i in pick:
                x[i] = int(tok[i - a])
            _note(trace, lg, a, {i: x[i] for i in pick})
        if any(t in stop_ids for t in x[P:]):
            break
    return _answer(x, P, gen_length, stop_ids)


def llada21_generate(logits_fn: LogitsFn, prompt: Sequence[int], *, mask_id: int, eos_id: int, gen_length: int,
                     block_length: int = 32, threshold: float = 0.5, edit_threshold: float = 0.0,
                     max_post_edit_steps: int = 16, trace: Trace | None = None) -> tuple[list[int], int]:
    """LLaDA2.1's joint decoding (SGLang's JointThreshold: mask-to-token above ``threshold`` or the
    single best, token-to-token edits above ``edit_threshold``, up to ``max_post_edit_steps``
    steps after the block's last mask) over LLaDA2's window (blocks from position 0), greedy.
    Returns (the answer up to and including the first eos, the number of edits made)."""
    P, n_blocks, x = _window(prompt, mask_id, gen_length, block_length)
    edits = 0
    for blk in range(P // block_length, n_blocks):
        a, end = blk * block_length, (blk + 1) * block_length
        post = 0
        for _ in range(block_length + max_post_edit_steps):
            lg = logits_fn(x[:end])[a:end]
            tok, p = _greedy(lg)
            masked = [i for i in range(a, end) if x[i] == mask_id]
            change = []
            if masked:
                high = [i for i in masked if float(p[i - a]) > threshold]
                change = high or [max(masked, key=lambda i: float(p[i - a]))]
            else:
                post += 1
                if post > max_post_edit_steps:
                    break
            for i in range(max(a, P), end):
                if x[i] != mask_id and int(tok[i - a]) != x[i] and float(p[i - a]) > edit_threshold:
                    change.append(i)
                    edits += 1
            if not change:
                break
            for i in change:
                x[i] = int(tok[i - a])
            _note(trace, lg, a, {i: x[i] for i in change})
        if eos_id in x[P:end]:
            break
    return _answer(x, P, gen_length, (eos_id,)), edits
