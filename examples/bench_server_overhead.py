"""The per-request server cost: one request at a time through the HTTP server against the same
requests through ``Engine.run_sync`` in this process (docs/performance.md, "the per-request
server cost").

Workload: ``--items`` held-out few-shot questions (bicache_sgl.training.task, 8 shots), each
generating ``--max-new-tokens`` greedily, sent one after another (concurrency 1). Per mode,
client and round it prints three medians:

- ``server``: wall time of one HTTP request (the client's send, the server's parse +
  tokenization, the pipe to the engine process, the engine, the pipe back, the JSON answer,
  the client's read);
- ``alone``: wall time of ``Engine.run_sync`` on the same items (tokenization included);
- ``paired`` (``--route generate`` only): per request, the server wall time minus the engine's
  own ``meta_info.e2e_latency`` (measured inside the engine process from when it built the
  request to its final event), so the model's share cancels out request by request and the
  figure is what the server adds around the engine; far less noisy on a loaded machine than
  ``server - alone``.

``--client`` picks how requests are sent (comma-separated, each measured on its own):

- ``new``: a new connection per request (urllib, ``Connection: close``), as SGLang's frontend
  sends them (``sglang.utils.http_request`` behind ``RuntimeEndpoint`` opens one per call with
  ``urllib.request.urlopen``; streams use a fresh ``requests.post``) and as
  ``sglang.bench_serving`` does (an aiohttp session per request);
- ``keepalive``: one persistent HTTP/1.1 connection reused for every request, as the openai
  client does (httpx with a pool of keep-alive connections).

``--route`` picks the route: ``generate`` (native), ``completions`` (``/v1/completions``, the
same prompt text) or ``chat`` (``/v1/chat/completions``, the prompt as one user message: its
tokens differ from the other routes', so ``alone`` is left out). The OpenAI answers carry no
engine latency, so those routes have no paired figure; with ``--code`` they compare trees by
the per-request wall-time difference instead.

Servers and engines are started once per mode and kept up; rounds alternate between them, so a
slow stretch of a shared machine hits every mode alike.

``--code PATH,PATH`` compares source trees instead (A/B of two checkouts of this project, e.g.
one made with ``git worktree add /tmp/base OLD``; each PATH is a PYTHONPATH whose last folder is
a tree, so ``/opt/extra:/tmp/base`` adds packages to one side): one server per tree and mode,
started from an empty folder with that PYTHONPATH (so ``python -m`` cannot pick up the current
folder), the same request sent to each in turn (A B, then B A), and per tree the medians above
plus, per request, the median ratio of its paired overhead to the first tree's and the median
difference of its wall time from the first tree's.

    python examples/bench_server_overhead.py                       # off and bicache, 3 rounds
    python examples/bench_server_overhead.py --modes off --rounds 5 --items 32 --client keepalive
    python examples/bench_server_overhead.py --modes off --no-alone --code /tmp/base,$PWD
    python examples/bench_server_overhead.py --route chat --client keepalive --no-alone --code /tmp/base,$PWD
    python examples/bench_server_overhead.py --floor-only              # this machine's floor, no model

``--floor`` (and ``--floor-only``) first measures what this machine costs before any of this
project's code runs: the round trip of the same POST to a bare Starlette app under uvicorn (a
handler that parses the JSON body and answers a fixed JSON object, no engine) with each client,
and the round trip of a 1.4 KB message through a pipe to another process (the server -> engine
-> server hops), each sent back to back and after ``--floor-gap-ms`` of idle time (the engine's
share of a request at concurrency 1, during which the server's core waits). On a virtual machine
code that runs right after an idle stretch is several times slower than back to back, so the
second figure is the one the paired overhead compares with.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import shlex
import statistics
import time
import urllib.parse
from typing import Any

import orjson

CLIENTS = ("new", "keepalive")
ROUTES = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}


class KeepAliveClient:
    """POSTs JSON over one persistent HTTP/1.1 connection (reopened if the server closed it), as
    an httpx pool keeps one per host for sequential requests."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.timeout = u.hostname or "127.0.0.1", u.port or 80, timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.conn: http.client.HTTPConnection | None = None

    def post(self, path: str, payload: Any) -> Any:
        body = orjson.dumps(payload)
        for attempt in (0, 1):  # a connection the server timed out is reopened once
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self.conn.request("POST", path, body, self.headers)
                r = self.conn.getresponse()
                data = r.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt:
                    raise
                continue
            if r.status != 200:
                raise RuntimeError(f"POST {path}: HTTP {r.status}: {data[:300]!r}")
            if r.getheader("connection", "").lower() == "close":
                self.close()
            return orjson.loads(data)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def payload(route: str, prompt: str, sp: dict[str, Any]) -> dict[str, Any]:
    """The request body of one few-shot question on ``route`` (greedy, ``max_new_tokens``)."""
    if route == "generate":
        return {"text": prompt, "sampling_params": sp}
    opts = {"model": "default", "max_tokens": sp["max_new_tokens"], "temperature": sp["temperature"]}
    if route == "completions":
        return {"prompt": prompt, **opts}
    return {"messages": [{"role": "user", "content": prompt}], **opts}


