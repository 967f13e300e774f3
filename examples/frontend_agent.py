"""A structured multi-call SGLang frontend program against bicache-sgl.

An "agent" with a long shared system prompt plans, explores three approaches in parallel
(``fork``/``join`` over the same prefix), picks one and answers. Every call reuses the prefix
the earlier calls left in the server's radix cache; the program prints, per call, how many
prompt tokens the server reported as cached and the bicache depth it used.

    # start a server for the program (bundled default model, or --model-path):
    python examples/frontend_agent.py
    # against a server you started yourself:
    python -m bicache_sgl.launch_server --port 30000 &
    python examples/frontend_agent.py --url http://127.0.0.1:30000
    # smoke test on a tiny random checkpoint (gibberish text, real numbers):
    python examples/frontend_agent.py --tiny

Needs the SGLang frontend package: ``pip install "sglang==0.5.2" pybase64``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading

import sglang as sgl

SYSTEM_PROMPT = (
    "You are a careful planning agent. You solve a task in four moves: write a one-line plan, "
    "propose three different approaches, say which approach is best, then give the final answer. "
    "Keep every line short and concrete. Tools you may mention: search(query), calculator(expr), "
    "notes(text). Never invent tool results; say what you would call instead.\n\n"
    "Example task: How many days are there in three weeks?\n"
    "Plan: multiply the days in a week by three.\n"
    "Approach 1: calculator(7*3).\nApproach 2: count on a calendar.\nApproach 3: recall that a week has 7 days.\n"
    "Best approach: 1\nFinal answer: 21\n\n"
)

_lock = threading.Lock()


@sgl.function
def agent(s, task, calls):
    def note(name, state, var):
        meta = state.get_meta_info(var)
        with _lock:
            calls.append((task, name, meta))

    s += SYSTEM_PROMPT + "Task: " + task + "\n"
    s += "Plan:" + sgl.gen("plan", max_tokens=32, stop="\n", temperature=0)
    note("plan", s, "plan")

    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"\nApproach {i + 1}:" + sgl.gen("approach", max_tokens=24, stop="\n", temperature=0.7)
    forks.join()
    for i, f in enumerate(forks):
        note(f"approach {i + 1} (fork)", f, "approach")
    for i, f in enumerate(forks):
        s += f"\nApproach {i + 1}:" + f["approach"]

    s += "\nBest approach:" + sgl.gen("best", max_tokens=8, stop="\n", temperature=0)
    note("best", s, "best")
    s += "\nFinal answer:" + sgl.gen("answer", max_tokens=32, stop="\n", temperature=0)
    note("answer", s, "answer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an already running bicache-sgl (or SGLang) server")
    ap.add_argument("--model-path", default=None, help="model for the server this script starts (default: bundled)")
    ap.add_argument("--tiny", action="store_true", help="start a server on a tiny random checkpoint")
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()

    runtime = None
    if args.url:
        backend = sgl.RuntimeEndpoint(args.url, api_key=args.api_key)
    else:
        from bicache_sgl.runtime import Runtime

        model = args.model_path
        server_args = {}
        if args.tiny:
            from bicache_sgl.testing import make_tiny_llada

            model = make_tiny_llada(tempfile.mkdtemp(prefix="tiny-llada-"))
            # a made-up r -> depth table (real ones come from calibration) so bicache reuses layers
            with open(os.path.join(model, "bicache_profile.json"), "w") as f:
                json.dump({"n_layers": 4, "table": [[0, 0], [50, 2], [80, 3]]}, f)
            server_args = {"block_length": 8, "steps_per_block": 4, "threshold": "none", "num_threads": 1}
        print("starting the server ...", flush=True)
        runtime = Runtime(model_path=model, api_key=args.api_key, **server_args)
        print(f"server at {runtime.url} (log: {runtime.log_path})")
        backend = runtime.endpoint
    sgl.set_default_backend(backend)

    try:
        tasks = ["What is 15% of 80?", "Name a prime number between 20 and 30."]
        calls: list = []
        states = agent.run_batch([{"task": t, "calls": calls} for t in tasks], num_threads=2)
        for task, st in zip(tasks, states):
            print(f"\n=== {task}\n{st.text()[len(SYSTEM_PROMPT):]}")
        print(f"\n{'task':<6}{'call':<22}{'prompt':>7}{'cached':>8}{'depth':>7}{'gen':>5}{'latency':>9}")
        for task, name, m in calls:
            print(f"{tasks.index(task) + 1:<6}{name:<22}{m['prompt_tokens']:>7}{m['cached_tokens']:>8}"
                  f"{m.get('bicache_depth', '-'):>7}{m['completion_tokens']:>5}{m['e2e_latency']:>8.2f}s")
        info = backend.get_server_info()["internal_states"][0]
        print(f"\nserver: prefix cache {info.get('prefix_cache')}, token hit rate "
              f"{info.get('cache_token_hit_rate', 0):.2f}, tokens per forward {info['avg_tokens_per_forward']:.2f}")
    finally:
        if runtime is not None:
            runtime.shutdown()


if __name__ == "__main__":
    main()
