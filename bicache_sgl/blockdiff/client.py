"""BlockEngineClient: the ``EngineClient`` of a block-diffusion checkpoint (LLaDA2.x, SDAR), so the
HTTP server (native, OpenAI and SGLang-frontend routes) serves it unchanged.

The engine (``blockdiff.engine.BlockEngine``) runs on one thread of the process that holds this
client: the engine process by default (``engine/process_child.py`` builds it there, and the server
talks to it through ``EngineProcessClient`` as to the bidirectional engine), the server process
with ``--engine-in-process``. Requests arrive through an inbox; each step is one forward for every
running request, admitted within the K/V budget (``blockdiff/budget.py``, ``--max-total-tokens``). Every finished
block emits an event (streaming), with the output cut by the request's stop rule (EOS and
``stop_token_ids``, stop strings; ``decoding/stop.py``); the final event carries the whole
``meta_info``, with the exact-reuse fields: ``cached_tokens`` (whole prompt blocks reused, a
multiple of the block length), ``bicache_depth`` (the number of layers when anything was reused:
reuse is always full depth) and ``reused_prefix_start`` 0.

Logit bias, penalties, min-p, ``min_new_tokens``, ``ignore_eos`` and regex / JSON-schema constraints
are the bidirectional engine's own processors applied to the current block
(``blockdiff/sampling.py``); the constraint is compiled here (``scheduler.factory.
request_constraint``, on the server's submit thread), and a finished output that does not fully
match it is reported as an abort, never as a match (a
prefill-only request generates nothing: it ends with length 0). ``n`` > 1 reaches this client as n requests (the
server expands it); a request without ``seed`` samples from a counter advanced by every submitted
request, as the bidirectional engine seeds it. Logprobs (``return_logprob``, ``logprob_start_len``,
``top_logprobs_num``, ``return_text_in_logprobs``) are the bidirectional engine's definitions
(``blockdiff/logprobs.py``), in every event's ``meta_info``; ``max_new_tokens`` 0 is a prefill-only
request (the SGLang frontend's ``select`` scores its choices with them). Parameters the block engine
does not implement are refused with a message naming the field (nothing is accepted and ignored).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..config import DecodeDefaults, EngineConfig, SamplingParams
from ..constrained import Constraint
from ..decoding.logprobs import Logprobs
from ..decoding.stop import StopRule
from ..decoding.text import Detokenizer
from ..io_struct import GenerateRequest, InvalidRequest, QueueFullError, RequestEvent
from ..models.block_model import load_block_model
from ..models.loader import DTYPE_MAP, load_tokenizer, resolve_model_path
from ..scheduler.factory import request_constraint
from ..scheduler.validate import (
    check_context,
    check_logit_bias,
    check_logprob_fields,
    check_min_new_tokens,
    check_prompt_ids,
    reachable_stop_ids,
)
from .algorithm import choose_algorithm
from .budget import block_kv_budget
from .engine import BlockEngine, BlockEngineOptions, BlockParams, BlockResult

log = logging.getLogger(__name__)

# SamplingParams fields the block engine leaves at their defaults: field -> (default, wire name, why)
_REFUSED = {
    "steps": (None, "steps", "the steps over the whole generation region; block-diffusion models take "
                             "steps_per_block"),
    "dllm_algorithm": (None, "dllm_algorithm", "not per request: the server's --dllm-algorithm sets it "
                                               "(LowConfidence or, for LLaDA2.x, JointThreshold)"),
    "dllm_eps": (None, "eps", "a bidirectional (Dream) schedule knob"),
    "dllm_alg_temp": (None, "alg_temp", "a bidirectional (Dream) schedule knob"),
    "cfg_scale": (0.0, "cfg_scale", "classifier-free guidance is not implemented for them"),
    "refresh_interval": (None, "refresh_interval", "they always use their exact block K/V cache"),
    "step_rows": (None, "step_rows", "a step computes the current block's rows"),
}


def block_family(path: str) -> str | None:
    """'llada2' / 'sdar' when the folder's config.json names a block-diffusion family, else None."""
    import json

    from ..models.block_config import detect_block_family
    f = Path(path) / "config.json"
    try:
        return detect_block_family(json.loads(f.read_text()))
    except (OSError, ValueError):
        return None