class Sender:
    """Sends one route's requests to one server with one kind of client; returns (wall, engine
    latency or None)."""

    def __init__(self, rt: Any, client: str, route: str):
        self.rt, self.client, self.route, self.path = rt, client, route, ROUTES[route]
        self.keepalive = KeepAliveClient(rt.url, rt.api_key) if client == "keepalive" else None

    def send(self, prompt: str, sp: dict[str, Any]) -> tuple[float, float | None]:
        body = payload(self.route, prompt, sp)
        t = time.perf_counter()
        out = self.keepalive.post(self.path, body) if self.keepalive is not None else self.rt.request(self.path, body)
        wall = time.perf_counter() - t
        return wall, (out["meta_info"]["e2e_latency"] if self.route == "generate" else None)

    def close(self) -> None:
        if self.keepalive is not None:
            self.keepalive.close()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="off,bicache", help="comma-separated --prefix-cache modes")
    ap.add_argument("--items", type=int, default=48, help="requests per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode, alternating modes")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--server-args", default="", help="extra launch_server flags, e.g. '--num-threads 1'")
    ap.add_argument("--no-alone", action="store_true", help="skip Engine.run_sync (only the paired figure)")
    ap.add_argument("--code", default="", help="comma-separated source trees to compare, request by request")
    ap.add_argument("--client", default="new,keepalive",
                    help="comma-separated: new (a connection per request, as SGLang's frontend), "
                         "keepalive (one persistent connection, as the openai client)")
    ap.add_argument("--route", default="generate", choices=sorted(ROUTES))
    ap.add_argument("--floor", action="store_true", help="first print this machine's HTTP and pipe floor (below)")
    ap.add_argument("--floor-only", action="store_true", help="print the floor and stop (needs no model)")
    ap.add_argument("--floor-gap-ms", type=float, default=5.0, help="idle time before each floor request")
    args = ap.parse_args(argv)
    if args.floor_gap_ms < 0:
        ap.error("--floor-gap-ms must be >= 0")
    args.clients = [c for c in args.client.split(",") if c]
    bad = [c for c in args.clients if c not in CLIENTS]
    if bad or not args.clients:
        ap.error(f"--client: expected a comma-separated list of {', '.join(CLIENTS)}, got {args.client!r}")
    if args.route == "chat":
        args.no_alone = True  # the chat template changes the prompt: run_sync has no same-token counterpart
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.floor or args.floor_only:
        machine_floor(args.clients, args.items * max(1, args.rounds), args.floor_gap_ms / 1e3)
        if args.floor_only:
            return
    if args.code:
        compare_code(args, [c for c in args.code.split(",") if c])
        return

    from bicache_sgl import Engine
    from bicache_sgl.runtime import Runtime
    from bicache_sgl.training import task

    items = task.heldout_items(args.items, num_shots=8, seed=0, questions_per_family=6)
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    modes = [m for m in args.modes.split(",") if m]
    extra = _flags(args.server_args)
    runtimes = {m: Runtime(None, prefix_cache=m, **extra) for m in modes}
    senders = {(m, c): Sender(runtimes[m], c, args.route) for m in modes for c in args.clients}
    engines = {} if args.no_alone else {m: Engine(prefix_cache=m, num_threads=1) for m in modes}
    try:
        for m in modes:  # warm both paths up (first forward, caches), then start from an empty cache
            for c in args.clients:
                senders[m, c].send(items[0]["prompt"], sp)
            runtimes[m].flush_cache()
            if m in engines:
                _alone(engines[m], items[0]["prompt"], sp)
                engines[m].cache.flush()
        for r in range(args.rounds):
            for m in modes:
                alone: list[float] = []
                if m in engines:
                    eng = engines[m]
                    eng.cache.flush()
                    alone = [_alone(eng, it["prompt"], sp) for it in items]
                for c in args.clients:
                    runtimes[m].flush_cache()
                    lat, paired = [], []
                    for it in items:
                        wall, e2e = senders[m, c].send(it["prompt"], sp)
                        lat.append(wall)
                        if e2e is not None:
                            paired.append(wall - e2e)
                    line = f"round {r + 1} {m:>8} {c:>9}: server {_ms(lat)} ms"
                    if paired:
                        line += f", paired overhead {_ms(paired, 2)} ms"
                    if alone:
                        line += (f", engine alone {_ms(alone)} ms, server - alone "
                                 f"{(statistics.median(lat) - statistics.median(alone)) * 1e3:.1f} ms")
                    print(line, flush=True)
    finally:
        for s in senders.values():
            s.close()
        for rt in runtimes.values():
            rt.shutdown()
        for eng in engines.values():
            eng.shutdown()


