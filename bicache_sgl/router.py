"""Data parallelism as SGLang users run it: N server workers behind ``sglang-router``.

``python -m bicache_sgl.launch_server --dp-size N [--router-policy P] [server flags]`` runs
:class:`DataParallelLauncher`:

- N workers, each a plain ``python -m bicache_sgl.launch_server`` (its own server process and
  engine process, its own bicache prefix tree) on a free loopback port, with the same flags
  minus the launcher's own (``--host``, ``--port``, ``--dp-size``, ``--router-*``,
  ``--dp-max-restarts``). Without ``--num-threads`` each engine gets its share of the CPUs; on
  a machine with at least N GPUs (and ``--device auto``/``cuda``) worker i gets ``cuda:i``.
- ``python -m sglang_router.launch_router`` in front, listening on ``--host``/``--port``
  (``--policy cache_aware`` unless ``--router-policy`` says otherwise; every other
  ``--router-NAME [VALUE]`` flag goes to the router as ``--NAME [VALUE]``). Its Prometheus
  exporter binds to a free loopback port unless ``--router-prometheus-port`` is given.
- Readiness: the log line ``The server is fired up and ready to roll! URL: ...`` (the single
  server's) once every worker answers ``/health`` and the router lists all of them as healthy.
- Supervision: a worker whose process exits, or whose ``/health`` answers 503 three times in a
  row (its engine process died), is removed from the router at once, reported with the end of its
  log, and restarted on a new port up to ``--dp-max-restarts`` times; once it answers it is added
  back. A worker that fails during the initial start-up stops the launch (a bad flag or
  checkpoint would fail the same way again). If the router exits, everything stops (exit 1).
- Shutdown: SIGTERM / Ctrl-C reaches the launcher (the children run in their own sessions) and
  the launcher sends SIGTERM to the router and every worker at once: workers drain for
  ``--graceful-shutdown-timeout`` seconds as a single server does; whatever still runs after
  that plus a margin is killed. Children also get SIGTERM if the launcher itself dies (Linux
  parent-death signal), so a SIGKILLed launcher leaves no workers behind.

Children's output is copied to this process's stderr with a ``[dp<i>]`` / ``[router]`` prefix.
``python -m bicache_sgl.router stats --url URL`` prints each worker's prompt and cached token
counters behind a router (the router's own ``/get_server_info`` has no ``internal_states``);
see docs/scaleout.md.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bicache_sgl.runtime import available_cpus, describe_exit, find_free_port, http_json
from bicache_sgl.server.args import ServerArgs, redact_unknown

logger = logging.getLogger("bicache_sgl.router")

ROUTER_PACKAGE = "sglang-router"
ROUTER_VERSION = "0.3.2"  # the version this launcher was written and tested against (pyproject's 'router' extra)
INSTALL_HINT = f'pip install "{ROUTER_PACKAGE}=={ROUTER_VERSION}"  (in a checkout: pip install -e ".[router]")'
# the single server's readiness line (bicache_sgl.server.app.READY_MESSAGE; not imported: that
# module loads FastAPI and the engine package, which this process never needs)
READY_MESSAGE = "The server is fired up and ready to roll!"
WORKER_HOST = "127.0.0.1"
# flags the launcher sets itself; each takes one value
_LAUNCHER_FLAGS = ("--host", "--port", "--dp-size", "--data-parallel-size", "--router-policy", "--dp-max-restarts")
_ROUTER_LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error", "critical": "error"}
_HEALTH_PROBE_INTERVAL_S = 2.0
_HEALTH_503_LIMIT = 3  # consecutive 503 answers on /health before a worker counts as failed
_ROUTER_REGISTRATION_TIMEOUT_S = 120.0
_KILL_MARGIN_S = 15.0  # after the drain time, before SIGKILL

# Run a module with the parent-death signal set (Linux): if the launcher dies, even by SIGKILL,
# the child gets SIGTERM. The signal survives exec; argv: <launcher pid> <module> <args...>.
_EXEC_WITH_PDEATHSIG = (
    "import os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    import ctypes\n"
    "    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)\n"  # PR_SET_PDEATHSIG
    "    if os.getppid() != int(sys.argv[1]):\n"
    "        sys.exit(0)\n"  # the launcher died before the prctl
    "os.execv(sys.executable, [sys.executable, '-m'] + sys.argv[2:])\n"
)


class RouterNotInstalledError(RuntimeError):
    pass


def require_router() -> None:
    """Raise :class:`RouterNotInstalledError` (naming the package and the extra) when
    ``sglang_router`` cannot be imported."""
    if importlib.util.find_spec("sglang_router") is None:
        raise RouterNotInstalledError(
            f"--dp-size > 1 puts the workers behind SGLang's router, the optional package '{ROUTER_PACKAGE}', "
            f"which is not installed. Install it with: {INSTALL_HINT}")


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The launcher's command line minus the flags the launcher owns (``--host``, ``--port``,
    ``--dp-size``, ``--router-*``, ``--dp-max-restarts``): what every worker gets. Everything
    else, unknown SGLang flags included, reaches the workers as the user wrote it."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, _ = a.partition("=")
        if name in _LAUNCHER_FLAGS:
            i += 1 if eq else 2
        elif name.startswith("--router-"):
            i += 1
            if not eq:  # its values, up to the next flag
                while i < len(argv) and not argv[i].startswith("--"):
                    i += 1
        else:
            out.append(a)
            i += 1
    return out


def _has_flag(argv: Sequence[str], *names: str) -> bool:
    return any(a.partition("=")[0] in names for a in argv)


def worker_threads(dp_size: int, cpus: int | None = None) -> int:
    """Engine torch threads per worker when ``--num-threads`` is not given: the CPUs shared out,
    one per worker left to its HTTP server process (cf. ``default_engine_threads``), at least 1."""
    n = available_cpus() if cpus is None else cpus
    return max(1, (n - dp_size) // dp_size)


def _cuda_device_count(device: str) -> int:
    if device == "cpu":
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # no torch / no driver: CPU workers
        return 0


@dataclass
class _Child:
    """A supervised process (a worker or the router) with its output copied to our stderr."""

    name: str
    proc: subprocess.Popen | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    reader: threading.Thread | None = None

    def start(self, module: str, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), module, *args]
        self.tail.clear()
        # own session: a terminal's Ctrl-C reaches only the launcher, which stops the children in order
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        self.reader = threading.Thread(target=self._copy_output, args=(self.proc,), daemon=True,
                                       name=f"output-{self.name}")
        self.reader.start()

    def _copy_output(self, proc: subprocess.Popen) -> None:
        prefix = f"[{self.name}] "
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            # the launcher's ready line is the only one a harness may wait for: a worker's is reworded
            line = line.replace(READY_MESSAGE, "worker ready:")
            self.tail.append(line)
            try:
                sys.stderr.write(prefix + line + "\n")
                sys.stderr.flush()
            except (OSError, ValueError):  # our stderr is gone; keep draining the pipe
                pass

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """``sig`` to the child's process group (the child and anything it started in its group)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def log_tail(self, n: int = 15) -> str:
        return "\n".join(list(self.tail)[-n:])


