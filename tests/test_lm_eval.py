"""lm-evaluation-harness against the server: ``lm_eval --model local-completions`` on the bundled
model's few-shot task (examples/lm_eval/), both request types, the default server (bicache on).

Small and bounded: the task exported with 2-shot families (the bundled model answers those
too; short prompts keep the loglikelihood requests cheap), ``--limit 3`` (3 generations, 30
loglikelihood requests), no network (offline switches, a private HF_HOME). The recipe with its
measured accuracies is in docs/evaluation.md. Skipped only when lm-eval is not installed (it comes
with the dev extra, through the ``eval`` extra).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
requests = pytest.importorskip("requests")

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "examples" / "lm_eval"
LIMIT = 3
NUM_CHOICES = 10
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_EVALUATE_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The default server: bundled model, default flags (bicache prefix cache), loopback."""
    from bicache_sgl.runtime import Runtime

    folder = tmp_path_factory.mktemp("lm_eval_server")
    rt = Runtime(num_threads=1, max_running_requests=8, timeout=180, log_path=str(folder / "server.log"))
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A directory holding examples/lm_eval/data/bicache_fewshot.jsonl, written by the export
    script (the task YAMLs read that path relative to the directory lm-eval runs in)."""
    wd = tmp_path_factory.mktemp("lm_eval_work")
    out = wd / "examples" / "lm_eval" / "data" / "bicache_fewshot.jsonl"
    p = subprocess.run([sys.executable, str(TASK_DIR / "export_task.py"), "--num-questions", "12", "--num-shots", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(rows) == 12 and all(r["prompt"].endswith("\nAnswer:") and r["answer"] == str(r["label"]) for r in rows)
    return wd


def counters(server) -> dict:
    return requests.get(server.url + "/server_info", timeout=30).json()["internal_states"][0]


def test_lm_eval_local_completions_both_request_types(server, workdir):
    model = str(ROOT / "bicache_sgl" / "assets" / "default_model")
    before = counters(server)
    out_dir = workdir / "results"
    model_args = (f"base_url={server.url}/v1/completions,model=default,tokenizer_backend=huggingface,"
                  f"tokenizer={model},num_concurrent=2,max_retries=1")
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
           "--include_path", str(TASK_DIR), "--tasks", "bicache_fewshot_gen,bicache_fewshot_mc",
           "--limit", str(LIMIT), "--output_path", str(out_dir), "--log_samples"]
    env = dict(os.environ, HF_HOME=str(workdir / "hf"), **OFFLINE)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=str(workdir), env=env, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())["results"]
    # generate_until: the bundled model's answers match exactly; loglikelihood: the true digit has
    # the highest likelihood of the ten (chance is 0.1; before echo logprobs were left to right,
    # the whole prompt was masked and this was at chance)
    assert results["bicache_fewshot_gen"]["exact_match,none"] == 1.0, results
    assert results["bicache_fewshot_mc"]["acc,none"] == 1.0, results

    def samples(task):
        path = next(out_dir.rglob(f"samples_{task}_*.jsonl"))
        return [json.loads(ln) for ln in path.read_text().splitlines()]

    gen, mc = samples("bicache_fewshot_gen"), samples("bicache_fewshot_mc")
    assert len(gen) == LIMIT and len(mc) == LIMIT
    assert all(s["filtered_resps"][0].strip() == s["target"] for s in gen)
    for s in mc:  # ten loglikelihood requests per document: (logprob, is_greedy) each, logged as text
        assert len(s["resps"]) == NUM_CHOICES
        lls = [float(r[0][0]) for r in s["resps"]]
        assert all(ll <= 0 for ll in lls)
        assert lls.index(max(lls)) == s["doc"]["label"]
        greedy = [str(r[0][1]) == "True" for r in s["resps"]]
        assert greedy[s["doc"]["label"]] and sum(greedy) == 1  # the true answer is the greedy continuation

    # both request types went through the server with its prefix cache on (bicache by default)
    after = counters(server)
    assert after["prefix_cache"] == "bicache"
    assert after["num_requests_total"] - before["num_requests_total"] >= LIMIT * (1 + NUM_CHOICES)
    assert after["cached_tokens_total"] > before["cached_tokens_total"]


def test_echo_logprobs_are_left_to_right(server):
    """What lm-eval's loglikelihood reads: with echo + logprobs, prompt entry i is
    log p(token_i | tokens before it) (positions i.. masked), which is the native input logprob
    at logprob_start_len = i; a generation that stops on EOS at once still returns one entry."""
    from transformers import AutoTokenizer

    from bicache_sgl.training import task

    tok = AutoTokenizer.from_pretrained(str(ROOT / "bicache_sgl" / "assets" / "default_model"))
    it = task.heldout_items(1, 2, seed=3)[0]
    ids = tok.encode(it["prompt"] + " " + it["answer"])
    r = requests.post(server.url + "/v1/completions", json={"model": "default", "prompt": ids, "max_tokens": 1,
                                                            "temperature": 0, "logprobs": 1, "echo": True},
                      timeout=120).json()
    c = r["choices"][0]
    lp = c["logprobs"]
    assert lp["token_logprobs"][0] is None
    # the prompt's entries, then exactly one generated entry (here the EOS the answer ends with)
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert r["usage"]["completion_tokens"] == 1 and c["finish_reason"] == "stop"
    assert lp["tokens"][-1] == tok.eos_token and c["text"] == tok.decode(ids)
    for i in (len(ids) - 2, len(ids) - 1, 5):
        g = requests.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                                          "return_logprob": True, "logprob_start_len": i},
                          timeout=120).json()
        native = g["meta_info"]["input_token_logprobs"][0][0]
        assert lp["token_logprobs"][i] == pytest.approx(native, abs=1e-5)
    # the answer digit is certain given the few-shot block
    assert lp["token_logprobs"][len(ids) - 1] > -0.05
