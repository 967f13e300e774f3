"""examples/bench_server_overhead.py --floor-only: this machine's HTTP and pipe floor, measured
against a real uvicorn server and a real child process (no model)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "bench_server_overhead.py"


def test_floor_only_prints_a_round_trip_per_client_and_for_the_pipe():
    out = subprocess.run([sys.executable, str(SCRIPT), "--floor-only", "--items", "4", "--rounds", "1",
                          "--floor-gap-ms", "1"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    figs = re.findall(r"floor: (bare HTTP POST +\w+|pipe round trip to another process): back to back "
                      r"([\d.]+) ms, after 1 ms idle ([\d.]+) ms", out.stdout)
    assert [f[0].split()[-1] for f in figs] == ["new", "keepalive", "process"], out.stdout
    assert all(0 < float(a) < 1000 and 0 < float(b) < 1000 for _, a, b in figs)


def test_a_negative_floor_gap_is_refused():
    out = subprocess.run([sys.executable, str(SCRIPT), "--floor-only", "--floor-gap-ms", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--floor-gap-ms must be >= 0" in out.stderr