def is_block_checkpoint(path: str) -> bool:
    """True when the folder's config.json names a block-diffusion family (LLaDA2, SDAR)."""
    return block_family(path) is not None


def check_engine_flags(cfg: EngineConfig, family: str) -> None:
    """Server flags that have no meaning for an exact-reuse family are refused, not ignored."""
    if cfg.bicache_profile is not None:
        raise ValueError(f"--bicache-profile does not apply to {family}: its prefix reuse is exact (whole blocks at "
                         "full depth), no profile is used")
    if cfg.calibration_data is not None:
        raise ValueError(f"--calibration-data does not apply to {family}: its prefix reuse is exact, nothing is "
                         "calibrated")
    if cfg.prefix_cache not in ("off", "bicache"):
        raise ValueError(f"--prefix-cache {cfg.prefix_cache}: {family} takes off or bicache (exact whole-block "
                         "reuse)")
    base = EngineConfig()
    for name in ("bicache_audit_rate", "bicache_audit_min_agreement", "bicache_audit_probation",
                 "bicache_audit_probe_rate", "bicache_audit_raise_bound", "calibration_budget_s"):
        if getattr(cfg, name) != getattr(base, name):
            raise ValueError(f"--{name.replace('_', '-')} does not apply to {family}: its engine has no bicache "
                             "profile or audit (exact block reuse); --max-running-requests, --max-total-tokens and "
                             "--max-prefix-cache-tokens size it")
    d, dd = cfg.decode, DecodeDefaults()
    for name in ("cache_mode", "refresh_interval", "step_rows", "dllm_eps", "dllm_alg_temp"):
        if getattr(d, name) != getattr(dd, name):
            raise ValueError(f"--{name.replace('_', '-')} does not apply to {family}: it decodes with its published "
                             "per-block rule and its exact block K/V cache")
    if cfg.attention_backend not in ("torch", "torch_native", "sdpa", "flashinfer"):
        raise ValueError(f"--attention-backend {cfg.attention_backend}: the block-causal engine of {family} runs "
                         "torch or flashinfer")


@dataclasses.dataclass
class _Live:
    rid: str
    greq: GenerateRequest
    stops: StopRule
    on_event: Callable | None
    created: float
    erid: int = -1
    ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    reason: dict | None = None
    logprobs: Logprobs | None = None  # return_logprob: filled on the engine thread
    constraint: Constraint | None = None
    progress: dict | None = None  # the engine's reuse / work fields at the last finished block


