"""The per-request path between the HTTP layer and the engine process (issue 22): a request
without a constraint is submitted on the event loop itself (no worker-thread hop) and comes back
over the engine pipe; a constrained one, or any with a queue limit, still goes to a pool.

A real engine process on the bundled model (a few seconds to start), no HTTP server.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from bicache_sgl.config import EngineConfig, SamplingParams
from bicache_sgl.engine.process import EngineProcessClient
from bicache_sgl.server.args import ServerArgs
from bicache_sgl.server.protocol import Item, engine_request
from bicache_sgl.server.state import ServerState


@pytest.fixture(scope="module")
def client():
    c = EngineProcessClient(EngineConfig(num_threads=1), log_level="warning")
    yield c
    c.shutdown()


def _item(client: EngineProcessClient, **params) -> Item:
    ids = client.tokenizer.encode("The capital city of France is")
    return Item(engine_request(ids, SamplingParams(max_new_tokens=4, temperature=0.0, **params)))


def test_plain_request_is_submitted_on_the_loop_and_answered(client):
    state = ServerState(client, ServerArgs())
    assert client.submit_returns_at_once and state.quick_submit

    async def run():
        sub = state.new_submission([_item(client)])
        assert sub.inline
        threads = []
        real = client.submit

        def spy(greq, on_event=None):  # the real submit, noting which thread calls it
            threads.append(threading.get_ident())
            return real(greq, on_event)

        client.submit = spy
        try:
            await sub.submit()
        finally:
            del client.submit
        assert threads == [threading.get_ident()]  # the loop's own thread
        finals = [ev async for _, ev in sub.events() if ev.finished]
        return finals

    finals = asyncio.run(run())
    assert len(finals) == 1 and finals[0].error is None
    meta = finals[0].meta_info
    assert meta["completion_tokens"] >= 1 and meta["finish_reason"]["type"] in ("length", "stop")


def test_constrained_request_still_goes_to_the_pool(client):
    state = ServerState(client, ServerArgs())
    sub = state.new_submission([_item(client, regex="(yes|no)")])
    assert not sub.inline and sub.executor is state.constraint_pool


def test_a_queue_limit_makes_submit_wait_for_the_engine():
    c = EngineProcessClient(EngineConfig(num_threads=1, max_queued_requests=4), log_level="warning")
    try:
        assert not c.submit_returns_at_once
        state = ServerState(c, ServerArgs())
        assert not state.quick_submit and not state.new_submission([_item(c)]).inline
    finally:
        c.shutdown()
