"""server.bridge.Submission: how one HTTP request waits for its engine requests' events.

The engine here is a small in-test EngineClient that calls the callbacks from a thread of its own
(as the in-process engine's thread does) or on the loop (as the engine process client reading
its pipe on the loop does); what is under test is the waiting, not the engine."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from bicache_sgl.config import SamplingParams
from bicache_sgl.io_struct import GenerateRequest, RequestEvent
from bicache_sgl.server.bridge import Submission
from bicache_sgl.server.protocol import Item


class ThreadEngine:
    """Records submissions and aborts; ``emit`` calls a request's callback from a new thread."""

    def __init__(self) -> None:
        self.callbacks: dict[str, object] = {}
        self.aborted: list[str] = []

    def submit(self, greq: GenerateRequest, on_event=None) -> str:
        self.callbacks[greq.rid] = on_event
        return greq.rid

    def submit_many(self, greqs, on_events) -> list[str]:
        return [self.submit(g, cb) for g, cb in zip(greqs, on_events)]

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)

    def emit(self, rid: str, n: int, finished: bool) -> None:
        ev = RequestEvent(rid, "x" * n, list(range(n)), finished)
        t = threading.Thread(target=self.callbacks[rid], args=(ev,))
        t.start()
        t.join()


async def _submitted(n: int) -> tuple[ThreadEngine, Submission]:
    """n requests submitted through a Submission (on the running loop)."""
    eng = ThreadEngine()
    sub = Submission(eng, [Item(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=4))) for _ in range(n)])
    await sub.submit()
    return eng, sub


def test_events_from_another_thread_arrive_in_order_and_the_wait_ends_when_all_finished():
    async def run():
        eng, sub = await _submitted(2)
        a, b = sub.rids
        eng.emit(a, 1, False)
        eng.emit(b, 2, True)
        eng.emit(a, 3, True)
        got = [(i, len(ev.output_ids), ev.finished) async for i, ev in sub.events(poll_s=5.0)]
        assert got == [(0, 1, False), (1, 2, True), (0, 3, True)]
        assert sub.done and eng.aborted == []
    asyncio.run(run())


def test_an_event_after_a_wait_began_wakes_it_at_once():
    async def run():
        eng, sub = await _submitted(1)
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, lambda: threading.Thread(target=eng.emit, args=(sub.rids[0], 1, True)).start())
        t = time.monotonic()
        got = [ev async for _, ev in sub.events(poll_s=10.0)]
        assert len(got) == 1 and got[0].finished and time.monotonic() - t < 5.0
    asyncio.run(run())


def test_without_events_the_client_is_polled_and_a_disconnect_aborts_everything():
    async def run():
        eng, sub = await _submitted(2)
        polls: list[float] = []

        async def is_disconnected() -> bool:
            polls.append(time.monotonic())
            return len(polls) >= 3

        got = [ev async for _, ev in sub.events(is_disconnected, poll_s=0.05)]
        assert got == [] and len(polls) == 3 and sub.disconnected and sub.done
        await asyncio.sleep(0.1)  # the engine aborts run on a worker thread
        assert sorted(eng.aborted) == sorted(sub.rids)
    asyncio.run(run())


@pytest.mark.parametrize("from_thread", [False, True])
def test_an_abort_wakes_a_waiting_events_at_once(from_thread):
    async def run():
        eng, sub = await _submitted(1)
        loop = asyncio.get_running_loop()
        if from_thread:  # no loop runs there: the waiter is woken through its own loop
            loop.call_later(0.05, lambda: threading.Thread(target=sub.abort).start())
        else:
            loop.call_later(0.05, sub.abort)
        t = time.monotonic()
        got = [ev async for _, ev in sub.events(poll_s=10.0)]
        assert got == [] and sub.done and time.monotonic() - t < 5.0
        await asyncio.sleep(0.1)
        assert eng.aborted == sub.rids
    asyncio.run(run())