FLOOR_APP = """
import orjson
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

ANSWER = orjson.dumps({"text": "x" * 32, "output_ids": list(range(32)),
                       "meta_info": {"id": "0" * 32, "prompt_tokens": 200, "completion_tokens": 32,
                                     "e2e_latency": 0.005, "finish_reason": {"type": "length", "length": 32}}})


async def generate(request):
    orjson.loads(await request.body())
    return Response(ANSWER, media_type="application/json")

app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
"""


def machine_floor(clients: list[str], n: int, gap_s: float) -> None:
    """Print the round trip of a POST to a bare Starlette app and of a message through a pipe to
    another process, back to back and after ``gap_s`` idle (medians of ``n``)."""
    import multiprocessing
    import os
    import subprocess
    import sys
    import tempfile

    from bicache_sgl.runtime import find_free_port, http_json
    from bicache_sgl.training import task

    prompt = task.heldout_items(1, num_shots=8, seed=0, questions_per_family=6)[0]["prompt"]
    body = payload("generate", prompt, {"max_new_tokens": 32, "temperature": 0})
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "floor_app.py"), "w") as f:
            f.write(FLOOR_APP)
        port = find_free_port()
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--app-dir", tmp, "floor_app:app", "--port",
                                 str(port), "--log-level", "warning", "--no-access-log"])
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    http_json(url + "/generate", body, timeout=5)
                    break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("the floor app did not start") from None
                    time.sleep(0.1)
            for c in clients:
                ka = KeepAliveClient(url) if c == "keepalive" else None
                send = functools.partial(ka.post, "/generate", body) if ka else \
                    functools.partial(http_json, url + "/generate", body)
                figs = [_median_rt(send, n, g) for g in (0.0, gap_s)]
                print(f"floor: bare HTTP POST {c:>9}: back to back {figs[0]:.2f} ms, after {gap_s * 1e3:g} ms idle "
                      f"{figs[1]:.2f} ms", flush=True)
                if ka:
                    ka.close()
        finally:
            proc.terminate()
            proc.wait(10)
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    child = ctx.Process(target=_echo, args=(b,), daemon=True)
    child.start()
    msg = b"x" * 1400

    def pipe_rt() -> None:
        a.send_bytes(msg)
        a.recv_bytes()
    try:
        figs = [_median_rt(pipe_rt, n, g) for g in (0.0, gap_s)]
        print(f"floor: pipe round trip to another process: back to back {figs[0]:.3f} ms, after "
              f"{gap_s * 1e3:g} ms idle {figs[1]:.3f} ms", flush=True)
    finally:
        a.send_bytes(b"")
        child.join(10)


def _echo(conn: Any) -> None:
    while msg := conn.recv_bytes():
        conn.send_bytes(msg)


def _median_rt(fn: Any, n: int, gap_s: float) -> float:
    """Median ms of ``fn()`` over ``n`` calls (after 5 warm-up calls), sleeping ``gap_s`` before each."""
    ts = []
    for i in range(n + 5):
        if gap_s:
            time.sleep(gap_s)
        t = time.perf_counter()
        fn()
        if i >= 5:
            ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def _alone(eng: Any, prompt: str, sp: dict[str, Any]) -> float:
    """Wall time of one request through ``Engine.run_sync`` (tokenization included)."""
    from bicache_sgl import SamplingParams
    from bicache_sgl.io_struct import GenerateRequest

    t = time.perf_counter()
    eng.run_sync([GenerateRequest(eng.encode(prompt), SamplingParams(**sp))])
    return time.perf_counter() - t


