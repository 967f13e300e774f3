"""Building token-level indexes with bounded time and memory, and caching them.

outlines-core builds the DFA and the token index in native code that cannot be interrupted and
that allocates freely (a ``(a|b)*a(a|b){25}`` DFA has 2^25 states). So by default the build runs
in a small worker process (``_indexer.py`` run as a script: numpy and outlines-core, no torch),
started on first use and kept for later builds, under a wall-clock limit and an address-space
limit (``RLIMIT_AS``); a build that passes either is killed and reported as
``ConstraintError("regex too complex: ...")``, and the next build starts a fresh worker.
``Limits(isolate=False)`` builds in-process instead (only the static bounds then apply).
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from . import _indexer
from .errors import BuildPoolBusy, ConstraintError
from .vocab import TokenTable


@dataclass(frozen=True)
class Limits:
    """Bounds on building one constraint (all part of the cache key)."""

    build_timeout_s: float = 30.0  # wall clock of one DFA + index build
    build_memory_mb: int = 4096  # address space the build may add (isolated builds)
    max_regex_positions: int = 100_000  # counted repeats multiplied out (checked before building)
    max_states: int = 200_000  # DFA states
    max_token_edges: int = 50_000_000  # (state, token) transitions before compression
    max_class_edges: int = 500_000  # (state, token class) transitions: the DP's work per position
    max_schema_nodes: int = 20_000  # subschemas, properties and enum/const values of one JSON schema (up front)
    max_schema_properties: int = 100  # properties of one object schema (up front: optional ones nest the regex)
    isolate: bool = True  # build in the worker process (time and memory enforced)


@dataclass
class IndexData:
    """A compiled token-level index (see ``_indexer.build``)."""

    n_states: int
    initial: int
    accepting: np.ndarray  # bool [S]
    token_class: np.ndarray  # int32 [N], -1: allowed in no state
    n_classes: int
    src: np.ndarray  # int32 [E] class edges, sorted by (src, cls)
    cls: np.ndarray
    dst: np.ndarray
    token_edges: int
    build_s: float = 0.0


def env_int(name: str, default: int) -> int:
    """A memory bound a user sets in the environment (read once, at import; inherited by the
    engine process and the build workers). A value that is not an integer >= 1 stops the import
    with a message naming the variable."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {raw!r}")
    return value


# A build worker keeps the heap of its largest build (77 MiB after a 2^16-state DFA, 122 MiB after
# 2^17; 30 MiB fresh): one whose resident memory is past this after a build is restarted before the
# next one (0.1 s, and the vocabulary sent again), so the workers' memory settles.
BUILD_WORKER_MAX_RSS_MB = env_int("BICACHE_SGL_BUILD_WORKER_MAX_RSS_MB", 64)


def _rss_mb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) >> 10
    except (OSError, ValueError):
        pass
    return None


