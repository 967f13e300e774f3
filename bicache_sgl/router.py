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
import logging
from collections.abc import Sequence

from bicache_sgl.scaleout.children import READY_MESSAGE
from bicache_sgl.scaleout.launcher import (
    DataParallelLauncher,
    LaunchError,
    RouterNotInstalledError,
    check_port_free,
    require_router,
    worker_argv,
    worker_threads,
)
from bicache_sgl.scaleout.stats import cluster_stats
from bicache_sgl.server.args import ServerArgs

__all__ = ["READY_MESSAGE", "DataParallelLauncher", "LaunchError", "RouterNotInstalledError", "check_port_free",
           "cluster_stats", "launch_data_parallel", "require_router", "worker_argv", "worker_threads"]

logger = logging.getLogger("bicache_sgl.router")


def launch_data_parallel(args: ServerArgs, argv: Sequence[str]) -> int:
    """Entry point of ``launch_server --dp-size N`` (N > 1); returns the exit status."""
    try:
        return DataParallelLauncher(args, argv).run()
    except RouterNotInstalledError as e:
        logger.error("%s", e)
        return 1


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
