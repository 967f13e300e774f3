"""The exactness battery: each check runs the real runtime and returns one ``Row`` (FAIL on any
mismatch, never an exception for a mismatch).

- depth 0 == cache off: a ``fixed:0`` engine that finds the shared prefix in its cache (and so
  matches but reuses nothing) gives the tokens (and top-5 logprobs) of a cache-off engine;
- batched == alone: requests at different bicache depths in ONE batch give the tokens (and top-5
  logprobs) each gives alone (same cache state: only the shared prefix, captured by a prefix-only
  request);
- depth-d forward vs float64: ``depth_forward.compare_depth_forward`` judged against a tolerance
  relative to the logits' scale, and only when reuse from another context moves the logits far
  beyond it (else the comparison proves nothing);
- FlashInfer == torch: the same depth-d forwards through both backends in bf16 (CUDA and
  FlashInfer installed; otherwise the row says why it was skipped).

Engine checks take an ``EngineFactory`` (prefix-cache mode -> a fresh ``Engine``), so a caller can
hand them an engine with another backend or model.
"""

from __future__ import annotations

import importlib.util
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..attention import AttentionBackend, create_backend
from ..config import SamplingParams
from ..engine.engine import Engine
from ..io_struct import GenerateRequest, RequestEvent, span_depth
from ..training.task import heldout_items
from .depth_forward import DepthForwardReport, compare_depth_forward
from .report import FAIL, PASS, Row, skipped

SECTION = "exactness"
EngineFactory = Callable[[str], Engine]  # prefix-cache mode ("off", "fixed:0", "naive") -> a fresh engine
# greedy over two blocks of the engine's block length (ENGINE_DECODE: 8, the fixed step schedule,
# so every denoising step is one forward whose argmax matters)
EXACT_PARAMS = {"max_new_tokens": 16, "temperature": 0}
ENGINE_DECODE = {"block_length": 8, "threshold": None}
# |runtime - float64 reference| / max(1, max |reference logit|) allowed for float32 forwards
FP32_RELATIVE_TOL = 1e-4
# |output token logprob difference| allowed where the tokens must be equal (float32 rounding of
# differently packed batches; a real bug moves them by orders of magnitude more)
LOGPROB_TOL = 1e-4
TOP_LOGPROBS = 5
# the same between two bf16 backends (they differ only in the attention kernel's rounding)
BF16_RELATIVE_TOL = 3e-2


@dataclass(frozen=True)
class Workload:
    """A shared few-shot prefix and prompts that extend it (the bundled model's task)."""

    prefix: str
    prompts: tuple[str, ...]


def fewshot_workload(n_prompts: int = 4, num_shots: int = 5, seed: int = 0) -> Workload:
    """``n_prompts`` held-out questions of ONE family of the bundled few-shot task (a family has
    ``num_shots`` questions)."""
    if not 1 <= n_prompts <= num_shots:
        raise ValueError(f"n_prompts must be in [1, num_shots={num_shots}] (one family), got {n_prompts}")
    items = heldout_items(n_prompts, num_shots=num_shots, seed=seed, questions_per_family=n_prompts)
    return Workload(items[0]["prefix"], tuple(it["prompt"] for it in items))


def run_requests(engine: Engine, greqs: Sequence[GenerateRequest], timeout: float = 300.0) -> list[RequestEvent]:
    """Submit ``greqs`` atomically (one step sees them all) and wait for every final event."""
    done: dict[int, RequestEvent] = {}
    all_done = threading.Event()
    lock = threading.Lock()

    def keep(i: int) -> Callable[[RequestEvent], None]:
        def cb(ev: RequestEvent) -> None:
            if ev.finished:
                with lock:
                    done[i] = ev
                    if len(done) == len(greqs):
                        all_done.set()
        return cb
    engine.submit_many(list(greqs), [keep(i) for i in range(len(greqs))])
    if not all_done.wait(timeout):
        raise TimeoutError(f"{len(greqs) - len(done)} of {len(greqs)} requests did not finish in {timeout:.0f} s")
    errors = [ev.error for ev in done.values() if ev.error]
    if errors:
        raise RuntimeError(errors[0])
    return [done[i] for i in range(len(greqs))]


