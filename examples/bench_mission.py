"""The mission's workloads (issue 38, item 4), cache off against bicache with default server flags on the
bundled model, through the clients users run; one table: the command line of ``bicache_sgl.bench.mission``
(see its docstring and ``--help``).

    python examples/bench_mission.py                              # every workload, full size, 1 round
    python examples/bench_mission.py --repeat 3 --out mission.md
    python examples/bench_mission.py --workloads fewshot_gsm8k,frontend --num-threads 1

Needs ``pip install "sglang==0.5.2" pybase64`` and the newest sglang frontend for fewshot_gsm8k
(``pytest tests/test_sglang_frontends.py -k newest`` installs it into ~/.cache/bicache-sgl/).
"""

from bicache_sgl.bench.mission import main

if __name__ == "__main__":
    main()
