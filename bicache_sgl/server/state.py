"""What every handler needs, reached as ``request.app.state.server``: the engine (through its typed
interface), the args, tokenizer helpers, counters, readiness and the shutdown drain."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request

from bicache_sgl.constrained import cache_info as constraint_cache_info
from bicache_sgl.engine.interface import EngineClient
from bicache_sgl.engine.process import EngineDeadError
from bicache_sgl.io_struct import RequestEvent
from bicache_sgl.models.tokenize import TextEncoder
from bicache_sgl.server.args import ServerArgs, default_served_model_name
from bicache_sgl.server.bridge import Submission
from bicache_sgl.server.chat import load_chat_template
from bicache_sgl.server.metrics import Metrics
from bicache_sgl.server.protocol import APIError, Item

logger = logging.getLogger("bicache_sgl.server")

SUBMIT_THREADS = 4  # server threads validating and submitting requests without a constraint
CONSTRAINT_SUBMIT_THREADS = 8  # ... and with one (builds themselves run on constrained.index.BUILD_WORKERS)
STATS_WAIT_S = 2.0  # an info route waits this long for the engine's counters, then answers the last ones


class ServerState:
    """Shared by all handlers of one app. Model facts (vocabulary, config) are read from the
    engine when asked, so building the app touches nothing but the engine's name and length."""

    def __init__(self, engine: EngineClient, args: ServerArgs):
        self.engine = engine
        self.args = args
        self.model_path = str(engine.model_path or args.model_path or "")
        self.tokenizer_path = args.tokenizer_path or self.model_path
        self.served_model_name = args.served_model_name or default_served_model_name(self.model_path)
        self.context_length = engine.context_length
        self.chat_template = load_chat_template(args.chat_template)
        self.default_sampling = args.default_sampling_params()
        self.metrics = Metrics(self.served_model_name)
        self._ready = False
        self.engine_failure: str | None = None  # set when the engine (process) died: /health is 503 from then on
        self.draining = False  # shutting down: new requests get 503, running ones finish or are aborted
        self.created = int(time.time())
        self.last_probe_ok = 0.0
        # submissions get their own bounded pools, so /abort_request, /flush_cache and /metrics never
        # wait behind them; requests with a constraint (validation may build it: milliseconds to
        # seconds) have a lane of their own, so a heavy build never holds a plain request either
        self.submit_pool = ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix="bicache-submit")
        self.constraint_pool = ThreadPoolExecutor(CONSTRAINT_SUBMIT_THREADS, thread_name_prefix="bicache-constraint")
        # an engine whose submit never waits (an engine process client with no queue limit: a pure
        # validation and a one-way send): such submissions run on the loop (bridge.Submission)
        self.quick_submit = engine.submit_returns_at_once
        self._stats_call: asyncio.Future | None = None
        self._encoder: TextEncoder | None = None  # made on first use (the engine's tokenizer)
        self._last_stats: dict[str, Any] = {}
        self._last_stats_at = 0.0

    @property
    def ready(self) -> bool:
        """Warmed up, not shutting down, and the engine is alive."""
        return self._ready and self.engine_failure is None

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value

    def engine_failed(self, message: str) -> None:
        """The engine is gone (called by the engine client): /health and /health_generate answer 503."""
        self.engine_failure = message
        logger.error("engine failure: %s; /health now answers 503", message)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # -- tokenizer -------------------------------------------------------------------------
    def _text_encoder(self) -> TextEncoder:
        enc = self._encoder
        if enc is None or enc.tokenizer is not self.tokenizer:
            enc = self._encoder = TextEncoder(self.tokenizer)
        return enc

    def tokenize(self, text: str) -> list[int]:
        """Prompt text -> ids, special tokens added as the model expects (SGLang does the same)."""
        return self._text_encoder()(text)

    def tokenize_rendered(self, text: str) -> list[int]:
        """A chat-template output: its special tokens are already in the text."""
        bos = self.tokenizer.bos_token
        add = not (bos and text.startswith(bos))
        return self._text_encoder()(text, add_special_tokens=add)

    def decode_token(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    # -- accounting --------------------------------------------------------------------------
    def record_finish(self, item: Item, ev: RequestEvent, elapsed: float, ttft: float | None = None) -> None:
        if not item.log_metrics:
            return
        self.metrics.on_finish(len(item.input_ids), ev.meta_info, elapsed, ttft)  # every final meta is whole

    def new_submission(self, items: list[Item], field_names: Mapping[str, str] | None = None) -> Submission:
        """A :class:`Submission` whose finished requests are counted in the metrics;
        ``field_names``: the route's names of the engine's request fields (``Submission``)."""
        constrained = any(it.params.constraint is not None for it in items)
        # a constraint may be built while validating (milliseconds to seconds): never on the loop
        inline = not constrained and self.quick_submit
        return Submission(self.engine, items, on_finish=self.record_finish,
                          executor=self.constraint_pool if constrained else self.submit_pool, inline=inline,
                          field_names=field_names)

    async def engine_stats(self) -> dict[str, Any]:
        """The engine's counters; when the engine does not answer within ``STATS_WAIT_S`` (busy),
        the last ones it gave, marked with their age (one call in flight at a time)."""
        if self._stats_call is None or self._stats_call.done():
            self._stats_call = asyncio.ensure_future(asyncio.to_thread(self.engine.get_stats))
        try:
            stats = dict(await asyncio.wait_for(asyncio.shield(self._stats_call), STATS_WAIT_S) or {})
        except asyncio.TimeoutError:
            if not self._last_stats:
                return {}
            return {**self._last_stats, "stats_age_s": round(time.monotonic() - self._last_stats_at, 3)}
        except EngineDeadError:  # already reported (engine_failed); info routes still answer
            return {}
        except Exception:  # an info route must answer even if the engine is broken
            logger.exception("engine.get_stats() failed")
            return {}
        stats.update(constraint_cache_info())
        self._last_stats, self._last_stats_at = stats, time.monotonic()
        return dict(stats)

    async def internal_state(self) -> dict[str, Any]:
        """``internal_states[0]`` of /server_info."""
        snap = self.metrics.snapshot()
        tokens_per_forward = self.metrics.avg_tokens_per_forward
        state: dict[str, Any] = {
            "avg_tokens_per_forward": tokens_per_forward,
            # alias: sglang.bench_serving and bench_one_batch_server read this SGLang name
            # (speculative decoding's accept length) and print it as "Accept length"
            "avg_spec_accept_length": tokens_per_forward,
            "last_gen_throughput": self.metrics.gen_throughput(),
            "num_requests_total": snap["num_requests_total"],
            "prompt_tokens_total": snap["prompt_tokens_total"],
            "generation_tokens_total": snap["generation_tokens_total"],
            "cached_tokens_total": snap["cached_tokens_total"],
            "token_cache_hit_rate": snap["cache_hit_rate"],
            "forward_passes_total": snap["forward_passes_total"],
            "prefix_cache": self.args.effective_prefix_cache(),
        }
        state.update(await self.engine_stats())
        return state

    async def engine_busy(self) -> int:
        """Requests the engine is running or has queued."""
        st = await self.engine_stats()
        return int(st.get("num_running_reqs", 0) or 0) + int(st.get("num_waiting_reqs", 0) or 0)

    async def shutdown_engine(self) -> None:
        try:
            await asyncio.to_thread(self.engine.shutdown)  # fails what is left, each with an event
        except Exception:  # shutting down anyway
            logger.exception("engine shutdown failed")

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown (SIGTERM/SIGINT), called before uvicorn closes the connections: new
        requests get 503 from now on; running and queued requests get ``timeout`` seconds to
        finish; whatever is still in the engine then is aborted ("server shutting down"), so
        every client still gets an answer (a 503 error, or a stream that ends with an abort
        finish_reason and [DONE]) instead of a cut connection."""
        self.draining = True
        self.ready = False
        deadline = time.monotonic() + timeout
        busy = await self.engine_busy()
        while busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            busy = await self.engine_busy()
        if busy:
            logger.warning("shutting down: aborting %d request(s) still running after %.1f s", busy, timeout)
        else:
            logger.info("shutting down: no request in flight")
        await self.shutdown_engine()

    def check_not_aborted_by_shutdown(self, finals: list[RequestEvent]) -> None:
        """Non-streaming answers for requests the shutdown aborted are a 503, not a 200."""
        if not self.draining:
            return
        for f in finals:
            fr = f.finish_reason
            if isinstance(fr, dict) and fr.get("type") == "abort":
                raise APIError("the server is shutting down; the request was aborted before it finished",
                               status=503)

    def model_info(self) -> dict[str, Any]:
        mc = self.engine.model_config
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": mc.arch,
            "context_length": self.context_length,
            "vocab_size": mc.vocab_size,
            "mask_token_id": mc.mask_token_id,
            "eos_token_ids": list(mc.eos_token_ids),
            "n_layers": mc.n_layers,
        }


def get_state(request: Request) -> ServerState:
    """The :class:`ServerState` of the app serving ``request``."""
    return request.app.state.server
