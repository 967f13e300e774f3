"""``--dp-size N``: :class:`DataParallelLauncher` starts N workers and sglang-router in front of
them, supervises them (restarts, router registration) and stops them (bicache_sgl/router.py has
the whole behaviour; docs/scaleout.md the user's view)."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from bicache_sgl.procinfo import available_cpus, describe_exit
from bicache_sgl.runtime import find_free_port, http_json
from bicache_sgl.scaleout.children import READY_MESSAGE, WORKER_HOST, Child, Worker
from bicache_sgl.server.args import ServerArgs, redact_unknown

logger = logging.getLogger("bicache_sgl.router")  # one logger for the launcher's whole output

ROUTER_PACKAGE = "sglang-router"
ROUTER_VERSION = "0.3.2"  # the version this launcher was written and tested against (pyproject's 'router' extra)
INSTALL_HINT = f'pip install "{ROUTER_PACKAGE}=={ROUTER_VERSION}"  (in a checkout: pip install -e ".[router]")'
# flags the launcher sets itself; each takes one value
_LAUNCHER_FLAGS = ("--host", "--port", "--dp-size", "--data-parallel-size", "--router-policy", "--dp-max-restarts")
_ROUTER_LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error", "critical": "error"}
_HEALTH_PROBE_INTERVAL_S = 2.0
_HEALTH_503_LIMIT = 3  # consecutive 503 answers on /health before a worker counts as failed
_ROUTER_REGISTRATION_TIMEOUT_S = 120.0
_KILL_MARGIN_S = 15.0  # after the drain time, before SIGKILL


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
        self.workers = [Worker(name=f"dp{i}", index=i) for i in range(args.dp_size)]
        self.router = Child(name="router")
        self.router_url = args.url
        self.stop_signal: int | None = None
        self.startup_s = 0.0
        self._gpus: int | None = None

    # ------------------------------------------------------------------------------ children
    def _gpu_count(self) -> int:
        if self._gpus is None:
            self._gpus = _cuda_device_count(self.args.device)
        return self._gpus

    def _worker_flags(self, w: Worker) -> list[str]:
        flags = [*self.base_argv, "--host", WORKER_HOST, "--port", str(w.port)]
        if not self.user_set_threads and not os.environ.get("OMP_NUM_THREADS"):
            flags += ["--num-threads", str(worker_threads(self.args.dp_size))]
        gpus = self._gpu_count()
        if gpus and self.args.device in ("auto", "cuda"):
            flags += ["--device", f"cuda:{w.index % gpus}"]
        return flags

    def _start_worker(self, w: Worker) -> None:
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
    def _health_status(self, w: Worker, timeout: float = 2.0) -> int | None:
        """HTTP status of the worker's /health, None when it does not answer."""
        try:
            with urllib.request.urlopen(w.url + "/health", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (OSError, ValueError):
            return None

    def _wait(self, what: str, done: Callable[[], bool], timeout: float | None, children: Sequence[Child]) -> None:
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

    def _probe(self, w: Worker, now: float) -> None:
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

    def _check_restarted(self, w: Worker, now: float) -> None:
        if self._health_status(w, 1.0) == 200:
            if self._router_add(w.url):
                w.state = "ready"
                logger.info("worker %d is back (pid %d, %s) and added to the router", w.index, w.pid, w.url)
        elif now - w.started_at > max(300.0, 5 * self.startup_s):
            logger.error("worker %d (pid %d) did not answer within %.0f s of its restart; stopping it", w.index,
                         w.pid, now - w.started_at)
            self._stop_child(w)

    def _worker_failed(self, w: Worker, how: str) -> None:
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

    def _stop_child(self, c: Child) -> None:
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