class BlockEngineClient:
    """EngineClient over a BlockEngine on a thread of this process (module docstring)."""

    submit_returns_at_once = False
    in_process = True
    # each submission is validated here (``_validate``), never trusted as validated elsewhere: an
    # EngineProcessClient in front of this one waits for the engine process's answer to a submit
    accepts_valid_requests = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_path = resolve_model_path(config.model_path)
        device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if config.device == "auto" else config.device))
        if config.dtype == "auto":
            dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        elif config.dtype in DTYPE_MAP:
            dtype = DTYPE_MAP[config.dtype]
        else:
            raise ValueError(f"--dtype {config.dtype!r}: choose auto or one of {sorted(DTYPE_MAP)}")
        dd = DecodeDefaults()
        d = config.decode
        # --dllm-algorithm / --dllm-algorithm-config, checked against the family before loading
        from ..models.families import family_named
        family = block_family(self.model_path)
        if family is None:
            raise ValueError(f"{self.model_path}: config.json names no block-diffusion family (LLaDA2.x, SDAR)")
        decoding = family_named(family).decoding
        self.algorithm = choose_algorithm(decoding, d.dllm_algorithm, d.dllm_algorithm_config)
        # the server's decode flags apply when set away from their (bidirectional engine's)
        # defaults; the checkpoint's published defaults otherwise
        self.model = load_block_model(self.model_path, dtype=dtype, device=device,
                                      block_length=d.block_length if d.block_length != dd.block_length else None,
                                      decode_defaults=self.algorithm.defaults,
                                      decode_overrides=self.algorithm.overrides)
        self.model_config = cfg = self.model.cfg
        check_engine_flags(config, cfg.family)
        if config.attention_backend == "flashinfer":
            self._use_flashinfer(device, dtype)
        self.default_threshold = d.threshold if d.threshold != dd.threshold else None
        self.default_steps = d.steps_per_block
        self.algorithm.check_model(cfg.decode, decoding, self.default_threshold, self.default_steps)
        self.tokenizer = load_tokenizer(config.tokenizer_path or self.model_path, config.chat_template)
        # config.json's EOS ids, the family's end-of-turn tokens in this vocabulary and the
        # tokenizer's EOS (as the bidirectional engine's loader does): the server's end ids
        vocab = self.tokenizer.get_vocab()
        eos = set(cfg.eos_token_ids)
        eos.update(int(vocab[t]) for t in family_named(cfg.family).end_of_turn if t in vocab)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_ids = tuple(sorted(eos))
        self.context_length = min(config.context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
        B = cfg.decode.block_length
        self.device = device
        # one budget for the running windows and the cache, sized once the weights are loaded
        self.budget = block_kv_budget(config, cfg, dtype, device, self.context_length)
        self.kv_budget = self.budget.tokens
        self.engine = BlockEngine(self.model, BlockEngineOptions(
            prefix_cache=config.prefix_cache != "off", cache_output=True, cache_blocks=self.budget.cache_tokens // B,
            max_running=config.max_running_requests, eos_ids=self.eos_ids, kv_budget=self.budget.tokens))
        self.engine.on_block = self._on_block
        self._live: dict[str, _Live] = {}
        self._by_erid: dict[int, _Live] = {}
        self._inbox: list[tuple[str, Any]] = []
        self._pending_finish: list[int] = []
        self._seed = 0  # advanced by every submitted request (engine thread): unseeded requests' seeds
        self._cond = threading.Condition()
        self._stop = False
        self._stats = {"finished": {"stop": 0, "length": 0, "abort": 0}, "cached_tokens_total": 0,
                       "computed_rows_total": 0, "prompt_tokens_total": 0, "cache_lookups": 0, "cache_hits": 0}
        self._thread = threading.Thread(target=self._loop, name="bicache-block-engine", daemon=True)
        self._thread.start()
        log.info("block-diffusion engine: %s (%s, block length %d, %d layers, prefix reuse %s; decoding %s; %s)",
                 self.model_path, cfg.family, B, cfg.n_layers,
                 "exact whole blocks" if config.prefix_cache != "off" else "off", self.algorithm.describe(cfg.decode),
                 self.budget.describe())

    def _use_flashinfer(self, device: torch.device, dtype: torch.dtype) -> None:
        """Block-causal attention on FlashInfer (CUDA); kernels that do not take this model's dtype
        or head dim fall back to torch with one warning, as the bidirectional engine does."""
        from ..attention.flashinfer_backend import unsupported_reason
        if device.type != "cuda":
            raise ValueError(f"--attention-backend flashinfer needs a CUDA device; this engine runs on {device}")
        try:
            import flashinfer  # noqa: F401
        except ImportError as e:
            raise ValueError("--attention-backend flashinfer needs the flashinfer-python package: "
                             "pip install 'bicache-sgl[cuda]'") from e
        reason = unsupported_reason(dtype, self.model_config.head_dim)
        if reason is not None:
            log.warning("attention backend 'flashinfer' does not support %s; using the torch backend", reason)
            return
        from ..attention.block_flashinfer import block_causal_attention_flashinfer
        self.model.attention = block_causal_attention_flashinfer

    # ---- EngineClient ---------------------------------------------------------------------------
    def submit(self, greq: GenerateRequest, on_event: Callable[[RequestEvent], None] | None = None) -> str:
        return self.submit_many([greq], [on_event])[0]

    def submit_many(self, greqs: Sequence[GenerateRequest],
                    on_events: Sequence[Callable[[RequestEvent], None] | None]) -> list[str]:
        lives = [self._validate(g, cb) for g, cb in zip(greqs, on_events)]
        with self._cond:
            if self.config.max_queued_requests is not None and \
                    self.engine.num_waiting + len(self._inbox) + len(lives) > self.config.max_queued_requests:
                raise QueueFullError(f"the waiting queue is full ({self.config.max_queued_requests} requests)")
            for lv in lives:
                self._live[lv.rid] = lv
                self._inbox.append(("submit", lv))
            self._cond.notify()
        return [lv.rid for lv in lives]

    def abort(self, rid: str) -> None:
        with self._cond:
            self._inbox.append(("abort", rid))
            self._cond.notify()

    def abort_all(self) -> int:
        with self._cond:
            rids = list(self._live)
            self._inbox.extend(("abort", r) for r in rids)
            self._cond.notify()
        return len(rids)

    def flush_cache(self, timeout: float = 30.0) -> bool:
        done = threading.Event()
        with self._cond:
            self._inbox.append(("flush", done))
            self._cond.notify()
        return done.wait(timeout)

    def get_stats(self) -> dict[str, Any]:
        st = self._stats
        return {
            "num_running_reqs": self.engine.num_running, "num_waiting_reqs": self.engine.num_waiting,
            "finished_reqs_by_reason": dict(st["finished"]), "prefix_cache_mode": self.config.prefix_cache,
            "prefix_reuse_rule": "exact-block", "block_length": self.model_config.decode.block_length,
            "block_prefix_cache_blocks": self.engine.cache.n_blocks, "cached_tokens_total": st["cached_tokens_total"],
            # the bidirectional engine's cache fields (kv_cache/manager.py), for dashboards and
            # harnesses that read them: tokens the cache may hold, holds, and the hit rates of
            # the finished requests (a hit: any whole prompt block reused)
            "prefix_cache_capacity_tokens": self.budget.cache_tokens,
            "prefix_cache_used_tokens": self.engine.cache.n_tokens, "cache_lookups": st["cache_lookups"],
            "cache_hit_rate": st["cache_hits"] / st["cache_lookups"] if st["cache_lookups"] else 0.0,
            "cache_token_hit_rate": (st["cached_tokens_total"] / st["prompt_tokens_total"]
                                     if st["prompt_tokens_total"] else 0.0),
            # one budget over the running windows and the cache (blockdiff/budget.py)
            "kv_budget_tokens": self.kv_budget, "kv_used_tokens": self.engine.kv_in_use,
            "kv_bytes_per_token": self.budget.bytes_per_token,
            "prompt_tokens_total": st["prompt_tokens_total"], "computed_rows_total": st["computed_rows_total"],
            "decoding": self.algorithm.describe(self.model_config.decode),
        }

    def shutdown(self, timeout: float = 10.0) -> None:
        self.abort_all()
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)

    # ---- validation -----------------------------------------------------------------------------
    def attach_loop(self, loop: Any) -> bool:
        return False  # events are delivered on the block engine's thread

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """The block engine runs in this process: it does not die apart from the server."""

    def describe(self) -> str:
        return f"block-diffusion engine in the server process, {torch.get_num_threads()} torch threads"

    def _validate(self, greq: GenerateRequest, on_event: Callable | None) -> _Live:
        cfg = self.model_config
        fam = cfg.family
        if greq.bicache_depth is not None:
            raise InvalidRequest(f"bicache_depth does not apply to {fam}: its prefix reuse is exact, always at "
                                 "full depth", "bicache_depth")
        p = greq.params
        for name, (default, wire, why) in _REFUSED.items():
            if getattr(p, name) != default:
                raise InvalidRequest(f"{wire} is not supported for block-diffusion models ({fam}): {why}", wire)
        if p.cache_mode not in (None, "none"):
            raise InvalidRequest(f"cache_mode {p.cache_mode!r} is not supported for block-diffusion models ({fam}): "
                                 "'prefix' and 'dual' name the bidirectional engine's approximate in-request caches; "
                                 "their in-request K/V is exact, and 'none' turns off the cross-request block cache "
                                 "for this request (it neither reuses nor stores blocks)", "cache_mode")
        # a request may name its block length, as the published generate takes one (SDAR, LLaDA2);
        # the exact block cache is keyed by it (blockdiff/caches.py)
        blen = p.block_length if p.block_length is not None else cfg.decode.block_length
        if blen > self.context_length:
            raise InvalidRequest(f"block_length {blen} is longer than the context length {self.context_length}",
                                 "block_length")
        if p.steps_per_block is not None and cfg.decode.edit_threshold is not None:
            raise InvalidRequest("steps_per_block: this server decodes with joint_threshold (LLaDA2.1's token "
                                 "editing), which has no step schedule (a block takes at most block_length + "
                                 "max_post_edit_steps steps)", "steps_per_block")
        ids = list(greq.input_ids)
        check_prompt_ids(ids, cfg.vocab_size)  # the engine's rules, as the bidirectional engine checks them
        check_logprob_fields(greq)
        if p.n != 1:
            raise InvalidRequest("n: an engine request is one sample (the server and the OpenAI routes send n > 1 "
                                 "as n requests)", "n")
        check_logit_bias(p.logit_bias, cfg.vocab_size)
        check_context(len(ids), p.max_new_tokens, self.context_length, block=blen)  # it runs whole blocks
        check_min_new_tokens(p)
        self.engine.check_fits(len(ids), p.max_new_tokens, blen)
        p = reachable_stop_ids(p, cfg.vocab_size)
        if p is not greq.params:
            greq = dataclasses.replace(greq, params=p)
        constraint = request_constraint(p, self.tokenizer, self.eos_ids)  # may build it (the submit thread)
        detok = Detokenizer(self.tokenizer, p.skip_special_tokens)
        stops = StopRule(p, self.eos_ids, p.max_new_tokens, detok, constraint)
        rec = Logprobs(greq.top_logprobs_num, detok, greq.return_text_in_logprobs) if greq.return_logprob else None
        return _Live(greq.rid, greq, stops, on_event, time.perf_counter(), logprobs=rec, constraint=constraint)

    def _params(self, p: SamplingParams, constraint: Constraint | None, seed: int) -> BlockParams:
        temperature = p.temperature if p.temperature is not None else 0.0
        end_ids = tuple(sorted(set(() if p.ignore_eos else self.eos_ids) | set(p.stop_token_ids)))
        steps = p.steps_per_block if p.steps_per_block is not None else self.default_steps
        threshold = p.threshold if p.threshold is not None else self.default_threshold
        return BlockParams(max_new_tokens=p.max_new_tokens, block_length=p.block_length, steps=steps,
                           threshold=threshold, use_cache=p.cache_mode != "none",
                           temperature=float(temperature), top_k=p.top_k if p.top_k > 0 else None,
                           top_p=p.top_p, seed=p.seed if p.seed is not None else seed, stop_ids=end_ids,
                           edit_threshold=self.model_config.decode.edit_threshold,
                           max_post_edit_steps=self.model_config.decode.max_post_edit_steps,
                           min_new_tokens=p.min_new_tokens, ignore_eos=p.ignore_eos,
                           frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
                           repetition_penalty=p.repetition_penalty, min_p=p.min_p, logit_bias=p.logit_bias,
                           constraint=constraint)

    # ---- the engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._inbox and not (self.engine.num_running or self.engine.num_waiting):
                    self._cond.wait()
                if self._stop:
                    return
                inbox, self._inbox = self._inbox, []
            for kind, arg in inbox:
                self._handle(kind, arg)
            if self.engine.num_running or self.engine.num_waiting:
                try:
                    for res in self.engine.step():
                        self._finished(res)
                    pending, self._pending_finish = self._pending_finish, []
                    for erid in pending:
                        res = self.engine.finish_now(erid)
                        if res is not None:
                            self._finished(res)
                except Exception as e:  # an internal error ends the running requests with it, not the thread
                    log.exception("block engine step failed")
                    for lv in list(self._by_erid.values()):
                        self.engine.abort(lv.erid)
                        self._final(lv, {"type": "abort", "message": f"internal error: {e}"}, error=str(e))

    def _handle(self, kind: str, arg: Any) -> None:
        if kind == "submit":
            lv: _Live = arg
            self._seed += 1  # every submitted request advances it, seeded or not (arrival order)
            try:
                lv.erid = self.engine.submit(lv.greq.input_ids, self._params(lv.greq.params, lv.constraint, self._seed),
                                             lv.logprobs, lv.greq.logprob_start_len)
            except ValueError as e:
                self._final(lv, {"type": "abort", "message": str(e)}, error=str(e))
                return
            self._by_erid[lv.erid] = lv
        elif kind == "abort":
            lv = self._live.get(arg)
            if lv is not None:
                if lv.erid >= 0:
                    self.engine.abort(lv.erid)
                self._final(lv, {"type": "abort", "message": "aborted"})
        elif kind == "flush":
            self.engine.flush_cache()
            arg.set()

    def _on_block(self, erid: int, gen: list[int], progress: dict) -> None:
        lv = self._by_erid.get(erid)
        if lv is None:
            return
        lv.progress = progress
        lv.ids, lv.text, reason = lv.stops.check(gen)
        if reason is not None and reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
            # a stop string: the engine would go on, so the request ends after this step (its
            # committed blocks are cached as usual); not here: the engine is mid-step
            lv.reason = reason
            self._pending_finish.append(erid)
            return
        self._emit(lv, self._event(lv, False, None, progress))

    def _finished(self, res: BlockResult) -> None:
        lv = self._by_erid.get(res.rid)
        if lv is None:
            return
        ids, text, reason = lv.stops.check(res.tokens)
        if lv.reason is not None:  # a stop string ended it at a block boundary
            ids, text, reason = lv.ids, lv.text, lv.reason
        if reason is None:
            reason = {"type": "length", "length": len(ids)}
        if "abort" in res.meta:  # its constraint: no matching output fits (the message says why)
            reason = res.meta["abort"]
        elif res.structured is not None and lv.greq.params.max_new_tokens > 0:  # never claim a match the output is not
            # (a prefill-only request generates nothing: its constraint has no output to match,
            # and it ends with length 0, as on the bidirectional engine)
            reason = res.structured.finished(ids, reason)
        lv.ids, lv.text = ids, text
        st = self._stats
        st["cached_tokens_total"] += res.meta["cached_tokens"]
        st["computed_rows_total"] += res.meta["computed_rows"]
        st["prompt_tokens_total"] += res.meta["prompt_tokens"]
        st["cache_lookups"] += 1
        st["cache_hits"] += int(res.meta["cached_tokens"] > 0)
        self._final(lv, reason, meta=res.meta)

    def _final(self, lv: _Live, reason: dict, meta: dict | None = None, error: str | None = None) -> None:
        self._live.pop(lv.rid, None)
        self._by_erid.pop(lv.erid, None)
        kind = reason.get("type", "abort")
        self._stats["finished"][kind] = self._stats["finished"].get(kind, 0) + 1
        self._emit(lv, self._event(lv, True, reason, meta, error))

    def _event(self, lv: _Live, finished: bool, reason: dict | None, meta: dict | None = None,
               error: str | None = None) -> RequestEvent:
        """The request's event; ``meta``: the engine's reuse / work fields (every block event and
        the final one carry them, as SGLang puts every field in every frame; an abort before
        admission has none)."""
        L = self.model_config.n_layers
        m = {"id": lv.rid, "finish_reason": reason, "prompt_tokens": len(lv.greq.input_ids),
             "completion_tokens": len(lv.ids), "e2e_latency": time.perf_counter() - lv.created}
        meta = meta if meta is not None else lv.progress
        if meta is not None:
            R = meta["cached_tokens"]
            m.update({"cached_tokens": R, "bicache_depth": L if R else 0, "reused_prefix_tokens": R,
                      "reused_tokens_by_depth": {str(L): R} if R else {},
                      "prefix_fraction": round(R / meta["sequence_tokens"], 6) if meta["sequence_tokens"] else 0.0,
                      "reused_prefix_start": 0, "prefix_reuse_rule": "exact-block",
                      "block_length": meta["block_length"], "forward_passes": meta["forwards"],
                      "tokens_computed": meta["computed_rows"], "computed_layer_tokens": meta["computed_rows"] * L,
                      "skipped_layer_tokens": R * L})
        if lv.logprobs is not None:
            m.update(lv.logprobs.meta(len(lv.greq.input_ids), lv.ids))
        return RequestEvent(lv.rid, lv.text, list(lv.ids), finished, reason, m, error)

    def _emit(self, lv: _Live, ev: RequestEvent) -> None:
        cb = lv.on_event
        if cb is None:
            return
        try:
            if hasattr(cb, "many"):
                cb.many([ev])
            else:
                cb(ev)
        except Exception:  # a callback's failure must not stop the engine thread
            log.exception("event callback failed for %s", lv.rid)