@dataclass
class _Worker(_Child):
    index: int = 0
    port: int = 0
    state: str = "starting"  # starting -> ready; dead when it failed and is not restarted
    restarts: int = 0
    started_at: float = 0.0
    bad_health: int = 0
    next_probe: float = 0.0

    @property
    def url(self) -> str:
        return f"http://{WORKER_HOST}:{self.port}"


class LaunchError(RuntimeError):
    pass


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`LaunchError` when the router could not listen on ``host:port`` (checked
    before any worker starts, so a taken port fails in a second, not after the model loads)."""
    if port == 0:
        raise LaunchError("--dp-size needs a fixed --port: it is the router's, the one clients use")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            raise LaunchError(f"the router cannot listen on {host}:{port}: {e}") from None


class DataParallelLauncher:
    """``--dp-size N``: N workers + sglang-router; :meth:`run` blocks until SIGTERM/SIGINT (exit
    status 0) or an unrecoverable failure (1)."""

    def __init__(self, args: ServerArgs, argv: Sequence[str]) -> None:
        self.args = args
        self.base_argv = worker_argv(argv)
        self.user_set_threads = _has_flag(argv, "--num-threads")
        self.user_set_prometheus = any(a.partition("=")[0] in ("--prometheus-port", "--prometheus-host")
                                       for a in args.router_extra_args)
        self.workers = [_Worker(name=f"dp{i}", index=i) for i in range(args.dp_size)]
        self.router = _Child(name="router")
        self.router_url = args.url
        self.stop_signal: int | None = None
        self.startup_s = 0.0
        self._gpus: int | None = None

    # ------------------------------------------------------------------------------ children
    def _gpu_count(self) -> int:
        if self._gpus is None:
            self._gpus = _cuda_device_count(self.args.device)
        return self._gpus

    def _worker_flags(self, w: _Worker) -> list[str]:
        flags = [*self.base_argv, "--host", WORKER_HOST, "--port", str(w.port)]
        if not self.user_set_threads and not os.environ.get("OMP_NUM_THREADS"):
            flags += ["--num-threads", str(worker_threads(self.args.dp_size))]
        gpus = self._gpu_count()
        if gpus and self.args.device in ("auto", "cuda"):
            flags += ["--device", f"cuda:{w.index % gpus}"]
        return flags

    def _start_worker(self, w: _Worker) -> None:
        w.port = find_free_port(WORKER_HOST)
        w.state, w.bad_health, w.next_probe = "starting", 0, 0.0
        w.started_at = time.monotonic()
        w.start("bicache_sgl.launch_server", self._worker_flags(w))
        logger.info("worker %d: pid %d, %s", w.index, w.pid, w.url)

    def _router_flags(self) -> list[str]:
        a = self.args
        flags = ["--host", a.host, "--port", str(a.port), "--worker-urls", *[w.url for w in self.workers],
                 "--policy", a.router_policy, "--log-level", _ROUTER_LOG_LEVELS.get(a.log_level, "warn"),
                 "--shutdown-grace-period-secs", str(math.ceil(a.graceful_shutdown_timeout))]
        if not self.user_set_prometheus:  # the router's exporter defaults to 0.0.0.0:29000
            flags += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(find_free_port())]
        if a.api_key:  # the router's key to the workers; with it the router also wants it from clients
            flags += ["--api-key", a.api_key]
        return flags + list(a.router_extra_args)  # the user's --router-* flags last: they win

    # ------------------------------------------------------------------------------ router API
    def _router_workers(self) -> list[dict[str, Any]] | None:
        try:
            out = http_json(self.router_url + "/workers", api_key=self.args.api_key, timeout=5)
        except (OSError, ValueError):
            return None
        return out.get("workers") if isinstance(out, dict) else None

    def _router_remove(self, url: str) -> None:
        for entry in self._router_workers() or []:
            if entry.get("url") == url and entry.get("id"):
                try:
                    http_json(self.router_url + "/workers/" + urllib.parse.quote(str(entry["id"])), method="DELETE",
                              api_key=self.args.api_key, timeout=5)
                except OSError as e:
                    logger.warning("could not remove %s from the router: %s", url, e)

    def _router_add(self, url: str) -> bool:
        try:
            http_json(self.router_url + "/workers", {"url": url}, api_key=self.args.api_key, timeout=5)
            return True
        except OSError as e:
            logger.warning("could not add %s to the router: %s", url, e)
            return False

    # ------------------------------------------------------------------------------ probes
    def _health_status(self, w: _Worker, timeout: float = 2.0) -> int | None:
        """HTTP status of the worker's /health, None when it does not answer."""
        try:
            with urllib.request.urlopen(w.url + "/health", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (OSError, ValueError):
            return None

    def _wait(self, what: str, done: Callable[[], bool], timeout: float | None, children: Sequence[_Child]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            if self.stop_signal is not None:
                raise LaunchError(f"stopped by {signal.Signals(self.stop_signal).name} while waiting for {what}")
            for c in children:
                if not c.alive():
                    raise LaunchError(f"{c.name} (pid {c.pid}) {describe_exit(c.poll())} while waiting for {what}; "
                                      f"its last output:\n{c.log_tail()}")
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.2)

    # ------------------------------------------------------------------------------ run
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stop_signal is not None and signum == signal.SIGINT:  # a second Ctrl-C: no drain
            logger.warning("second interrupt: killing every child now")
            for c in [self.router, *self.workers]:
                c.signal(signal.SIGKILL)
        self.stop_signal = signum

    def run(self) -> int:
        require_router()
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            try:
                self._start()
            except LaunchError as e:
                if self.stop_signal is None:
                    logger.error("data-parallel launch failed: %s", e)
                    return 1
                logger.info("%s", e)
                return 0
            return self._supervise()
        finally:
            self._shutdown()
            for s, h in old.items():
                signal.signal(s, h)

    def _start(self) -> None:
        a = self.args
        t0 = time.monotonic()
        check_port_free(a.host, a.port)
        extra = redact_unknown(a.router_extra_args)
        logger.info("data parallelism: %d workers behind sglang-router (policy %s%s) on %s", a.dp_size,
                    a.router_policy, f", router flags {' '.join(extra)}" if extra else "", self.router_url)
        for w in self.workers:
            self._start_worker(w)
        self._wait("the workers to answer /health",
                   lambda: all(self._health_status(w, 1.0) == 200 for w in self.workers), None, self.workers)
        for w in self.workers:
            w.state = "ready"
        self.router.start("sglang_router.launch_router", self._router_flags())
        logger.info("router: pid %d on %s", self.router.pid, self.router_url)

        def registered() -> bool:
            entries = self._router_workers() or []
            healthy = {e.get("url") for e in entries if e.get("is_healthy")}
            return all(w.url in healthy for w in self.workers)

        self._wait("the router to register every worker", registered, _ROUTER_REGISTRATION_TIMEOUT_S,
                   [self.router, *self.workers])
        self.startup_s = time.monotonic() - t0
        logger.info("%s URL: %s (sglang-router, policy %s, %d workers: %s; started in %.1f s)", READY_MESSAGE,
                    self.router_url, a.router_policy, a.dp_size, " ".join(w.url for w in self.workers),
                    self.startup_s)

    def _supervise(self) -> int:
        while self.stop_signal is None:
            time.sleep(0.2)
            if not self.router.alive():
                logger.error("the router (pid %d) %s; stopping the workers. Its last output:\n%s", self.router.pid,
                             describe_exit(self.router.poll()), self.router.log_tail())
                return 1
            now = time.monotonic()
            for w in self.workers:
                if self.stop_signal is not None:
                    break
                if w.state == "dead":
                    continue
                if not w.alive():
                    self._worker_failed(w, describe_exit(w.poll()))
                elif w.state == "starting":
                    self._check_restarted(w, now)
                elif now >= w.next_probe:
                    self._probe(w, now)
            if self.workers and all(w.state == "dead" for w in self.workers):
                logger.error("every worker has failed and none is left to restart; stopping")
                return 1
        logger.info("%s: stopping the router and %d workers", signal.Signals(self.stop_signal).name,
                    len(self.workers))
        return 0

    def _probe(self, w: _Worker, now: float) -> None:
        w.next_probe = now + _HEALTH_PROBE_INTERVAL_S
        status = self._health_status(w)
        if status == 503 and self.stop_signal is None:
            w.bad_health += 1
            if w.bad_health >= _HEALTH_503_LIMIT:
                logger.error("worker %d (%s) answers 503 on /health (its engine process is gone); stopping it",
                             w.index, w.url)
                self._stop_child(w)
        elif status == 200:
            w.bad_health = 0

    def _check_restarted(self, w: _Worker, now: float) -> None:
        if self._health_status(w, 1.0) == 200:
            if self._router_add(w.url):
                w.state = "ready"
                logger.info("worker %d is back (pid %d, %s) and added to the router", w.index, w.pid, w.url)
        elif now - w.started_at > max(300.0, 5 * self.startup_s):
            logger.error("worker %d (pid %d) did not answer within %.0f s of its restart; stopping it", w.index,
                         w.pid, now - w.started_at)
            self._stop_child(w)

    def _worker_failed(self, w: _Worker, how: str) -> None:
        if w.reader is not None:
            w.reader.join(timeout=2)  # its last lines
        self._router_remove(w.url)
        logger.error("worker %d (pid %d, %s) %s; removed from the router. Its last output:\n%s", w.index, w.pid,
                     w.url, how, w.log_tail())
        if w.restarts < self.args.dp_max_restarts:
            w.restarts += 1
            logger.warning("restarting worker %d (restart %d of %d)", w.index, w.restarts, self.args.dp_max_restarts)
            self._start_worker(w)
        else:
            w.state = "dead"
            alive = sum(x.state != "dead" for x in self.workers)
            logger.error("worker %d is not restarted (--dp-max-restarts %d used up); %d of %d workers left", w.index,
                         self.args.dp_max_restarts, alive, len(self.workers))

    def _stop_child(self, c: _Child) -> None:
        c.signal(signal.SIGTERM)
        try:
            if c.proc is not None:
                c.proc.wait(self.args.graceful_shutdown_timeout + _KILL_MARGIN_S)
        except subprocess.TimeoutExpired:
            c.signal(signal.SIGKILL)

    def _shutdown(self) -> None:
        children = [c for c in (self.router, *self.workers) if c.alive()]
        for c in children:
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.graceful_shutdown_timeout + _KILL_MARGIN_S
        for c in children:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) did not stop in time; killing it", c.name, c.pid)
                c.signal(signal.SIGKILL)
                try:
                    c.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        for c in (self.router, *self.workers):
            if c.reader is not None:
                c.reader.join(timeout=2)