def _request(engine: Engine, text: str, params: dict[str, Any], depth: int | None = None) -> GenerateRequest:
    # the top TOP_LOGPROBS logprobs of every output token ride along: comparing tokens alone would
    # miss a bug that moves every logit but no argmax of a model as sure of its answers as the
    # bundled one (its chosen tokens' logprobs are ~ -1e-7 whatever happens)
    decode = params.get("max_new_tokens", 1) > 0
    return GenerateRequest(engine.encode(text), SamplingParams.from_dict(params), bicache_depth=depth,
                           return_logprob=decode, top_logprobs_num=TOP_LOGPROBS if decode else 0)


def _compare(a: Sequence[RequestEvent], b: Sequence[RequestEvent]) -> tuple[int, float]:
    """(requests with the same tokens, max |logprob difference| over those requests' output
    positions and the token ids in both top lists)."""
    same, worst = 0, 0.0
    for x, y in zip(a, b):
        if x.output_ids != y.output_ids:
            continue
        same += 1
        for tx, ty in zip(x.meta_info["output_top_logprobs"], y.meta_info["output_top_logprobs"]):
            lx, ly = {t[1]: t[0] for t in tx or []}, {t[1]: t[0] for t in ty or []}
            worst = max([worst, *(abs(lx[i] - ly[i]) for i in lx.keys() & ly.keys())])
    return same, worst


def check_depth0_equals_off(make_engine: EngineFactory, work: Workload) -> Row:
    """``fixed:0`` with the prefix cached gives the tokens of ``off``, one request at a time."""
    name = "depth 0 == cache off"
    outs = {}
    for mode in ("off", "fixed:0"):
        eng = make_engine(mode)
        try:
            if mode != "off":
                run_requests(eng, [_request(eng, work.prefix, {"max_new_tokens": 0})])
            outs[mode] = [run_requests(eng, [_request(eng, p, EXACT_PARAMS)])[0] for p in work.prompts]
            n_prefix = len(eng.encode(work.prefix))
        finally:
            eng.shutdown()
    cached = [ev.meta_info["cached_tokens"] for ev in outs["fixed:0"]]
    depths = {span_depth(ev.meta_info) for ev in outs["fixed:0"]}
    same, lp_diff = _compare(outs["off"], outs["fixed:0"])
    n = len(work.prompts)
    detail = (f"{same}/{n} requests equal to cache off, top-{TOP_LOGPROBS} logprobs within {lp_diff:.1e}; "
              f"{min(cached)}+ of {n_prefix} prefix tokens found, depth {depths}")
    if min(cached) < n_prefix - 1:
        return Row(SECTION, name, FAIL, detail + " (the prefix was not found in the cache: the check proves nothing)")
    return Row(SECTION, name, PASS if same == n and lp_diff <= LOGPROB_TOL and depths == {0} else FAIL, detail)


