"""Data parallelism behind sglang-router: the launcher, its supervised processes, the cluster's counters
(the entry point and the whole behaviour: bicache_sgl/router.py)."""
