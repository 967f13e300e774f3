"""Submit several generate requests to an engine at once and wait for all of them (the tests'
"batched equals alone" checks)."""

from __future__ import annotations

import threading
from typing import Any


def run_together(eng: Any, greqs: list, timeout: float = 120.0) -> list:
    """Submit ``greqs`` atomically with ``eng.submit_many`` (they share the first step) and return
    their final events in the same order; fails if they have not all finished after ``timeout`` s."""
    events, done = {}, threading.Event()

    def on_event(ev):
        if ev.finished:
            events[ev.rid] = ev
            if len(events) == len(greqs):
                done.set()
    rids = eng.submit_many(greqs, [on_event] * len(greqs))
    assert done.wait(timeout)
    return [events[r] for r in rids]
