"""SGLang frontend programs (``sgl.function``, ``gen``, ``gen(regex=...)``, ``select``, ``fork``,
``run_batch``) against a real server, with the pinned ``sglang`` (the dev extra) and with the
newest release.

The newest release's base install pulls GPU-only packages, so it is installed the way
docs/server.md describes for users: ``pip install --no-deps --target DIR`` of sglang itself plus
the three packages its frontend imports that the dev extra does not bring (triton, msgspec,
pyzmq: this project no longer depends on pyzmq, its engine process talks over a pipe). DIR is a
cache (``$BICACHE_SGL_SGLANG_NEWEST``, else ``~/.cache/bicache-sgl/sglang-frontend-<version>``),
filled once per machine: about 30 s the first time, nothing after. The programs
(tests/sglang_frontend_program.py) run in a subprocess, with DIR on ``PYTHONPATH`` for the newest.

Without network access the newest-frontend test is skipped on a developer's machine; under CI
(``CI`` set) it fails instead, so CI always covers both frontends.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = Path(__file__).resolve().parent / "sglang_frontend_program.py"

# The newest sglang release (checked in CI beside the pinned one), and what its frontend needs
# beyond the dev extra: `import sglang` reaches sglang.srt.utils, which imports triton, and msgspec.
NEWEST = "0.5.23"
NEWEST_PACKAGES = [f"sglang=={NEWEST}", "triton==3.9.0", "msgspec==0.23.0", "pyzmq==27.3.0"]
INSTALL_TIMEOUT_S = 600


def pinned_version() -> str:
    """The sglang version the dev extra pins (pyproject.toml)."""
    m = re.search(r'"sglang==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert m, "pyproject.toml pins no sglang version"
    return m.group(1)


def newest_dir() -> Path:
    env = os.environ.get("BICACHE_SGL_SGLANG_NEWEST")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "bicache-sgl" / f"sglang-frontend-{NEWEST}"


def install_newest(target: Path) -> float:
    """Install the newest frontend into ``target`` (once; a lock keeps parallel runs from racing).
    Returns the seconds spent installing (0 when the cache was already there)."""
    stamp = target / ".bicache-sgl-packages"
    want = "\n".join(NEWEST_PACKAGES)
    if stamp.is_file() and stamp.read_text() == want:
        return 0.0
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / (target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and stamp.read_text() == want:
            return 0.0
        tmp = target.parent / f"{target.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--no-compile",
               "--target", str(tmp), *NEWEST_PACKAGES]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
        if p.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
        (tmp / stamp.name).write_text(want)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return time.perf_counter() - t0


@pytest.fixture(scope="session")
def sglang_newest() -> Path:
    target = newest_dir()
    try:
        spent = install_newest(target)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        if os.environ.get("CI"):
            pytest.fail(f"could not install the newest sglang frontend: {e}")
        pytest.skip(f"could not install the newest sglang frontend (no package index?): {e}")
    print(f"sglang {NEWEST} frontend in {target} (install: {spent:.1f} s)")
    return target


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The default server (bundled model, bicache on) on a loopback port."""
    from bicache_sgl.runtime import Runtime

    folder = tmp_path_factory.mktemp("frontends")
    rt = Runtime(num_threads=1, max_running_requests=8, timeout=180, log_path=str(folder / "server.log"))
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def items_file(tmp_path_factory) -> Path:
    from bicache_sgl.training import task

    items = [{"prefix": it["prefix"], "question": it["question"], "answer": it["answer"]}
             for it in task.heldout_items(8, 5, seed=0)]
    path = tmp_path_factory.mktemp("frontend_items") / "items.json"
    path.write_text(json.dumps(items))
    return path


def run_program(url: str, items: Path, pythonpath: Path | None) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, str(PROGRAM), url, str(items)], capture_output=True, text=True,
                       timeout=300, env=env, cwd=str(items.parent), check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def check_protocol(res: dict) -> None:
    """What holds on any model (tests/test_block_suites.py runs the programs on a random LLaDA2):
    no program error, one answer per item, cached prefixes, the regex and select constraints, three
    forks joined in order."""
    assert res["errors"] == []
    assert len(res["batch"]) == len(res["labels"]) and all(isinstance(a, str) for a in res["batch"])
    # the radix tree / bicache / exact block cache served the family blocks the questions share
    assert max(res["batch_cached_tokens"]) > 0
    # gen(regex=...) follows the pattern; select picks one of the choices
    assert res["regex_ok"]
    assert res["select"] in [str(d) for d in range(10)]
    # fork: three branches over one prefix, joined into the parent in fork order
    assert len(res["fork_answers"]) == 3 and res["fork_text"] == "".join(res["fork_answers"])


def check_results(res: dict) -> None:
    check_protocol(res)
    labels = res["labels"]
    # run_batch: the bundled model answers its held-out few-shot task (1.000 in docs/evaluation.md)
    correct = sum(a == b for a, b in zip(res["batch"], labels))
    assert correct >= len(labels) - 1, (res["batch"], labels)
    assert res["regex"] == labels[0]
    assert res["fork"] == res["fork_labels"]


def test_frontend_programs_pinned_sglang(server, items_file):
    pytest.importorskip("sglang")
    from importlib.metadata import version

    installed = version("sglang")
    assert installed == pinned_version(), f"the dev extra pins sglang=={pinned_version()}, {installed} is installed"
    res = run_program(server.url, items_file, None)
    assert res["version"] == installed
    check_results(res)


def test_frontend_programs_newest_sglang(server, items_file, sglang_newest):
    res = run_program(server.url, items_file, sglang_newest)
    assert res["version"] == NEWEST
    # the frontend came from the install, not from site-packages
    assert sglang_newest.resolve() in Path(res["file"]).resolve().parents, res["file"]
    check_results(res)