def launch_data_parallel(args: ServerArgs, argv: Sequence[str]) -> int:
    """Entry point of ``launch_server --dp-size N`` (N > 1); returns the exit status."""
    try:
        return DataParallelLauncher(args, argv).run()
    except RouterNotInstalledError as e:
        logger.error("%s", e)
        return 1


# ---------------------------------------------------------------------------------- statistics
COUNTERS = ("num_requests_total", "prompt_tokens_total", "cached_tokens_total", "computed_layer_tokens",
            "skipped_layer_tokens")


def cluster_stats(router_url: str, api_key: str | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """Each worker's counters behind a router (from the router's ``/workers`` list and each
    worker's ``/get_server_info``), and their sums: ``{"workers": [{"url", <COUNTERS>,
    "cached_fraction", "saved_compute_fraction"}...], "total": {...}}``. ``cached_fraction`` is
    the share of prompt tokens found in the worker's prefix tree (SGLang's cached tokens);
    ``saved_compute_fraction`` the share of layer-token computations bicache skipped (reused
    layers only; 0 at depth 0). A worker that does not answer gets ``"error"``."""
    listing = http_json(router_url.rstrip("/") + "/workers", api_key=api_key, timeout=timeout)
    rows: list[dict[str, Any]] = []
    for entry in listing.get("workers", []):
        url = entry.get("url")
        row: dict[str, Any] = {"url": url, "healthy": entry.get("is_healthy")}
        try:
            info = http_json(url + "/get_server_info", api_key=api_key, timeout=timeout)
            state = (info.get("internal_states") or [{}])[0]
            row.update({k: int(state.get(k) or 0) for k in COUNTERS})
        except (OSError, ValueError) as e:
            row["error"] = str(e)
        rows.append(row)
    total = {k: sum(r.get(k, 0) for r in rows) for k in COUNTERS}
    for r in [*rows, total]:
        if "prompt_tokens_total" in r:
            r["cached_fraction"] = (r["cached_tokens_total"] / r["prompt_tokens_total"]
                                    if r["prompt_tokens_total"] else 0.0)
            layer_tokens = r["computed_layer_tokens"] + r["skipped_layer_tokens"]
            r["saved_compute_fraction"] = r["skipped_layer_tokens"] / layer_tokens if layer_tokens else 0.0
    return {"workers": rows, "total": total}


def _main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bicache_sgl.router",
                                description="Counters of the bicache_sgl workers behind an sglang-router.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stats", help="each worker's requests, prompt tokens and cached (prefix-hit) tokens")
    s.add_argument("--url", default="http://127.0.0.1:30000", help="the router's URL")
    s.add_argument("--api-key", default=None)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ns = p.parse_args(argv)
    stats = cluster_stats(ns.url, ns.api_key)
    if ns.json:
        import json

        print(json.dumps(stats, indent=1))
        return
    print(f"{'worker':28} {'requests':>9} {'prompt tok':>11} {'cached tok':>11} {'cached':>7} {'saved compute':>14}")
    for r in [*stats["workers"], {"url": "total", **stats["total"]}]:
        if "error" in r:
            print(f"{r['url']:28} error: {r['error']}")
            continue
        print(f"{r['url']:28} {r['num_requests_total']:>9} {r['prompt_tokens_total']:>11} "
              f"{r['cached_tokens_total']:>11} {r['cached_fraction']:>7.1%} {r['saved_compute_fraction']:>14.1%}")


if __name__ == "__main__":
    _main()
