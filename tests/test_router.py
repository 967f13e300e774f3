"""Data parallelism behind sglang-router (``bicache_sgl/router.py``, docs/scaleout.md), on loopback.

- flag handling and the launcher's worker command line (no servers);
- two workers + the real router: routes through the router, the cached-token fraction of
  shared-prefix traffic with cache_aware routing vs one worker vs round_robin (from the workers'
  counters), one worker SIGKILLed mid-run;
- ``launch_server --dp-size 2`` end to end: one port, a killed worker restarted and re-added to the
  router, SIGTERM stops every process the launcher started.

Tiny random checkpoint, ``--bicache-profile none`` (no start-up calibration; prefixes are still
matched and counted as cached tokens), ``--skip-server-warmup``; every wait and request is bounded.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from reliability_support import parent_pid

from bicache_sgl.router import (
    READY_MESSAGE,
    cluster_stats,
    launch_data_parallel,
    worker_argv,
    worker_threads,
)
from bicache_sgl.server.args import parse_args

TIMEOUT = 30  # every HTTP request
WORKER_FLAGS = {"skip_server_warmup": True, "bicache_profile": "none", "block_length": 8, "num_threads": 1,
                "graceful_shutdown_timeout": 1}


# ------------------------------------------------------------------------------ no servers
def test_dp_flags_parse():
    a = parse_args(["--dp-size", "2", "--router-policy", "round_robin", "--router-cache-threshold", "0.5",
                    "--router-balance-abs-threshold=8", "--cuda-graph-bs", "4", "--router-api-key", "k"])
    assert a.dp_size == 2 and a.router_policy == "round_robin"
    assert a.router_extra_args == ("--cache-threshold", "0.5", "--balance-abs-threshold=8", "--api-key", "k")
    assert a.ignored_args == ("--cuda-graph-bs", "4")  # not a router flag: ignored as before
    assert a.public_dict()["router_extra_args"][-1] == "<redacted>"
    assert parse_args([]).dp_size == 1


@pytest.mark.parametrize("argv,message", [
    (["--dp-size", "0"], "--dp-size must be >= 1"),
    (["--dp-size", "2", "--router-port", "9"], "--router-port is set by the launcher"),
    (["--dp-size", "2", "--router-worker-urls", "http://x"], "--router-worker-urls is set by the launcher"),
    (["--dp-size", "2", "--router-policy", "nope"], "invalid choice"),
    (["--dp-size", "2", "--dp-max-restarts", "-1"], "--dp-max-restarts must be >= 0")])
def test_dp_flags_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_worker_argv_drops_the_launcher_flags():
    argv = ["--model-path", "m", "--host", "0.0.0.0", "--port=31000", "--dp-size", "2", "--router-policy",
            "random", "--router-cache-threshold", "0.5", "--router-request-id-headers", "a", "b",
            "--router-x=1", "--dp-max-restarts", "0", "--data-parallel-size=2", "--block-length", "8",
            "--cuda-graph-bs", "4", "--api-key", "k"]
    assert worker_argv(argv) == ["--model-path", "m", "--block-length", "8", "--cuda-graph-bs", "4",
                                 "--api-key", "k"]
    assert worker_threads(2, cpus=2) == 1 and worker_threads(2, cpus=16) == 7 and worker_threads(4, cpus=1) == 1


def test_ready_message_is_the_servers():
    app = Path(__file__).resolve().parents[1] / "bicache_sgl" / "server" / "app.py"
    assert f'READY_MESSAGE = "{READY_MESSAGE}"' in app.read_text()


def test_missing_router_names_the_package_and_the_extra(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "sglang_router", None)  # find_spec -> None: "not installed"
    argv = ["--dp-size", "2", "--port", "1"]
    with caplog.at_level(logging.ERROR, logger="bicache_sgl.router"):
        assert launch_data_parallel(parse_args(argv), argv) == 1
    text = caplog.text
    assert "sglang-router" in text and '.[router]' in text and "not installed" in text


# ------------------------------------------------------------------------------ live helpers
requests = pytest.importorskip("requests")


def _need_router():
    pytest.importorskip("sglang_router")


def wait_until(cond, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return True
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(step)
    return False


class Router:
    """``python -m sglang_router.launch_router`` on a free loopback port (bounded start and stop)."""

    def __init__(self, urls: list[str], policy: str, log: Path) -> None:
        from bicache_sgl.runtime import find_free_port

        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *urls, "--policy", policy, "--log-level", "warn", "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(find_free_port()), "--shutdown-grace-period-secs", "1"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        ok = wait_until(lambda: {w["url"] for w in requests.get(self.url + "/workers", timeout=2).json()["workers"]
                                 if w["is_healthy"]} >= set(urls), 30)
        if not ok:
            self.stop()
            pytest.fail(f"the router did not register {urls}:\n{Path(log).read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


@pytest.fixture(scope="module")
def workers(tiny_llada, tmp_path_factory):
    """Two plain workers (started together), killed or stopped at the end."""
    _need_router()
    from bicache_sgl.runtime import Runtime

    logs = tmp_path_factory.mktemp("router_workers")
    with ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(Runtime, tiny_llada, timeout=120, log_path=str(logs / f"w{i}.log"), **WORKER_FLAGS)
                for i in range(2)]
        rts = [f.result() for f in futs]
    yield rts
    for rt in rts:
        rt.shutdown()


def workload(groups: int = 5, per_group: int = 4, seed: int = 0) -> list[str]:
    """Shared-prefix traffic: ``groups`` distinct 300-character prefixes, interleaved
    (g0 g1 .. g4 g0 g1 ..). With an odd number of groups, strict alternation over 2 workers
    sends every group to both, so round_robin pays two misses per group and one worker (or
    cache-aware routing) one."""
    rng = random.Random(seed)
    prefixes = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(300)) for _ in range(groups)]
    return [f"{prefixes[i % groups]}\nQuestion {i}: what is {i} plus {i % groups}?\nAnswer:"
            for i in range(groups * per_group)]


def counters(rts) -> tuple[int, int]:
    states = [rt.internal_state() for rt in rts]
    return sum(s["cached_tokens_total"] for s in states), sum(s["prompt_tokens_total"] for s in states)


def run_workload(url: str, rts, prompts: list[str]) -> tuple[float, int]:
    """Send ``prompts`` one by one to ``url``; (cached-token fraction from the workers' counters,
    the sum of the responses' meta_info.cached_tokens)."""
    for rt in rts:
        rt.flush_cache(timeout=10)
    c0, p0 = counters(rts)
    meta_cached = 0
    for text in prompts:
        r = requests.post(url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 4,
                                                                                     "temperature": 0}},
                          timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        meta_cached += r.json()["meta_info"]["cached_tokens"]
    c1, p1 = counters(rts)
    return (c1 - c0) / (p1 - p0), meta_cached


