"""bicache_sgl.bench.fewshot (examples/bench_fewshot.py): the helpers as units, and main() end to end
against real servers.

- a tiny random LLaDA on a small GSM8K-format file, with ``--launch`` (the script starts and stops
  its own server): the output lines and the result-file line have the right shape;
- the bundled model on the bundled task, against a server the test starts, with a plain
  ``--host 127.0.0.1``: the accuracy is a fraction and the cache statistics show hits.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from bicache_sgl.bench import fewshot as bench

# ------------------------------------------------------------------------------------- units

def test_base_url_accepts_sglang_and_plain_hosts():
    assert bench.base_url("http://127.0.0.1", 30000) == "http://127.0.0.1:30000"  # SGLang's default
    assert bench.base_url("127.0.0.1", 30000) == "http://127.0.0.1:30000"
    assert bench.base_url("localhost", 8080) == "http://localhost:8080"
    assert bench.base_url("https://example.org/", 443) == "https://example.org:443"
    assert bench.base_url("::1", 30000) == "http://[::1]:30000"
    assert bench.base_url("[::1]", 30000) == "http://[::1]:30000"
    assert bench.base_url("http://[::1]", 30000) == "http://[::1]:30000"


def test_defaults_follow_sglang():
    a = bench.parse_args([])
    assert (a.host, a.port, a.backend, a.num_shots, a.num_questions, a.result_file) == \
        ("http://127.0.0.1", 30000, "srt", 5, 200, "result.jsonl")
    assert a.temperature == 0.0 and a.control == "none" and not a.launch
    assert a.max_new_tokens == 32  # bundled task: one block
    assert bench.parse_args(["--data-path", "x.jsonl"]).max_new_tokens == 512


def test_gsm8k_answer_extraction():
    gold = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nIn total 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert bench.gsm8k_label(gold) == 72
    assert bench.gsm8k_label("It costs 1,000 + 234 = 1,234 dollars\n#### 1,234") == 1234
    assert bench.gsm8k_label("no marker, last number wins: 3 then 5") == 5
    assert bench.get_answer_value(" She has 3 apples, then 12 more, so 15.\n\nQuestion") == 15
    assert bench.get_answer_value(" The answer is 1,234,567.") == 1234567
    assert bench.get_answer_value(" I don't know.") == bench.INVALID
    assert bench.get_answer_value("") == bench.INVALID


def test_gsm8k_prompt_layout(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [{"question": f"What is {i}+1?", "answer": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(4)]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    items = bench.load_gsm8k(str(p), 2, 3, "none")
    assert len(items) == 3 and [it["label"] for it in items] == [1, 2, 3]
    block = "Question: What is 0+1?\nAnswer: 0+1=1\n#### 1\n\nQuestion: What is 1+1?\nAnswer: 1+1=2\n#### 2\n\n"
    assert all(it["prefix"] == block for it in items)
    assert items[2]["question"] == "Question: What is 2+1?\nAnswer:"
    assert all(it["prefix"] == "" for it in bench.load_gsm8k(str(p), 2, 3, "remove"))
    with pytest.raises(SystemExit):
        bench.load_gsm8k(str(p), 2, 3, "shuffle")


def test_bundled_items_and_controls():
    from bicache_sgl.training import task

    items = bench.load_bundled(5, 20, "none")
    ref = task.heldout_items(20, 5)
    assert [it["prefix"] + it["question"] for it in items] == [r["prompt"] for r in ref]
    assert [it["label"] for it in items] == [r["answer"] for r in ref]
    assert len({it["prefix"] for it in items}) == len({it["family"] for it in items}) == 4
    shuffled = bench.load_bundled(5, 20, "shuffle")
    assert [it["label"] for it in shuffled] == [it["label"] for it in items]
    assert all(a["prefix"] != b["prefix"] for a, b in zip(items, shuffled))
    assert all(it["prefix"] == "" for it in bench.load_bundled(5, 20, "remove"))
    for kind in bench.bundled_kinds():  # --task-kind passes through to the task module
        got = bench.load_bundled(5, 10, "none", kind=kind)
        assert [it["prefix"] + it["question"] for it in got] == \
            [r["prompt"] for r in task.heldout_items(10, 5, kind=kind)]
    assert bench.score_bundled(" 7\n\nQuestion") == ("7", False)
    assert bench.score_bundled(" x") == ("x", True)
    assert bench.score_bundled("") == ("", True)


def test_parse_server_args_inverts_server_flags():
    from bicache_sgl.runtime import parse_server_args, server_flags

    assert parse_server_args('--num-threads 1 --threshold=none --disable-radix-cache --x a b') == \
        {"num_threads": "1", "threshold": "none", "disable_radix_cache": True, "x": ["a", "b"]}
    assert parse_server_args(None) == {}
    with pytest.raises(ValueError):
        parse_server_args("stray")
    flags = ["--block-length", "8", "--disable-radix-cache", "--prefix-cache", "fixed:2", "--x", "a", "b"]
    assert server_flags(parse_server_args(" ".join(flags))) == flags


@pytest.mark.parametrize("script,flag", [("bench_fewshot.py", "--launch"), ("bench_serving_sweep.py", "--interleave")])
def test_example_scripts_are_the_package_cli(script, flag):
    """The scripts in examples/ run the package's main(): their --help is the package's."""
    import subprocess
    import sys

    path = Path(__file__).resolve().parents[1] / "examples" / script
    p = subprocess.run([sys.executable, str(path), "--help"], check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert flag in p.stdout
    assert len(path.read_text().splitlines()) < 30  # a thin CLI: the logic lives in bicache_sgl.bench


# ------------------------------------------------------------------------------------- end to end

LINES = [r"^Accuracy: \d\.\d{3}$", r"^Invalid: \d\.\d{3}$", r"^Latency: \d+\.\d{3} s$",
         r"^Output throughput: \d+\.\d{3} token/s$", r"^Prefix cache: ", r"^Cached tokens: ",
         r"^Cache hit rate: ", r"^Saved compute fraction: "]


def _check_lines(out: str) -> None:
    lines = out.splitlines()
    for pat in LINES:
        assert any(re.match(pat, ln) for ln in lines), f"no line matching {pat!r} in:\n{out}"


def _check_result_line(path: Path, *, task: str, n: int) -> dict:
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert len(rows) == 1
    r = rows[0]
    assert set(r) == {"task", "backend", "num_gpus", "latency", "accuracy", "num_requests", "other"}
    assert (r["task"], r["backend"], r["num_gpus"], r["num_requests"]) == (task, "srt", 1, n)
    assert isinstance(r["accuracy"], float) and 0.0 <= r["accuracy"] <= 1.0
    assert r["latency"] > 0
    for k in ("num_questions", "parallel", "num_shots", "prefix_cache", "cached_tokens", "cache_hit_rate",
              "saved_compute_fraction", "output_throughput"):
        assert k in r["other"], k
    assert r["other"]["num_questions"] == n
    return r


def test_main_tiny_gsm8k_launch(tmp_path, tiny_llada, capsys):
    pytest.importorskip("sglang")
    data = tmp_path / "gsm.jsonl"
    rows = [{"question": f"Tom has {i} apples and buys {i + 2} more. How many apples does he have?",
             "answer": f"He has {i} + {i + 2} = <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2} apples.\n#### {2 * i + 2}"}
            for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result_file = tmp_path / "result.jsonl"
    res = bench.main(["--launch", "--model-path", tiny_llada, "--prefix-cache", "naive",
                      "--server-args", "--num-threads 1 --block-length 8 --steps-per-block 4 --threshold none",
                      "--data-path", str(data), "--num-shots", "2", "--num-questions", "4", "--parallel", "2",
                      "--max-new-tokens", "8", "--result-file", str(result_file),
                      "--raw-result-file", str(tmp_path / "raw.jsonl")])
    _check_lines(capsys.readouterr().out)
    r = _check_result_line(result_file, task="gsm8k", n=4)
    assert r == res
    assert r["other"]["prefix_cache"] == "naive" and r["other"]["num_shots"] == 2
    assert r["other"]["cached_tokens"] > 0  # the constant few-shot block was cached first
    raw = [json.loads(ln) for ln in (tmp_path / "raw.jsonl").read_text().splitlines()]
    assert [x["label"] for x in raw] == [2, 4, 6, 8]


def test_main_bundled_model(tmp_path, capsys):
    pytest.importorskip("sglang")
    from bicache_sgl import Runtime
    from bicache_sgl.models.loader import default_model_path

    if not os.path.exists(os.path.join(default_model_path(), "model.safetensors")):
        pytest.skip("the bundled model is not in bicache_sgl/assets/default_model")
    result_file = tmp_path / "result.jsonl"
    with Runtime(num_threads=1) as rt:
        res = bench.main(["--host", "127.0.0.1", "--port", str(rt.port), "--num-questions", "20",
                          "--parallel", "8", "--result-file", str(result_file)])
    _check_lines(capsys.readouterr().out)
    r = _check_result_line(result_file, task="bundled_fewshot", n=20)
    assert r == res
    assert r["other"]["num_prefixes"] == 4  # 20 questions, 5 per held-out family
    assert r["other"]["cached_tokens"] > 0 and r["other"]["cache_hit_rate"] > 0
    assert r["other"]["request_cache_hit_rate"] > 0.5  # every question finds its family's block


def test_no_server_is_a_clear_error(tmp_path):
    pytest.importorskip("sglang")
    from bicache_sgl.runtime import find_free_port

    with pytest.raises(SystemExit, match="cannot reach a server"):
        bench.main(["--host", "127.0.0.1", "--port", str(find_free_port()), "--num-questions", "2",
                    "--result-file", str(tmp_path / "r.jsonl")])
    assert not (tmp_path / "r.jsonl").exists()
