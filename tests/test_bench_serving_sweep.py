"""bicache_sgl.bench.serving_sweep (examples/bench_serving_sweep.py): the helpers as units, and a tiny
end-to-end sweep.

The end-to-end case starts two real servers (dual, bicache+dual) on a tiny random LLaDA and drives
each with SGLang's own ``bench_serving`` (generated-shared-prefix), then checks the table, the plot
and the JSON. Counts are tiny: it is a smoke test of the plumbing, not a measurement.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bicache_sgl.bench import serving_sweep as sweep

# ------------------------------------------------------------------------------------- units

def test_gsp_lengths_hit_the_fraction():
    for r in (0.3, 0.5, 0.75, 0.9):
        p = sweep.gsp_lengths(r, 512, 32, 32)
        assert p["seq_len"] == 512
        assert p["system_prompt_len"] + 2 + p["question_len"] + 32 == 512
        assert abs(p["r"] - r) < 1 / 512
    # the generation region is whole blocks
    p = sweep.gsp_lengths(0.5, 256, 20, 16)
    assert p["system_prompt_len"] + 2 + p["question_len"] + 32 == 256
    with pytest.raises(ValueError):
        sweep.gsp_lengths(0.95, 64, 32, 32)


def test_parse_args_quick_and_lists():
    a = sweep.parse_args([])
    assert a.config_list == ["vanilla", "dual", "naive+dual", "bicache+dual"]
    assert a.conc_list == [1, 16] and a.ratio_list == [0.3, 0.5, 0.75, 0.9]
    q = sweep.parse_args(["--quick", "--seq-len", "600"])
    assert q.seq_len == 600  # an explicit flag wins over --quick
    assert q.ratio_list == [0.3, 0.9] and q.gsp_groups == sweep.QUICK["gsp_groups"]
    with pytest.raises(SystemExit):
        sweep.parse_args(["--configs", "dual,warp"])
    with pytest.raises(SystemExit):
        sweep.parse_args(["--ratios", "1.5"])


def _row(cfg, wl="gsp r=0.9", r=0.9, conc=1, tput=100.0, work=1000, acc=None, kind="gsp"):
    return {"config": cfg, "workload": wl, "kind": kind, "r": r, "concurrency": conc, "output_throughput": tput,
            "request_throughput": tput / 32, "mean_latency": 1.0, "p99_latency": 2.0, "computed_layer_tokens": work,
            "skipped_layer_tokens": 0, "cached_tokens_total": 0, "cache_hit": 0.0, "skipped_fraction": 0.0,
            "accuracy": acc, "prefix_cache_bytes": 0, "peak_rss": 2**20}


def test_speedups_targets_table_plot(tmp_path):
    res = [_row("vanilla", tput=10.0, work=20000), _row("dual", tput=100.0, work=1000),
           _row("bicache+dual", tput=210.0, work=400),
           _row("dual", wl="fewshot", r=0.8, tput=50.0, work=800, acc=0.50, kind="fewshot"),
           _row("bicache+dual", wl="fewshot", r=0.8, tput=60.0, work=400, acc=0.48, kind="fewshot"),
           _row("dual", wl="gsp r=0.3", r=0.3, tput=100.0, work=1000),
           {"config": "bicache+dual", "workload": "gsp r=0.3", "kind": "gsp", "r": 0.3, "concurrency": 1,
            "error": "bench_serving exited with 1"}]
    sweep.add_speedups(res)
    b = res[2]
    assert b["x_dual_measured"] == pytest.approx(2.1) and b["x_dual_ideal"] == pytest.approx(2.5)
    assert b["measured_over_ideal"] == pytest.approx(0.84)
    assert b["x_vanilla_measured"] == pytest.approx(21.0) and b["x_vanilla_ideal"] == pytest.approx(50.0)
    assert res[1]["x_dual_measured"] == 1.0
    t = {e["workload"]: e for e in sweep.check_targets(res)}
    assert set(t) == {"gsp r=0.9", "fewshot"}  # r >= 0.75 only, errors skipped
    assert t["gsp r=0.9"]["x_dual_met"] and t["gsp r=0.9"]["x_vanilla_met"]
    assert t["gsp r=0.9"]["ideal_met"] is False  # 0.84 is more than 15% below ideal
    assert t["fewshot"]["acc_diff_points"] == pytest.approx(-2.0)
    assert t["fewshot"]["x_dual_met"] is False and t["fewshot"]["x_vanilla_met"] is None
    table = sweep.format_table(res)
    lines = table.splitlines()
    assert lines[0] == sweep.TABLE_HEAD and len(lines) == 2 + len(res)
    assert all(ln.count("|") == lines[0].count("|") for ln in lines)
    assert "bench_serving exited with 1" in table
    text = sweep.format_targets(sweep.check_targets(res))
    assert "NOT met" in text and "met" in text
    png = sweep.make_plot(res, tmp_path / "p.png", "title")
    if png is not None:  # matplotlib installed
        assert Path(png).read_bytes()[:4] == b"\x89PNG"


def test_best_run_and_vanilla_subset():
    assert sweep.best_run([]) is None
    err = {"config": "dual", "error": "x"}
    assert sweep.best_run([err]) is err
    best = sweep.best_run([_row("dual", tput=90.0), err, _row("dual", tput=120.0)])
    assert best["output_throughput"] == 120.0 and best["runs"] == [90.0, 120.0]
    a = sweep.parse_args(["--ratios", "0.3,0.75,0.9"])
    wls = [sweep.Workload(f"gsp r={r}", "gsp", r) for r in a.ratio_list] + [sweep.Workload("fs", "fewshot", 0.7)]
    assert [w.name for w in sweep.runs_for("vanilla", wls, a)] == ["gsp r=0.75", "gsp r=0.9", "fs"]
    assert sweep.runs_for("dual", wls, a) == wls


# ------------------------------------------------------------------------------------- end to end

def test_tiny_sweep_end_to_end(tiny_llada, tmp_path, capsys):
    pytest.importorskip("sglang")
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"n_layers": 4, "table": [[0, 0], [50, 2]]}))
    out = tmp_path / "out"
    summary = sweep.main(["--model-path", tiny_llada, "--bicache-profile", str(profile),
                          "--configs", "dual,bicache+dual", "--ratios", "0.75", "--concurrency", "2",
                          "--seq-len", "96", "--output-len", "8", "--block-length", "8", "--gsp-groups", "2",
                          "--gsp-per-group", "2", "--fewshot-questions", "0", "--out-dir", str(out),
                          "--server-args", "--steps-per-block 2"])
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].startswith("command: python examples/bench_serving_sweep.py --model-path")
    rows = summary["results"]
    assert [(r["config"], r["concurrency"]) for r in rows] == [("dual", 2), ("bicache+dual", 2)]
    for r in rows:
        assert "error" not in r, r
        assert r["completed"] == 4 and r["output_throughput"] > 0 and r["computed_layer_tokens"] > 0
    dual, bic = rows
    assert dual["cached_tokens_total"] == 0 and dual["skipped_layer_tokens"] == 0
    # later requests of a group reuse the system prompt at depth 2: counted work goes down
    assert bic["cached_tokens_total"] > 0 and bic["skipped_layer_tokens"] > 0
    assert bic["x_dual_ideal"] > 1.0 and bic["prefix_cache_bytes"] > 0 and bic["peak_rss"] > 0
    assert dual["prefix_cache_bytes"] == 0  # prefix cache off: no pool
    assert bic["prefix_cache_used_tokens"] <= bic["prefix_cache_capacity_tokens"]
    md = (out / "table.md").read_text()
    assert md.startswith("command: `python examples/bench_serving_sweep.py") and sweep.TABLE_HEAD in md
    assert "Targets (r >= 0.75)" in md
    assert "- dual: no prefix pool" in md and "- bicache+dual: pool " in md and "within budget" in md
    assert json.loads((out / "results.json").read_text())["results"][1]["config"] == "bicache+dual"
    if summary["plot"]:
        assert (out / "sweep.png").stat().st_size > 0
    # the configuration's server was stopped
    assert "sglang.bench_serving" in rows[0]["command"] and "--flush-cache" in rows[0]["command"]


def _bench_ab():
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "examples" / "bench_serving_ab.py"
    spec = importlib.util.spec_from_file_location("bench_serving_ab", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_serving_ab_code_needs_two_source_trees(tmp_path):
    ab = _bench_ab()
    root = str(Path(__file__).resolve().parents[1])
    assert ab.parse_args(["--code", f"{root},{root}"]).code == f"{root},{root}"
    for bad in (root, f"{root},{tmp_path}", f"{root},{root},{root}"):
        with pytest.raises(SystemExit):
            ab.parse_args(["--code", bad])


def test_bench_serving_ab_two_trees_interleaved_end_to_end(tiny_llada, tmp_path, capsys):
    """--code OLD,NEW: a server per tree and mode (PYTHONPATH = the tree), each round running
    every one of them; the new / old table compares the same mode across trees."""
    pytest.importorskip("sglang")
    ab = _bench_ab()
    root = str(Path(__file__).resolve().parents[1])
    summary = ab.main(["--model-path", tiny_llada, "--code", f"{root},{root}", "--rounds", "1", "--groups", "2",
                       "--per-group", "2", "--system-len", "48", "--question-len", "8", "--output-len", "8",
                       "--concurrency", "2", "--out-dir", str(tmp_path), "--server-args", "--block-length 8"])
    printed = capsys.readouterr().out
    assert printed.count("PYTHONPATH=" + root) == 4  # old:off, old:bicache, new:off, new:bicache
    for key in ("old:off", "old:bicache", "new:off", "new:bicache"):
        assert summary[key]["median_tok_s"] > 0
    assert summary["new:bicache"]["ideal"] >= 1.0 and summary["new/old:off"] > 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert sorted((r["side"], r["config"]) for r in rows) == [("new", "bicache"), ("new", "off"), ("old", "bicache"),
                                                             ("old", "off")]
    assert all(r["tree"] == root for r in rows)
    assert "| off | " in printed and "new / old out tok/s per round" in printed
