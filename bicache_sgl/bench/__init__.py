"""Benchmark library code behind the scripts in examples/ (tested by tests/test_bench_*.py).

- ``fewshot``: few-shot batch evaluation through an SGLang frontend program (examples/bench_fewshot.py);
- ``serving_sweep``: bicache against the baselines through real clients (examples/bench_serving_sweep.py);
- ``procmem``: a server process's memory (RSS, peak), also used by the reliability tests.

Servers are started with ``bicache_sgl.runtime.Runtime``, the one server-process launcher.
"""
