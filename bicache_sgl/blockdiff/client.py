"""BlockEngineClient: the ``EngineClient`` of a block-diffusion checkpoint (LLaDA2.x, SDAR), so the
HTTP server (native, OpenAI and SGLang-frontend routes) serves it unchanged.

The engine (``blockdiff.engine.BlockEngine``) runs on one thread of the server process; requests
arrive through an inbox; each step is one forward for every running request. Every finished
block emits an event (streaming), with the output cut by the request's stop rule (EOS and
``stop_token_ids``, stop strings; ``decoding/stop.py``); the final event carries the whole
``meta_info``, with the exact-reuse fields: ``cached_tokens`` (whole prompt blocks reused, a
multiple of the block length), ``bicache_depth`` (the number of layers when anything was reused:
reuse is always full depth) and ``reused_prefix_start`` 0.

Parameters the block engine does not implement are refused with a message naming the field
(nothing is accepted and ignored).
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
from ..decoding.stop import StopRule
from ..decoding.text import Detokenizer
from ..io_struct import GenerateRequest, QueueFullError, RequestEvent
from ..models.block_model import load_block_model
from ..models.loader import DTYPE_MAP, load_tokenizer, resolve_model_path
from ..scheduler.validate import check_context, check_prompt_ids
from .engine import BlockEngine, BlockEngineOptions, BlockParams, BlockResult

log = logging.getLogger(__name__)

# The exact block cache's default size in tokens (--max-prefix-cache-tokens sets it); blocks are
# allocated as they are inserted. LLaDA2.0-mini in bf16: 40 KiB per token, 2.5 GiB at this size.
DEFAULT_CACHE_TOKENS = 65536

# SamplingParams fields the block engine leaves at their defaults: field -> (default, why)
_REFUSED = {
    "min_new_tokens": (0, "min_new_tokens"),
    "n": (1, "n > 1 (send the request n times)"),
    "steps": (None, "steps (the total over the generation region); block-diffusion models take steps_per_block"),
    "dllm_algorithm": (None, "dllm_algorithm (block-diffusion models decode with their published per-block "
                             "threshold unmasking)"),
    "dllm_eps": (None, "eps"), "dllm_alg_temp": (None, "alg_temp"), "cfg_scale": (0.0, "cfg_scale"),
    "cache_mode": (None, "cache_mode (block-diffusion models always use their exact block K/V cache)"),
    "refresh_interval": (None, "refresh_interval"), "step_rows": (None, "step_rows"),
    "frequency_penalty": (0.0, "frequency_penalty"), "presence_penalty": (0.0, "presence_penalty"),
    "repetition_penalty": (1.0, "repetition_penalty"), "min_p": (0.0, "min_p"), "logit_bias": ((), "logit_bias"),
    "regex": (None, "regex (structured generation)"), "json_schema": (None, "json_schema (structured generation)"),
}


def is_block_checkpoint(path: str) -> bool:
    """True when the folder's config.json names a block-diffusion family (LLaDA2, SDAR)."""
    import json

    from ..models.block_config import detect_block_family
    f = Path(path) / "config.json"
    try:
        return detect_block_family(json.loads(f.read_text())) is not None
    except (OSError, ValueError):
        return False


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
    for name in ("max_total_tokens", "mem_fraction_static", "bicache_audit_rate", "bicache_audit_min_agreement",
                 "bicache_audit_probation", "calibration_budget_s"):
        if getattr(cfg, name) != getattr(base, name):
            raise ValueError(f"--{name.replace('_', '-')} does not apply to {family}: its engine has no bicache pool, "
                             "profile or audit (exact block reuse); --max-running-requests and "
                             "--max-prefix-cache-tokens size it")
    d, dd = cfg.decode, DecodeDefaults()
    for name in ("cache_mode", "refresh_interval", "step_rows", "dllm_algorithm", "dllm_eps", "dllm_alg_temp"):
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