# ------------------------------------------------------------------------------ router + 2 workers
def test_routes_and_hit_rate_cache_aware_vs_round_robin(workers, tiny_llada, tmp_path):
    prompts = workload()
    single, _ = run_workload(workers[0].url, [workers[0]], prompts)

    ca = Router([w.url for w in workers], "cache_aware", tmp_path / "ca.log")
    try:
        # what the router forwards
        assert requests.get(ca.url + "/get_model_info", timeout=TIMEOUT).json()["model_path"] == tiny_llada
        assert requests.get(ca.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"] == tiny_llada
        r = requests.post(ca.url + "/v1/completions", json={"model": tiny_llada, "prompt": "ab", "max_tokens": 2},
                          timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["choices"], r.text
        r = requests.post(ca.url + "/generate", json={"text": "ab", "sampling_params": {"max_new_tokens": 4},
                                                      "stream": True}, timeout=TIMEOUT, stream=True)
        frames = [ln for ln in r.iter_lines() if ln]
        assert r.status_code == 200 and frames[-1] == b"data: [DONE]", frames
        # the router's own /get_server_info has no internal_states (bench_serving's need): docs/scaleout.md
        assert "internal_states" not in requests.get(ca.url + "/get_server_info", timeout=TIMEOUT).json()

        cache_aware, meta_cached = run_workload(ca.url, workers, prompts)
        stats = cluster_stats(ca.url)
        assert {s["url"] for s in stats["workers"]} == {w.url for w in workers}
        assert stats["total"]["cached_tokens_total"] == sum(counters([w])[0] for w in workers)
    finally:
        ca.stop()
    assert meta_cached > 0  # meta_info passes through the router unchanged

    rr = Router([w.url for w in workers], "round_robin", tmp_path / "rr.log")
    try:
        round_robin, _ = run_workload(rr.url, workers, prompts)
    finally:
        rr.stop()
    print(f"cached-token fraction: one worker {single:.3f}, 2 workers cache_aware {cache_aware:.3f}, "
          f"round_robin {round_robin:.3f}")
    assert single > 0.6  # 3 of 4 requests per group reuse a ~90% prefix
    assert abs(cache_aware - single) <= 0.10
    assert round_robin <= cache_aware - 0.15  # measured ~0.70 vs ~0.47


def test_killing_a_worker_mid_run(workers, tmp_path):
    """Round robin (so the dead worker keeps being picked); one worker is SIGKILLed while two
    clients send requests: every request after the kill succeeds, none hangs."""
    router = Router([w.url for w in workers], "round_robin", tmp_path / "kill.log")
    results: list[tuple[float, int | str]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            t = time.monotonic()
            try:
                r = requests.post(router.url + "/generate", json={"text": f"client {k} request {i}",
                                                                   "sampling_params": {"max_new_tokens": 8}},
                                  timeout=TIMEOUT)
                outcome: int | str = r.status_code
            except requests.RequestException as e:
                outcome = type(e).__name__
            with lock:
                results.append((t, outcome))
            i += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(2)]
    try:
        for th in threads:
            th.start()
        assert wait_until(lambda: len(results) >= 6, 30)
        victim = workers[1]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        killed_at = time.monotonic()
        # 20 requests started after the router had 0.5 s to notice (fast requests could otherwise all
        # start inside that window, leaving nothing to check)
        assert wait_until(lambda: sum(t > killed_at + 0.5 for t, _ in results) >= 20, 60)
    finally:
        stop.set()
        for th in threads:
            th.join(TIMEOUT + 5)
        router.stop()
    assert not any(th.is_alive() for th in threads)  # nothing hangs
    after = [o for t, o in results if t > killed_at + 0.5]
    assert after and all(o == 200 for o in after), after
    assert all(o == 200 for t, o in results if t < killed_at - 1.0)


# ------------------------------------------------------------------------------ the launcher
def descendants(root: int) -> set[int]:
    parents = {int(p): parent_pid(int(p)) for p in os.listdir("/proc") if p.isdigit()}
    out, frontier = set(), {root}
    while frontier:
        kids = {p for p, pp in parents.items() if pp in frontier} - out
        out |= kids
        frontier = kids
    return out


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process parents from /proc")
def test_dp_launcher_end_to_end(tiny_llada, tmp_path):
    _need_router()
    from bicache_sgl.runtime import find_free_port, server_flags

    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "dp.log"
    cmd = [sys.executable, "-m", "bicache_sgl.launch_server", "--model-path", tiny_llada, "--port", str(port),
           "--dp-size", "2", "--dp-max-restarts", "1", *server_flags(WORKER_FLAGS)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    def log_text() -> str:
        return log_path.read_text(errors="replace")

    def ready_lines() -> list[str]:
        return [ln for ln in log_text().splitlines() if READY_MESSAGE in ln]

    def healthy_workers() -> set[str]:
        return {w["url"] for w in requests.get(url + "/workers", timeout=5).json()["workers"] if w["is_healthy"]}

    seen: set[int] = set()  # every process the launcher started, for the clean-up below
    try:
        assert wait_until(lambda: ready_lines() or proc.poll() is not None, 120), log_text()[-4000:]
        assert proc.poll() is None, log_text()[-4000:]
        (line,) = ready_lines()  # the launcher's only: the workers' are reworded
        assert f"URL: {url}" in line and not line.startswith("[dp")

        r = requests.post(url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 4}},
                          timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4, r.text
        assert requests.get(url + "/health", timeout=TIMEOUT).status_code == 200
        first = healthy_workers()
        assert len(first) == 2

        # a worker dies: removed from the router, restarted on a new port, added back
        kids = descendants(proc.pid)
        seen |= kids
        worker_pids = [p for p in kids if parent_pid(p) == proc.pid and "launch_server" in
                       Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")]
        assert len(worker_pids) == 2, (kids, worker_pids)
        os.kill(worker_pids[0], signal.SIGKILL)
        assert wait_until(lambda: len(healthy_workers()) == 2 and healthy_workers() != first, 90), \
            log_text()[-4000:]
        assert "restarting worker" in log_text() and "killed by SIGKILL" in log_text()
        for i in range(4):
            r = requests.post(url + "/generate", json={"text": f"after restart {i}",
                                                       "sampling_params": {"max_new_tokens": 4}}, timeout=TIMEOUT)
            assert r.status_code == 200, r.text

        # SIGTERM: every process the launcher started stops
        kids = descendants(proc.pid)
        seen |= kids
        assert len(kids) >= 5  # router + 2 x (server, engine)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0, log_text()[-4000:]
        assert wait_until(lambda: not any(parent_pid(p) is not None for p in kids), 10), \
            [p for p in kids if parent_pid(p) is not None]
    finally:
        if proc.poll() is None:
            seen |= descendants(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for p in seen:  # only if the test failed before they stopped
            try:
                if b"bicache_sgl" in Path(f"/proc/{p}/cmdline").read_bytes() or \
                        b"sglang_router" in Path(f"/proc/{p}/cmdline").read_bytes():
                    os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def test_dp_launcher_fails_fast(tmp_path):
    """A port that is taken, or workers that cannot start, end the launch with status 1 and a
    message, within seconds, leaving no process behind."""
    _need_router()
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "bicache_sgl.launch_server", "--dp-size", "2", "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr[-2000:]

    from bicache_sgl.runtime import find_free_port

    r = subprocess.run([sys.executable, "-m", "bicache_sgl.launch_server", "--dp-size", "2", "--port",
                        str(find_free_port()), "--model-path", str(tmp_path / "no-such-model")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "data-parallel launch failed" in r.stderr and "while waiting for the workers" in r.stderr, r.stderr[-3000:]
    assert "no-such-model" in r.stderr
