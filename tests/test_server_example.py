"""examples/frontend_agent.py runs end to end (its own server on a tiny random checkpoint) and
reports cached tokens and a bicache depth for every call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_frontend_agent_example_tiny(tmp_path):
    pytest.importorskip("sglang")
    script = Path(__file__).resolve().parents[1] / "examples" / "frontend_agent.py"
    env = dict(os.environ, TMPDIR=str(tmp_path), TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, str(script), "--tiny"], capture_output=True, text=True, timeout=240, env=env,
                       check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [ln.split() for ln in p.stdout.splitlines() if ln[:1].isdigit()]
    assert len(rows) == 2 * 6  # two tasks x (plan, 3 forks, best, answer)
    # columns: task, call name (1-2 words), prompt, cached, depth, gen, latency
    cached = [int(r[-4]) for r in rows]
    depth = [int(r[-3]) for r in rows]
    assert all(c > 0 for c in cached)  # run_batch cached the shared system prompt first
    assert max(depth) > 0
