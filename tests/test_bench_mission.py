"""bicache_sgl.bench.mission (examples/bench_mission.py): the pieces that can be checked in seconds.
The workloads themselves are not run here (minutes each); docs/performance.md has the command.

- the GSM8K-format file: SGLang's own few_shot_gsm8k prompt builder (the pinned frontend's
  ``sglang.test.few_shot_gsm8k``, the same functions as the newest's) turns it into exactly the bundled
  task's prompts, its label reader reads the family's code, and the bundled model answers it;
- the table: ratio and ideal from the runs' speeds and counters, answers equal summed over rounds;
- the state dump of few_shot_gsm8k parses back; the differential workload's ground truth;
- ``--help`` works and names every workload.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bicache_sgl.bench import mission
from bicache_sgl.training import task

ROOT = Path(__file__).resolve().parent.parent


def test_gsm8k_file_builds_the_bundled_task_prompts_through_sglangs_few_shot_gsm8k(tmp_path):
    fs = pytest.importorskip("sglang.test.few_shot_gsm8k")
    path = tmp_path / "gsm8k.jsonl"
    rows = mission.write_gsm8k_file(path, 200, 5, seed=0)
    lines = list(fs.read_jsonl(str(path)))
    assert lines == rows and len(lines) == 200
    fam = task.heldout_families(1, 5, 0)[0]
    block = fs.get_few_shot_examples(lines, 5)
    # the few-shot block is the held-out family's, with the task's separator after it
    assert block == task.build_prefix(fam.pairs) + task.EXAMPLE_SEP
    keys = {k for k, _ in fam.pairs}
    code = {v for _, v in fam.pairs}
    assert len(code) == 1  # kind "code": every example answers with the family's digit
    for i in range(200):
        prompt = block + fs.get_one_example(lines, i, False)
        assert prompt == task.build_prompt(task.build_prefix(fam.pairs), lines[i]["question"])
        assert lines[i]["question"] in keys
        assert fs.get_answer_value(lines[i]["answer"]) == int(next(iter(code)))
    assert {r["question"] for r in rows} == keys  # every shown key is asked


def test_bundled_model_answers_the_gsm8k_file_prompts():
    fs = pytest.importorskip("sglang.test.few_shot_gsm8k")
    from bicache_sgl import Engine

    rows = mission.gsm8k_rows(8, 5, seed=0)
    block = fs.get_few_shot_examples(rows, 5)
    picks = [5, 6, 7]  # questions after the shots
    eng = Engine(prefix_cache="off", num_threads=1)
    try:
        outs = eng.generate([block + fs.get_one_example(rows, i, False) for i in picks],
                            {"max_new_tokens": 8, "temperature": 0})
    finally:
        eng.shutdown()
    preds = [fs.get_answer_value(o["text"]) for o in outs]
    assert preds == [fs.get_answer_value(rows[i]["answer"]) for i in picks], [o["text"] for o in outs]


def _run(speed, computed, skipped, answers, unit="tok/s", accuracy=None):
    return {"speed": speed if unit != "s" else 1.0 / speed, "shown": speed, "unit": unit, "answers": answers,
            "accuracy": accuracy, "computed_layer_tokens": computed, "skipped_layer_tokens": skipped}


def test_build_row_takes_ratio_and_ideal_from_the_same_rounds_counters():
    off = [_run(100.0, 1000, 0, ["a", "b", "c"], accuracy=1.0), _run(50.0, 1000, 0, ["a", "b", "c"], accuracy=1.0),
           _run(80.0, 1000, 0, ["a", "b", "c"], accuracy=1.0)]
    bic = [_run(150.0, 400, 600, ["a", "b", "c"], accuracy=1.0), _run(100.0, 500, 500, ["a", "x", "c"], accuracy=0.5),
           _run(80.0, 250, 750, ["a", "b", "c"], accuracy=1.0)]
    row = mission.build_row("w", off, bic)
    # per-round speed ratios 1.5, 2.0, 1.0 -> median 1.5 (not median(bic) / median(off) = 100 / 80)
    assert row["measured"] == pytest.approx(1.5)
    # per-round ideals 1000/400, 1000/500, 1000/250 -> median 2.5
    assert row["ideal"] == pytest.approx(2.5)
    assert (row["off"], row["bicache"]) == (80.0, 100.0)
    assert (row["equal"], row["total"]) == (8, 9)
    assert (row["acc_off"], row["acc_bicache"]) == (1.0, 1.0)
    assert row["skipped_fraction"] == pytest.approx(0.6)
    table = mission.format_table([row])
    assert "| w | 80.0 tok/s | 100.0 tok/s | 1.50x | 2.50x | 8/9 | 1.000 / 1.000 |" in table


def test_build_row_times_are_inverted_and_failed_rounds_left_out():
    # seconds: bicache 2 s vs off 3 s is 1.5x as fast
    off = [_run(3.0, 900, 0, [[1, 2]], unit="s"), {"error": "boom"}]
    bic = [_run(2.0, 300, 600, [[1, 2]], unit="s"), _run(1.0, 300, 600, [[9, 9]], unit="s")]
    row = mission.build_row("d", off, bic)
    assert row["measured"] == pytest.approx(1.5)
    assert row["ideal"] == pytest.approx(3.0)
    assert (row["equal"], row["total"]) == (1, 1)  # round 2 has no off run to compare with
    assert row["errors"] == ["boom"]
    assert "| 3.00 s | 1.50 s | 1.50x | 3.00x | 1/1 | n/a |" in mission.format_table([row])


def test_parse_state_dump_reads_back_sglangs_dump_state_text(tmp_path):
    utils = pytest.importorskip("sglang.utils")
    texts = ["Question: B\nAnswer: 2", "multi\n\nline ===\n", ""]
    utils.dump_state_text(str(tmp_path / "d.txt"), texts)
    assert mission.parse_state_dump((tmp_path / "d.txt").read_text()) == texts


def test_differential_truth_is_the_asked_keys_value_in_the_last_block():
    from bicache_sgl.training.calib_shapes import compositions

    p = task.build_prompt(task.build_prefix([("B", "1"), ("C", "1")]) + task.EXAMPLE_SEP
                          + task.build_prefix([("C", "7"), ("D", "7")]), "C")
    assert mission.differential_truth(p) == "7"
    for prompt, _ in compositions(0):
        assert mission.differential_truth(prompt) in set(task.VALUE_CHARS)


def test_help_explains_every_workload_and_unknown_workloads_are_refused():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "bench_mission.py"), "--help"], capture_output=True,
                       text=True, env=env, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    for name in mission.WORKLOADS:
        assert name in p.stdout
    assert "--prefix-cache off" in p.stdout and "--repeat" in p.stdout and "--num-threads" in p.stdout
    with pytest.raises(SystemExit):
        mission.parse_args(["--workloads", "fewshot_gsm8k,nope"])
    a = mission.parse_args(["--workloads", "differential,fewshot_gsm8k"])
    assert a.workload_list == ["fewshot_gsm8k", "differential"]  # the table's order
