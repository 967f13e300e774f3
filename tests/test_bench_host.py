"""examples/bench_host.py at a tiny scale: it runs the real cache manager through the trace and
prints the table (and the JSON) with one row per configuration."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_host_tiny_scale_output(tmp_path: Path) -> None:
    out_json = tmp_path / "host.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "bench_host.py"), "--layers", "8", "--prompt-lens", "64,256",
         "--nodes", "30,120", "--at-len", "64", "--requests", "6", "--no-plot", "--json", str(out_json)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Host side per request, L = 8 layers")
    header = next(i for i, line in enumerate(lines) if line.startswith("| prompt tokens"))
    cells = [c.strip() for c in lines[header].strip("|").split("|")]
    assert cells[:3] == ["prompt tokens", "tree nodes (fill / during)", "mean matched"]
    assert "total us/request" in cells and "alloc" in cells and len(cells) == 11
    rows = [line for line in lines[header + 2:] if line.startswith("|")]
    # (64, 120), (256, 120) and the tree-size sweep at 64 tokens: (64, 30)
    assert len(rows) == 3
    got = json.loads(out_json.read_text())
    assert got["layers"] == 8
    configs = {(r["prompt_len"], r["nodes"]) for r in got["results"]}
    assert configs == {(64, 30), (64, 120), (256, 120)}
    for r in got["results"]:
        assert set(r["us"]) == {"peek", "admit", "alloc", "share", "commit", "release", "total", "room"}
        assert all(v >= 0 for k, v in r["us"].items() if k != "room") and math.isfinite(r["us"]["room"])
        # the total accounts for every timed op, the private K/V allocation included
        ops = ("peek", "admit", "alloc", "share", "commit", "release")
        assert math.isclose(r["us"]["total"], sum(r["us"][k] for k in ops))
        # the shared heads, system prompts and conversations are found again: a broken match or
        # insert would report 0 here
        assert 0 < r["matched"] < r["prompt_len"]
        assert r["room_nodes_evicted"] > 0  # the full pool made room by evicting