def check_batched_equals_alone(make_engine: EngineFactory, work: Workload, n_layers: int) -> Row:
    """A ``naive`` engine (nodes hold every layer) runs the prompts at forced depths 0, 1, L/2, L, ...
    each alone and then all in one batch, from the same cache state (the prefix alone, captured by
    a prefix-only request: the cache is flushed and refilled before each run)."""
    name = "batched == alone (mixed depths)"
    wanted = [(0, 1, n_layers // 2, n_layers)[i % 4] for i in range(len(work.prompts))]
    eng = make_engine("naive")
    try:
        def fresh() -> None:
            if not eng.flush_cache():
                raise RuntimeError("flush_cache timed out")
            run_requests(eng, [_request(eng, work.prefix, {"max_new_tokens": 0})])

        alone = []
        for p, d in zip(work.prompts, wanted):
            fresh()
            alone.append(run_requests(eng, [_request(eng, p, EXACT_PARAMS, d)])[0])
        fresh()
        together = run_requests(eng, [_request(eng, p, EXACT_PARAMS, d) for p, d in zip(work.prompts, wanted)])
        eng.check_integrity()
    finally:
        eng.shutdown()
    d_alone = [span_depth(ev.meta_info) for ev in alone]
    d_together = [span_depth(ev.meta_info) for ev in together]
    same, lp_diff = _compare(alone, together)
    n = len(work.prompts)
    detail = (f"{same}/{n} requests equal, top-{TOP_LOGPROBS} logprobs within {lp_diff:.1e}; depths {d_together} "
              f"in one batch")
    if len(set(d_together)) < min(3, n) or d_alone != d_together:
        return Row(SECTION, name, FAIL, detail + f" (alone: {d_alone}; the batch must mix >= 3 depths)")
    return Row(SECTION, name, PASS if same == n and lp_diff <= LOGPROB_TOL else FAIL, detail)


def judge_depth_forward(label: str, rep: DepthForwardReport, rel_tol: float = FP32_RELATIVE_TOL) -> Row:
    """PASS when every error and the dense states are within ``rel_tol`` x max(1, logit scale) and
    reuse from another context (and a recomputed head) moves the logits by more than 10x that."""
    name = f"depth-d forward vs float64 ({label})"
    bound = rel_tol * max(1.0, rep.ref_scale)
    detail = (f"max |err| {rep.max_err:.1e} (bound {bound:.1e}), {len(rep.errors)} forwards, depths 0..{rep.n_layers} "
              f"alone and mixed, {rep.backend}; reuse moves logits >= {rep.min_reuse_effect:.2f}")
    problems = []
    if rep.logit_shift != rep.ref_shift:
        problems.append(f"logit shift {rep.logit_shift}, the checkpoint's {rep.ref_shift}")
    bad = [e for e in rep.errors if not e[-1] <= bound]  # a NaN fails too
    if bad or not rep.errors:
        p, a, d, kind, err = max(bad, key=lambda e: e[-1] if e[-1] == e[-1] else float("inf")) if bad else (0,) * 5
        problems.append(f"{len(bad)} forwards beyond the bound, worst at p={p} a={a} d={d} {kind}: {err:.2e}")
    if not rep.states_err <= bound:
        problems.append(f"dense states differ by {rep.states_err:.2e}")
    if not (rep.min_reuse_effect > 10 * bound and min(rep.head_effect.values(), default=0.0) > bound):
        problems.append("reuse hardly moves the logits: the comparison proves nothing")
    if problems:
        return Row(SECTION, name, FAIL, detail + "; " + "; ".join(problems))
    return Row(SECTION, name, PASS, detail)


def check_depth_forward(folder: str, label: str, device: torch.device, attn: AttentionBackend) -> Row:
    """The packed depth-d forward of the checkpoint in ``folder`` (float32) against float64."""
    return judge_depth_forward(label, compare_depth_forward(folder, device, attn))


def check_flashinfer(device: torch.device) -> Row:
    """FlashInfer's bf16 depth-d forwards (alone and mixed) against the torch backend's, on a
    random LLaDA with head_dim 64 and GQA (the bundled model's head_dim 16 is not a FlashInfer
    size, and a backend that silently fell back to torch would pass for nothing)."""
    name = "flashinfer == torch backend"
    if importlib.util.find_spec("flashinfer") is None:
        return Row(SECTION, name, skipped("flashinfer not installed"))
    if device.type != "cuda":
        return Row(SECTION, name, skipped(f"flashinfer needs a CUDA device (this run: {device.type})"))
    from ..testing import make_tiny_llada
    with tempfile.TemporaryDirectory(prefix="bicache-selftest-") as tmp:
        folder = make_tiny_llada(tmp, n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, mlp_hidden_size=512)
        reps = {}
        for backend in ("torch", "flashinfer"):
            attn = create_backend(backend, device, torch.bfloat16, 64)
            reps[backend] = compare_depth_forward(folder, device, attn, dtype="bfloat16")
    fi, ref = reps["flashinfer"], reps["torch"]
    if fi.backend != "flashinfer":
        return Row(SECTION, name, FAIL, f"the flashinfer backend fell back to {fi.backend}")
    diff = max(float((a - b).abs().max()) for a, b in zip(fi.outputs, ref.outputs))
    bound = BF16_RELATIVE_TOL * max(1.0, ref.ref_scale)
    detail = (f"max |flashinfer - torch| {diff:.1e} (bound {bound:.1e}), {len(fi.outputs)} bf16 forwards; vs float64: "
              f"flashinfer {fi.max_err:.1e}, torch {ref.max_err:.1e}")
    return Row(SECTION, name, PASS if diff <= bound else FAIL, detail)
