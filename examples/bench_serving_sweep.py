"""Serving sweep: bicache against the baselines through real clients, one table + one plot per run:
the command line of ``bicache_sgl.bench.serving_sweep`` (see its docstring, ``--help`` and
docs/performance.md).

    python examples/bench_serving_sweep.py                     # the default sweep (~15 min on 2 CPU cores)
    python examples/bench_serving_sweep.py --quick             # ~3 min
    python examples/bench_serving_sweep.py --configs dual,bicache+dual --ratios 0.9 --concurrency 16

Needs ``pip install "sglang==0.5.2" pybase64 matplotlib psutil`` (psutil optional).
"""

from bicache_sgl.bench.serving_sweep import main

if __name__ == "__main__":
    main()
