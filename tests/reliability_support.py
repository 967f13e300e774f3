"""Shared helpers for the reliability suite (tests/test_reliability_*.py).

Every test there runs against a real server subprocess on a free loopback port, serving a tiny
random LLaDA checkpoint (``bicache_sgl.testing.make_tiny_llada``) with one torch thread. The
servers are started by :func:`serve` (``bicache_sgl.runtime.Runtime`` in a context manager that
always kills the server) and observed only through HTTP (``/get_server_info``) and ``/proc``
(resident memory, ``bicache_sgl.bench.procmem``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bicache_sgl.bench.procmem import rss_bytes  # noqa: F401 - re-exported for the tests
from bicache_sgl.runtime import Runtime
from bicache_sgl.testing import make_tiny_llada

DEFAULT_FLAGS: dict[str, Any] = {"block_length": 8, "steps_per_block": 2, "threshold": "none", "context_length": 384,
                                 "num_threads": 1, "random_seed": 0, "timeout": 180}


@contextlib.contextmanager
def serve(folder: Path, *, seed: int = 0, **flags: Any) -> Iterator[Any]:
    """Start ``python -m bicache_sgl.launch_server`` on a tiny model in ``folder``; yield the
    :class:`bicache_sgl.runtime.Runtime`; always stop it (even when the test failed)."""
    folder = Path(folder)
    model = make_tiny_llada(folder / "model", seed=seed)
    kw = {**DEFAULT_FLAGS, **flags}
    kw.setdefault("log_path", str(folder / "server.log"))
    rt = Runtime(model_path=model, **kw)
    rt.model_path = model
    try:
        yield rt
    finally:
        rt.shutdown()


def server_state(rt: Runtime) -> dict[str, Any]:
    return rt.internal_state()


def wait_idle(rt: Any, timeout: float = 20.0) -> dict[str, Any]:
    """Poll until nothing runs or waits; return the idle state (fails the test on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        st = server_state(rt)
        if st["num_running_reqs"] == 0 and st["num_waiting_reqs"] == 0:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: running {st['num_running_reqs']}, "
                                 f"waiting {st['num_waiting_reqs']}")
        time.sleep(0.05)


def assert_pool_integrity(st: dict[str, Any], *, idle: bool = True) -> None:
    """The prefix pool's slot accounting: free + cached + in-flight == capacity. When idle, no
    slot is in flight and no cached prefix is locked (protected)."""
    cap = st["prefix_cache_capacity_tokens"]
    free, used = st["prefix_cache_free_tokens"], st["prefix_cache_used_tokens"]
    in_flight = st["prefix_cache_in_flight_tokens"]
    assert free + used + in_flight == cap, f"slot leak: free {free} + cached {used} + in flight {in_flight} != {cap}"
    assert 0 <= used <= cap and 0 <= free <= cap
    if idle:
        assert in_flight == 0, f"{in_flight} slots still in flight while idle"
        assert st["prefix_cache_protected_tokens"] == 0, "cache locks not released while idle"
        assert used == st["prefix_cache_evictable_tokens"]


def sse_frames(lines: Any) -> list[Any]:
    """Parsed ``data:`` frames from an iterable of byte/str lines; '[DONE]' stays a string."""
    out: list[Any] = []
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode("utf-8")
        if not line.startswith("data:"):
            continue
        body = line[5:].strip()
        out.append(body if body == "[DONE]" else json.loads(body))
    return out


def wait_until(cond: Any, timeout: float, step: float = 0.1) -> bool:
    """Poll ``cond()`` every ``step`` s until it is true or ``timeout`` s have passed; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` from ``/proc/PID/stat``; None once it is gone or a zombie (a zombie
    runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on the port, and a new server could bind it (SO_REUSEADDR, as uvicorn and
    every other server sets it; connections in TIME_WAIT do not block such a bind)."""
    try:
        socket.create_connection((host, port), timeout=1).close()
        return False  # something still accepts connections
    except OSError:
        pass
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(1)
        return True
    except OSError:
        return False
    finally:
        s.close()


def rss_by_process(pid: int) -> dict[str, int]:
    """Resident set size (bytes) of each process of a server's tree, by role: ``server`` (the
    HTTP process), ``engine`` (its spawned engine process), ``build workers`` (the constraint
    build worker processes of either, ``constrained/_indexer.py``; summed), ``other``. Processes
    that exit while being read are skipped."""
    import psutil  # type: ignore[import-not-found]  # a dev dependency (the suite's RSS readings)

    out = {"server": 0, "engine": 0, "build workers": 0, "other": 0}
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            rss = p.memory_info().rss
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if p.pid == pid:
            role = "server"
        elif "_indexer.py" in cmd:
            role = "build workers"
        elif "multiprocessing" in cmd or "spawn_main" in cmd:
            role = "engine"
        else:
            role = "other"
        out[role] += rss
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def log_has_no_server_errors(rt: Any) -> None:
    log = rt.log_text()
    assert "Traceback" not in log, log[-4000:]
    assert "unexpected error" not in log


def env_flag(name: str, default: int) -> int:
    """Scale knob for a longer local soak, e.g. RELIABILITY_LOAD_REQUESTS=2000."""
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default
