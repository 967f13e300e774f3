"""The engine pipe read on the event loop (issue 22): ``EngineProcessClient.attach_loop`` moves the
reading from the receiver thread to the loop, so an event reaches its request without a thread
hop. Events, round trips, logprob texts (decoded off the loop), shutdown and the engine's death
must behave as with the receiver thread.

A real engine process on the bundled model (a few seconds to start per client), no HTTP server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from bicache_sgl.config import EngineConfig, SamplingParams
from bicache_sgl.engine.process import EngineProcessClient
from bicache_sgl.io_struct import GenerateRequest, RequestEvent
from bicache_sgl.server.app import GENERATION_PATHS, create_app
from bicache_sgl.server.args import ServerArgs


def _client() -> EngineProcessClient:
    return EngineProcessClient(EngineConfig(num_threads=1), log_level="warning")


def _request(client: EngineProcessClient, **kw) -> GenerateRequest:
    ids = client.tokenizer.encode("The capital city of France is")
    return GenerateRequest(ids, SamplingParams(max_new_tokens=4, temperature=0.0), **kw)


async def _generate(client: EngineProcessClient, greq: GenerateRequest) -> tuple[list[RequestEvent], set[int]]:
    """Submit on the loop; every event and the threads its callback ran on."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    events: list[RequestEvent] = []
    threads: set[int] = set()

    def on_event(ev: RequestEvent) -> None:
        threads.add(threading.get_ident())
        events.append(ev)
        if ev.finished:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    client.submit(greq, on_event)
    await asyncio.wait_for(done, 120)
    return events, threads


def _run(coro_fn, loop_kind: str) -> None:
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(coro_fn())
    else:
        asyncio.run(coro_fn())


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])  # uvicorn's "auto" loop is uvloop when installed
def test_events_arrive_on_the_loop_thread_and_round_trips_still_answer(loop_kind):
    client = _client()
    try:
        async def run():
            assert client.attach_loop(asyncio.get_running_loop())
            assert client._chan._receiver is None  # the receiver thread handed over and ended
            # whole-message blocking reads and writes on the pipe (uvloop's poll makes it non-blocking)
            assert os.get_blocking(client._chan._conn.fileno())
            assert not client.attach_loop(asyncio.get_running_loop())  # once only
            events, threads = await _generate(client, _request(client))
            assert threads == {threading.get_ident()}
            final = events[-1]
            assert final.finished and final.error is None and final.meta_info["completion_tokens"] >= 1
            # a round trip from a worker thread: its answer is read by the loop
            stats = await asyncio.to_thread(client.get_stats)
            assert stats["engine_pid"] == client.pid
            assert await asyncio.to_thread(client.flush_cache) is True
            # logprob texts are decoded on a worker thread, never on the loop, and still filled in
            events, threads = await _generate(client, _request(client, return_logprob=True,
                                                                return_text_in_logprobs=True))
            assert threading.get_ident() not in threads
            entries = events[-1].meta_info["output_token_logprobs"]
            assert entries and all(isinstance(e[2], str) for e in entries)
            assert [e[2] for e in entries] == [client.tokenizer.decode([e[1]]) for e in entries]
            # shutdown while the loop runs: the engine's goodbye is read, the pipe closed
            await asyncio.to_thread(client.shutdown)
            assert not client.alive and client._chan._conn.closed
        _run(run, loop_kind)
    finally:
        client.shutdown()


def test_the_engine_dying_under_a_loop_reader_fails_its_requests():
    client = _client()
    failures: list[str] = []
    client.on_failure = failures.append
    try:
        async def run():
            assert client.attach_loop(asyncio.get_running_loop())
            loop = asyncio.get_running_loop()
            done: asyncio.Future = loop.create_future()
            got: list[RequestEvent] = []

            def on_event(ev: RequestEvent) -> None:
                got.append(ev)
                if ev.finished:
                    loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

            greq = _request(client)
            greq.params = greq.params.replace(max_new_tokens=960, ignore_eos=True)
            client.submit(greq, on_event)
            os.kill(client.pid, signal.SIGKILL)
            await asyncio.wait_for(done, 60)
            got_all.extend(got)

        got_all: list[RequestEvent] = []
        _run(run, "uvloop")
        got = got_all
        assert got[-1].finished and got[-1].error and "exited unexpectedly" in got[-1].error
        assert len(failures) == 1 and not client.alive
    finally:
        client.shutdown()


def test_generation_routes_come_first_as_plain_starlette_routes():
    from types import SimpleNamespace

    from fastapi.routing import APIRoute

    stub = SimpleNamespace(tokenizer=None, model_path="m", context_length=64, model_config=None,
                           submit_returns_at_once=False)
    routes = create_app(stub, ServerArgs()).routes
    assert [r.path for r in routes[:len(GENERATION_PATHS)]] == list(GENERATION_PATHS)
    assert not any(isinstance(r, APIRoute) for r in routes[:len(GENERATION_PATHS)])
    assert all(isinstance(r, APIRoute) for r in routes[len(GENERATION_PATHS):])
