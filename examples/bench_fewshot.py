"""Few-shot batch evaluation against a running server, in the style of SGLang's
``benchmark/gsm8k/bench_sglang.py``: the command line of ``bicache_sgl.bench.fewshot`` (see its
docstring, ``--help`` and docs/evaluation.md).

    python -m bicache_sgl.launch_server --port 30000 --num-threads 1 &
    python examples/bench_fewshot.py --num-questions 200 --parallel 16
    python examples/bench_fewshot.py --launch --prefix-cache naive --server-args "--num-threads 1"
    python examples/bench_fewshot.py --launch --prefix-cache off,naive,bicache --server-args "--num-threads 1"

Needs the SGLang frontend package: ``pip install "sglang==0.5.2" pybase64``.
"""

from bicache_sgl.bench.fewshot import main

if __name__ == "__main__":
    main()