class BlockEngineClient:
    """EngineClient over a BlockEngine on a thread of this process (module docstring)."""

    submit_returns_at_once = False
    in_process = True

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
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
        # the server's decode flags apply when set away from their (bidirectional engine's)
        # defaults; the checkpoint's published defaults otherwise
        self.model = load_block_model(self.model_path, dtype=dtype, device=device,
                                      block_length=d.block_length if d.block_length != dd.block_length else None)
        self.model_config = cfg = self.model.cfg
        check_engine_flags(config, cfg.family)
        if config.attention_backend == "flashinfer":
            self._use_flashinfer(device, dtype)
        self.default_threshold = d.threshold if d.threshold != dd.threshold else None
        self.default_steps = d.steps_per_block
        self.tokenizer = load_tokenizer(config.tokenizer_path or self.model_path, config.chat_template)
        # config.json's EOS ids, the family's end-of-turn tokens in this vocabulary and the
        # tokenizer's EOS (as the bidirectional engine's loader does): the server's end ids
        from ..models.families import family_named
        vocab = self.tokenizer.get_vocab()
        eos = set(cfg.eos_token_ids)
        eos.update(int(vocab[t]) for t in family_named(cfg.family).end_of_turn if t in vocab)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_ids = tuple(sorted(eos))
        self.context_length = min(config.context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
        B = cfg.decode.block_length
        cache_blocks = (config.max_prefix_cache_tokens or DEFAULT_CACHE_TOKENS) // B
        self.engine = BlockEngine(self.model, BlockEngineOptions(
            prefix_cache=config.prefix_cache != "off", cache_output=True, cache_blocks=cache_blocks,
            max_running=config.max_running_requests))
        self.engine.on_block = self._on_block
        self._live: dict[str, _Live] = {}
        self._by_erid: dict[int, _Live] = {}
        self._inbox: list[tuple[str, Any]] = []
        self._pending_finish: list[int] = []
        self._cond = threading.Condition()
        self._stop = False
        self._stats = {"finished": {"stop": 0, "length": 0, "abort": 0}, "cached_tokens_total": 0,
                       "computed_rows_total": 0, "prompt_tokens_total": 0}
        self._thread = threading.Thread(target=self._loop, name="bicache-block-engine", daemon=True)
        self._thread.start()
        log.info("block-diffusion engine: %s (%s, block length %d, %d layers, prefix reuse %s)", self.model_path,
                 cfg.family, B, cfg.n_layers, "exact whole blocks" if config.prefix_cache != "off" else "off")

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
            "prompt_tokens_total": st["prompt_tokens_total"], "computed_rows_total": st["computed_rows_total"],
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
        if greq.return_logprob:
            raise ValueError(f"return_logprob is not supported for block-diffusion models ({fam})")
        if greq.bicache_depth is not None:
            raise ValueError(f"bicache_depth does not apply to {fam}: its prefix reuse is exact, always at full depth")
        p = greq.params
        for name, (default, what) in _REFUSED.items():
            if getattr(p, name) != default:
                raise ValueError(f"{name}: {what} is not supported for block-diffusion models ({fam})")
        B = cfg.decode.block_length
        if p.block_length is not None and p.block_length != B:
            raise ValueError(f"block_length: {fam} decodes in its block length {B} (the checkpoint's; the exact "
                             f"block cache is keyed by it), got {p.block_length}")
        ids = list(greq.input_ids)
        check_prompt_ids(ids, cfg.vocab_size)  # the engine's rules, as the dLLM engine checks them
        if p.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1 for block-diffusion models")
        check_context(len(ids), p.max_new_tokens, self.context_length, block=B)  # it runs whole blocks
        stops = StopRule(p, self.eos_ids, p.max_new_tokens, Detokenizer(self.tokenizer, p.skip_special_tokens))
        return _Live(greq.rid, greq, stops, on_event, time.perf_counter())

    def _params(self, p: SamplingParams) -> BlockParams:
        temperature = p.temperature if p.temperature is not None else 0.0
        end_ids = tuple(sorted(set(() if p.ignore_eos else self.eos_ids) | set(p.stop_token_ids)))
        steps = p.steps_per_block if p.steps_per_block is not None else self.default_steps
        threshold = p.threshold if p.threshold is not None else self.default_threshold
        return BlockParams(max_new_tokens=p.max_new_tokens, steps=steps, threshold=threshold,
                           temperature=float(temperature), top_k=p.top_k if p.top_k > 0 else None,
                           top_p=p.top_p, seed=p.seed, stop_ids=end_ids,
                           edit_threshold=self.model_config.decode.edit_threshold,
                           max_post_edit_steps=self.model_config.decode.max_post_edit_steps)

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
            try:
                lv.erid = self.engine.submit(lv.greq.input_ids, self._params(lv.greq.params))
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

    def _on_block(self, erid: int, gen: list[int]) -> None:
        lv = self._by_erid.get(erid)
        if lv is None:
            return
        lv.ids, lv.text, reason = lv.stops.check(gen)
        if reason is not None and reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
            # a stop string: the engine would go on, so the request ends after this step (its
            # committed blocks are cached as usual); not here: the engine is mid-step
            lv.reason = reason
            self._pending_finish.append(erid)
            return
        self._emit(lv, self._event(lv, False, None))

    def _finished(self, res: BlockResult) -> None:
        lv = self._by_erid.get(res.rid)
        if lv is None:
            return
        ids, text, reason = lv.stops.check(res.tokens)
        if lv.reason is not None:  # a stop string ended it at a block boundary
            ids, text, reason = lv.ids, lv.text, lv.reason
        if reason is None:
            reason = {"type": "length", "length": len(ids)}
        lv.ids, lv.text = ids, text
        st = self._stats
        st["cached_tokens_total"] += res.meta["cached_tokens"]
        st["computed_rows_total"] += res.meta["computed_rows"]
        st["prompt_tokens_total"] += res.meta["prompt_tokens"]
        self._final(lv, reason, meta=res.meta)

    def _final(self, lv: _Live, reason: dict, meta: dict | None = None, error: str | None = None) -> None:
        self._live.pop(lv.rid, None)
        self._by_erid.pop(lv.erid, None)
        kind = reason.get("type", "abort")
        self._stats["finished"][kind] = self._stats["finished"].get(kind, 0) + 1
        self._emit(lv, self._event(lv, True, reason, meta, error))

    def _event(self, lv: _Live, finished: bool, reason: dict | None, meta: dict | None = None,
               error: str | None = None) -> RequestEvent:
        L = self.model_config.n_layers
        m = {"id": lv.rid, "finish_reason": reason, "prompt_tokens": len(lv.greq.input_ids),
             "completion_tokens": len(lv.ids), "e2e_latency": time.perf_counter() - lv.created}
        if meta is not None:
            R = meta["cached_tokens"]
            m.update({"cached_tokens": R, "bicache_depth": L if R else 0, "reused_prefix_tokens": R,
                      "reused_prefix_start": 0, "prefix_reuse_rule": "exact-block",
                      "block_length": meta["block_length"], "forward_passes": meta["forwards"],
                      "tokens_computed": meta["computed_rows"], "computed_layer_tokens": meta["computed_rows"] * L,
                      "skipped_layer_tokens": R * L})
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