class _Worker:
    """One build worker process (borrowed from the pool by one build at a time)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.vocab_key: str | None = None

    def _spawn(self) -> None:
        self.proc = subprocess.Popen([sys.executable, _indexer.__file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
                                     close_fds=True)
        self.vocab_key = None

    def kill(self) -> None:
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=10)
            except Exception:
                pass
        self.proc = None
        self.vocab_key = None

    def _send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
        self.proc.stdin.flush()

    def _recv(self, deadline: float):
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        size = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            buf += chunk
            if size is None and len(buf) >= 8:
                (size,) = struct.unpack("<Q", bytes(buf[:8]))
            if size is not None and len(buf) >= 8 + size:
                return pickle.loads(bytes(buf[8:8 + size]))

    def build(self, table: TokenTable, regex: str, limits: Limits) -> dict:
        deadline = time.monotonic() + limits.build_timeout_s
        lim = {"memory_bytes": limits.build_memory_mb << 20, "max_states": limits.max_states,
               "max_edges": limits.max_token_edges}
        try:
            if self.proc is None or self.proc.poll() is not None:
                self._spawn()
            if self.vocab_key != table.fingerprint:
                self._send(("vocab", table.fingerprint, list(table.tokens)))
                self._recv(time.monotonic() + 120.0)
                self.vocab_key = table.fingerprint
            self._send(("build", table.fingerprint, regex, lim))
            status, res = self._recv(deadline)
        except TimeoutError:
            self.kill()
            raise ConstraintError(f"regex too complex: building its automaton took longer than "
                                  f"{limits.build_timeout_s:g} s") from None
        except (EOFError, BrokenPipeError, OSError):
            code = None
            if self.proc is not None:
                try:
                    code = self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            self.kill()
            raise ConstraintError(f"regex too complex: building its automaton exceeded the memory limit "
                                  f"({limits.build_memory_mb} MiB; the build worker died, status {code})") from None
        if status == "need_vocab":  # the worker restarted between calls
            self.vocab_key = None
            return self.build(table, regex, limits)
        self.recycle_if_large()
        if status != "ok":
            raise ConstraintError(str(res))
        return res

    def recycle_if_large(self) -> None:
        """Stop the worker when a build left it holding more than BUILD_WORKER_MAX_RSS_MB (its
        heap is not given back); the next build starts a fresh one."""
        if self.proc is None:
            return
        rss = _rss_mb(self.proc.pid)
        if rss is not None and rss > BUILD_WORKER_MAX_RSS_MB:
            self.kill()


BUILD_WORKERS = 2  # build worker processes: at most this many fresh builds run at once


class _WorkerPool:
    """Idle build workers; a build borrows one, so a slow build holds only its own worker (never
    the cache, never the other builds)."""

    def __init__(self, size: int) -> None:
        self._all = [_Worker() for _ in range(size)]
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        for w in self._all:
            self._idle.put(w)

    def build(self, table: TokenTable, regex: str, limits: Limits) -> dict:
        try:
            worker = self._idle.get(timeout=limits.build_timeout_s)
        except queue.Empty:
            raise BuildPoolBusy(f"the server is busy building other constraints (every one of its {len(self._all)} "
                                  f"build workers stayed busy for {limits.build_timeout_s:g} s); try again") from None
        try:
            return worker.build(table, regex, limits)
        finally:
            self._idle.put(worker)

    def kill(self) -> None:
        for w in self._all:
            w.kill()

    def alive(self) -> int:
        return sum(w.proc is not None and w.proc.poll() is None for w in self._all)


_WORKERS = _WorkerPool(BUILD_WORKERS)
_LOCK = threading.Lock()  # the cache and the in-flight table only, never held during a build
_CACHE: OrderedDict[tuple, IndexData | ConstraintError] = OrderedDict()
_INFLIGHT: dict[tuple, threading.Event] = {}  # a key being built: later callers wait for it
# the index cache (per process: the server's and the engine's): LRU, refusals included
CACHE_SIZE = env_int("BICACHE_SGL_CONSTRAINT_CACHE_ENTRIES", 64)  # entries
CACHE_EDGES = env_int("BICACHE_SGL_CONSTRAINT_CACHE_EDGES", 4_000_000)  # class edges of cached indexes, together


def _cached(key: tuple) -> IndexData | None:
    hit = _CACHE.get(key)
    if hit is None:
        return None
    _CACHE.move_to_end(key)
    if isinstance(hit, ConstraintError):
        raise ConstraintError(str(hit))
    return hit


def build_index(regex: str, table: TokenTable, limits: Limits) -> IndexData:
    """The token-level index of an already validated ``regex`` over ``table`` (cached per
    (regex, token table, limits); failures are cached too, so a pathological regex sent again
    is refused at once). The same key built by two callers at once is built once."""
    key = (regex, table.fingerprint, limits)
    while True:
        with _LOCK:
            hit = _cached(key)
            if hit is not None:
                return hit
            pending = _INFLIGHT.get(key)
            if pending is None:
                _INFLIGHT[key] = done = threading.Event()
                break
        if not pending.wait(limits.build_timeout_s + 30.0):
            raise ConstraintError(f"regex too complex: another request's build of it did not finish within "
                                  f"{limits.build_timeout_s:g} s")
    try:
        t0 = time.perf_counter()
        try:
            if limits.isolate:
                res = _WORKERS.build(table, regex, limits)
            else:
                try:
                    res = _indexer.build(list(table.tokens), regex, limits.max_states, limits.max_token_edges)
                except ValueError as e:
                    raise ConstraintError(str(e)) from None
            if len(res["src"]) > limits.max_class_edges:
                raise ConstraintError(f"regex too complex: {len(res['src'])} (state, token class) transitions "
                                      f"(limit {limits.max_class_edges})")
            data = IndexData(build_s=time.perf_counter() - t0, **res)
        except BuildPoolBusy:  # not the regex's fault: not cached
            raise
        except ConstraintError as e:
            with _LOCK:
                _CACHE[key] = e
                _trim()
            raise
        with _LOCK:
            _CACHE[key] = data
            _trim()
        return data
    finally:
        with _LOCK:
            _INFLIGHT.pop(key, None)
        done.set()


def seed(regex: str, table: TokenTable | str, limits: Limits, data: IndexData) -> None:
    """Put an index built elsewhere (another process, same tokenizer) into the cache, so the same
    constraint is not built twice (the server process validates, the engine process serves)."""
    fp = table if isinstance(table, str) else table.fingerprint
    with _LOCK:
        _CACHE.setdefault((regex, fp, limits), data)
        _trim()


def cache_info() -> dict[str, int]:
    """Sizes for /get_server_info: cached indexes, their class edges, builds in flight, workers."""
    with _LOCK:
        return {"constraint_index_cache_entries": len(_CACHE),
                "constraint_index_cache_edges": sum(len(v.src) for v in _CACHE.values() if isinstance(v, IndexData)),
                "constraint_builds_in_flight": len(_INFLIGHT), "constraint_build_workers_alive": _WORKERS.alive()}


def _trim() -> None:
    def edges() -> int:
        return sum(len(v.src) for v in _CACHE.values() if isinstance(v, IndexData))
    while len(_CACHE) > CACHE_SIZE or (len(_CACHE) > 1 and edges() > CACHE_EDGES):
        _CACHE.popitem(last=False)


def shutdown_worker() -> None:
    """Stop the build workers (each is restarted on its next isolated build)."""
    _WORKERS.kill()