def compare_code(args: argparse.Namespace, trees: list[str]) -> None:
    """One server per tree and mode; each request goes to every tree in turn (order alternating)."""
    import os
    import tempfile

    from bicache_sgl import Engine
    from bicache_sgl.runtime import Runtime
    from bicache_sgl.training import task

    # each entry is a PYTHONPATH (a tree, or e.g. /opt/extra:/tmp/base to add packages to one side)
    paths = [os.pathsep.join(os.path.abspath(p) for p in t.split(os.pathsep)) for t in trees]
    for t, p in zip(trees, paths):
        if not os.path.isdir(os.path.join(p.split(os.pathsep)[-1], "bicache_sgl")):
            raise SystemExit(f"--code: the last folder of {t!r} has no bicache_sgl folder")
    items = task.heldout_items(args.items, num_shots=8, seed=0, questions_per_family=6)
    sp = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    extra = _flags(args.server_args)
    here = os.getcwd()  # the paths above are already absolute
    os.chdir(tempfile.mkdtemp(prefix="bicache-ab-"))  # `python -m` puts the cwd first on sys.path
    try:
        for mode in [m for m in args.modes.split(",") if m]:
            rts = [Runtime(None, prefix_cache=mode, env={"PYTHONPATH": p},
                           **extra) for p in paths]
            eng = None if args.no_alone else Engine(prefix_cache=mode, num_threads=1)  # this process's tree
            try:
                for client in args.clients:
                    _compare_client(args, trees, rts, eng, mode, client, items, sp)
            finally:
                for rt in rts:
                    rt.shutdown()
                if eng is not None:
                    eng.shutdown()
    finally:
        os.chdir(here)


def _compare_client(args: argparse.Namespace, trees: list[str], rts: list[Any], eng: Any, mode: str,
                    client: str, items: list[dict], sp: dict[str, Any]) -> None:
    """The ``--code`` rounds of one client kind: every request to each tree in turn."""
    senders = [Sender(rt, client, args.route) for rt in rts]
    try:
        for s in senders:
            s.send(items[0]["prompt"], sp)
        if eng is not None:
            _alone(eng, items[0]["prompt"], sp)
        lat: list[list[float]] = [[] for _ in trees]
        paired: list[list[float]] = [[] for _ in trees]
        alone: list[float] = []
        for r in range(args.rounds):
            for rt in rts:
                rt.flush_cache()
            if eng is not None:
                eng.cache.flush()
            for k, it in enumerate(items):
                if eng is not None:
                    alone.append(_alone(eng, it["prompt"], sp))
                order = range(len(trees)) if (r * len(items) + k) % 2 == 0 else reversed(range(len(trees)))
                for i in order:
                    wall, e2e = senders[i].send(it["prompt"], sp)
                    lat[i].append(wall)
                    if e2e is not None:
                        paired[i].append(wall - e2e)
        for i, t in enumerate(trees):
            diff = statistics.median(b - a for a, b in zip(lat[0], lat[i]))
            line = f"{mode:>8} {client:>9} {args.route} {t}: server {_ms(lat[i])} ms"
            if paired[i]:
                ratio = statistics.median(b / a for a, b in zip(paired[0], paired[i]))
                line += f", paired overhead {_ms(paired[i], 2)} ms, paired / first tree's per request {ratio:.2f}"
            line += f", wall - first tree's per request {diff * 1e3:+.2f} ms (n={len(lat[i])})"
            if alone:
                line += f", server - alone {(statistics.median(lat[i]) - statistics.median(alone)) * 1e3:.1f} ms"
            print(line, flush=True)
        if alone:
            print(f"{mode:>8} {client:>9} engine alone (Engine.run_sync, this process): {_ms(alone)} ms", flush=True)
    finally:
        for s in senders:
            s.close()


def _ms(xs: list[float], digits: int = 1) -> str:
    return f"{statistics.median(xs) * 1e3:.{digits}f}"


def _flags(text: str) -> dict[str, object]:
    """``--num-threads 1 --foo`` -> ``{"num_threads": "1", "foo": True}`` (Runtime's keyword form)."""
    out: dict[str, object] = {}
    words = shlex.split(text)
    i = 0
    while i < len(words):
        w = words[i]
        if not w.startswith("--"):
            raise SystemExit(f"--server-args: expected a flag, got {w!r}")
        key = w[2:].replace("-", "_")
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[key] = words[i + 1]
            i += 2
        else:
            out[key] = True
            i += 1
    return out


if __name__ == "__main__":
    main()
