"""``python -m bicache_sgl.calibrate``: arguments, the JSON, the plot and the summary.

A thin front end of the one measurement driver (``bicache_sgl.calibration.driver``), as the
first-run profile (``bicache_sgl.calibration.auto``) is the other. This module sits above the
engine: it loads the model once (``bicache_sgl.engine.model_runner.load``) and, for the
``agreement`` criterion, builds a measurement stack on that same model
(``bicache_sgl.engine.engine.measurement_stack``); the measurement code in
``bicache_sgl.calibration`` sits below the engine. The names scripts import from here
(``Sample``, ``kv_cosine_profile``, ...) are re-exported.

Longer than ~450 lines because a CLI's text is long: its own flags' help (the engine settings
among them come from config.py), the summary table and the JSON record; no measurement is here.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .bicache.profile import CRITERION_EXACT, MAX_BOUND, BicacheProfile
from .calibration.data import (
    CACHED_CONTEXTS,
    DEFAULT_CACHED_CONTEXT,
    DEFAULT_FRACTIONS,
    DEFAULT_PAIR_TOLERANCE,
    DataError,
    Sample,
    Task,
    gen_candidates,
    plan_task,
    plan_tasks,
    read_data,
    tokenize,
)
from .calibration.driver import Driver, Item, Tally, items_for
from .calibration.measure import (
    DEPTH_RULES,
    depth_from_agreement,
    depth_from_similarity,
    exact_bucket,
    first_flip,
    kv_cosine_profile,
    safe_table,
    token_agreement,
)
from .config import DecodeDefaults, EngineConfig
from .flags import add_flags

log = logging.getLogger("bicache_sgl.calibrate")

__all__ = ["DataError", "Sample", "build_parser", "calibrate", "depth_from_agreement", "depth_from_similarity",
           "format_summary", "gen_candidates", "kv_cosine_profile", "main", "plan_task", "token_agreement"]

CRITERIA = (CRITERION_EXACT, "kv-cosine", "agreement")
# how the exact criterion's requests end: "stop" at EOS (the answer a user reads), "ignore_eos" (the
# whole generated region, past EOS, where the model's text is out of distribution)
GEN_MODES = ("stop", "ignore_eos")
CACHED_STATE = {
    "prefix_only": "prefix-only forward (as an explicit cache_prefix request fills the prefix cache)",
    "first_request": "the prefix inside another request's own forward (the prefix + a different question of the "
                     "data set + its MASK generation region), as the first request that computes a prefix "
                     "fills the prefix cache",
}


def _parse_fractions(s: str) -> list[float]:
    try:
        vals = sorted({float(x) for x in s.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fractions must be comma-separated percentages, got {s!r}") from None
    if not vals or any(not 0 < v < 100 for v in vals):
        raise argparse.ArgumentTypeError("--fractions: every value must be a percentage in (0, 100)")
    return vals


def _unit(name: str):
    def f(s: str) -> float:
        v = float(s)
        if not 0 <= v <= 1:
            raise argparse.ArgumentTypeError(f"{name} must be in [0, 1], got {s}")
        return v
    return f


def _percent_points(s: str) -> float:
    v = float(s)
    if not 0 <= v < 100:
        raise argparse.ArgumentTypeError(f"must be percentage points in [0, 100), got {s}")
    return v


def _tolerance(s: str) -> float:
    v = float(s)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"--tolerance must be in [0, 1), got {s}")
    return v


def _gen_modes(s: str) -> list[str]:
    modes = [m.strip() for m in s.split(",") if m.strip()]
    bad = [m for m in modes if m not in GEN_MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"--gen-modes: comma-separated {', '.join(GEN_MODES)}; got {s!r}")
    return list(dict.fromkeys(modes))


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s}")
    return v


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a default only where there is one and the help text does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        if "default" in h or action.default in (None, False, argparse.SUPPRESS):
            return h
        return super()._get_help_string(action)


# EngineConfig fields that are flags of this CLI too (threshold as --decode-threshold: --threshold
# is the K/V cosine here)
ENGINE_FLAGS = ("model_path", "device", "dtype", "num_threads", "block_length", "threshold", "cache_mode",
                "steps_per_block", "bicache_span_cut")
# where the measurement uses a setting differently from the server, the help says how
ENGINE_HELPS = {
    "model_path": "Checkpoint folder or Hugging Face id (default: the bundled model).",
    "block_length": "Decoding block; the generation region is whole blocks.",
    "threshold": "agreement: confidence-threshold decoding (0 or 'none': fixed one-token-per-step schedule).",
    "cache_mode": "agreement: in-request cache of the decoding runs (none | prefix | dual).",
    "steps_per_block": "agreement: denoising steps per block (default: one per token).",
    "num_threads": "torch CPU threads (default: torch's).",
    "bicache_span_cut": "agreement / exact: where the measured reuse ends, as the server will serve it (the profile "
                        "records it; docs/prefix_cache.md).",
}


def check_engine_flags(args: argparse.Namespace) -> None:
    """The shared settings checked by the one validator (config.py), as the server checks them:
    raises ValueError naming the field."""
    DecodeDefaults(block_length=args.block_length, threshold=args.decode_threshold, cache_mode=args.cache_mode,
                   steps_per_block=args.steps_per_block)
    EngineConfig(model_path=args.model_path, device=args.device, dtype=args.dtype, num_threads=args.num_threads,
                 bicache_span_cut=args.bicache_span_cut)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bicache_sgl.calibrate",
        description="Measure how far a cached shared prefix can be reused for a diffusion LM and write "
                    "its bicache profile (prefix fraction r -> safe depth b) as JSON plus a PNG plot.",
        epilog="Put the result beside the model as bicache_profile.json, or pass it to the server / Engine "
               "with --bicache-profile. Details: docs/calibration.md.",
        formatter_class=_HelpFormatter)
    # the engine settings this CLI shares with the server: their flags, defaults, choices and
    # parsing come from the one declaration (config.py), as the server's do
    add_flags(ap, EngineConfig, only=ENGINE_FLAGS, rename={"threshold": "decode_threshold"}, helps=ENGINE_HELPS)
    ap.add_argument("--data", required=True,
                    help='jsonl, one object per line: {"prompt": ...} / {"text": ...} or '
                         '{"prefix": ..., "suffix": ...}')
    ap.add_argument("--out", required=True, help="profile JSON to write")
    ap.add_argument("--plot", default=None,
                    help="PNG to write (default: the --out path with .png; 'none' for no plot)")
    ap.add_argument("--criterion", choices=CRITERIA, default=CRITERION_EXACT,
                    help="exact: per bucket, the deepest depth d at which every sample's greedy answer (the whole "
                         "generated region) equals cache off's at every depth 0..d (with --tolerance, the 95%% "
                         "bound on the flip rate at most that); kv-cosine: leading layers whose K/V similarity >= "
                         "--threshold; agreement: largest depth up to which every depth's greedy output agrees with "
                         "cache-off on >= --agreement of the tokens on average (allows changed answers)")
    ap.add_argument("--tolerance", type=_tolerance, default=0.0,
                    help="exact: tolerated flip rate; 0 = no sample may change (0.02: the 95%% upper bound on the "
                         "rate of changed answers at most 2%%; needs about 150+ samples per bucket to pass with "
                         "any disagreement). The profile keeps the per-depth counts, so the server's "
                         "--bicache-tolerance can re-derive the table")
    ap.add_argument("--max-bound", type=_tolerance, default=MAX_BOUND,
                    help="exact: a depth above 0 is taken only where the 95%% upper bound on the flip rate is at "
                         "most this (with no disagreement: about 3/n, so n >= 59 samples per bucket for 0.05)")
    ap.add_argument("--gen-modes", type=_gen_modes, default=",".join(GEN_MODES),
                    help="exact: how each sample's requests end, comma-separated: stop (at EOS) and/or ignore_eos "
                         "(the whole region, past EOS); each mode is a sample of its own")
    ap.add_argument("--cached-context", choices=CACHED_CONTEXTS, default=DEFAULT_CACHED_CONTEXT,
                    help="where the cached prefix state comes from: first_request = the prefix computed inside "
                         "another request's own context (the prefix + a different question of the data set + its "
                         "MASK region; what the runtime stores from the request that first computed a prefix; needs "
                         "at least two samples); prefix_only = the prefix alone (what an explicit cache_prefix "
                         "request stores)")
    ap.add_argument("--threshold", type=_unit("--threshold"), default=0.97,
                    help="K/V cosine threshold (kv-cosine criterion)")
    ap.add_argument("--depth-rule", choices=DEPTH_RULES, default="resume",
                    help="kv-cosine: 'leading' = count of leading layers above threshold (the paper); 'resume' = "
                         "also require layer b itself, whose K/V of the prefix come from the cached residual stream")
    ap.add_argument("--agreement", type=_unit("--agreement"), default=0.9,
                    help="minimum token agreement with cache-off (agreement criterion)")
    ap.add_argument("--fractions", type=_parse_fractions, default=",".join(map(str, DEFAULT_FRACTIONS)),
                    help="prefix-fraction buckets in percent, comma-separated")
    ap.add_argument("--gen-length", type=_positive_int, default=32,
                    help="generation positions (max_new_tokens); also the largest generation region a "
                         "prefix/suffix pair may use to reach a low fraction")
    ap.add_argument("--pair-tolerance", type=_percent_points, default=DEFAULT_PAIR_TOLERANCE,
                    help="prefix/suffix pairs keep their question whole, so they reach only the fractions "
                         "|prefix| / (|prefix + suffix| + G) for generation regions G of whole blocks up to "
                         "--gen-length; a pair is measured at the largest such r within this many percentage "
                         "points at or below a bucket, and skips a bucket it cannot reach so")
    ap.add_argument("--max-samples", type=_positive_int, default=None, help="use at most this many samples")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _model_name(model_arg: str | None, resolved: str) -> str:
    if model_arg and not Path(model_arg).expanduser().exists() and model_arg.count("/") == 1:
        return model_arg  # hub id
    return Path(resolved).resolve().name


def _items(args: argparse.Namespace, samples: Sequence[Sample], tasks: Sequence[Task]) -> list[Item]:
    """The tasks the cached context can be built for, as the driver's items (one group)."""
    items = items_for(samples, tasks, "data", args.cached_context)
    if not items:
        raise DataError(f"{args.data}: --cached-context first_request needs, for each measurement, another sample "
                        "with a different question (a pair's whole suffix; for a prompt, at least as many tokens "
                        "as the measured request has after the prefix); one sample, or all alike, is not enough; "
                        "add samples or use --cached-context prefix_only")
    if len(items) < len(tasks):
        log.warning("first_request: %d of %d measurements skipped (no other sample with a different question, "
                    "long enough for a prompt)", len(tasks) - len(items), len(tasks))
    return items


def _log_pair_placement(samples: Sequence[Sample], fractions: Sequence[float], tasks, tol: float) -> None:
    """Say where pairs were measured: at the r their whole question allows, at or below a bucket,
    not at the bucket itself (the JSON keeps each bucket's mean and range of r)."""
    pairs = {i for i, s in enumerate(samples) if s.kind == "pair"}
    if not pairs:
        return
    placed = [t for t in tasks if t.sample in pairs]
    off = [fractions[t.bucket] / 100 - t.r for t in placed]
    msg = (f"pairs keep their question whole and reach r only through the generation region: "
           f"{len(placed)} of {len(pairs) * len(fractions)} (pair, bucket) measurements planned")
    if placed:
        msg += f", each at or below its bucket by {100 * min(off):.1f}-{100 * max(off):.1f} points"
    msg += f" (--pair-tolerance {tol:g})"
    if len(placed) < len(pairs) * len(fractions):
        msg += "; the others are out of reach without cutting the question and are skipped"
    log.info("%s", msg)


def _driver(args: argparse.Namespace, model_path: str, items: Sequence[Item]) -> Driver:
    """Load the model ONCE; for the agreement criterion, a measurement stack on that same model."""
    from .engine.engine import build_config, measurement_stack
    from .engine.model_runner import load

    cfg = build_config(model_path=model_path, device=args.device, dtype=args.dtype, block_length=args.block_length,
                       threshold=args.decode_threshold or None, cache_mode=args.cache_mode,
                       steps_per_block=args.steps_per_block, bicache_span_cut=args.bicache_span_cut)
    loaded = load(cfg)
    stack = None
    if args.criterion in ("agreement", CRITERION_EXACT):
        # the pool only ever holds one S (flushed between measurements) plus one request's tail: the
        # measured one's or the first request's, whose (whole) question may be the longer
        cap = max(max(it.task.prompt_len, it.task.s_len + len(it.context or ())) for it in items) + 1
        stack = measurement_stack(cfg, loaded, max_running=loaded.model_config.n_layers + 1,
                                  max_prefix_cache_tokens=cap)
    return Driver(loaded.model, loaded.model_config.mask_token_id, loaded.device, stack,
                  gen_length=args.gen_length, log=log)


def calibrate(args: argparse.Namespace) -> dict:
    """Run the measurement; returns the profile dict (``BicacheProfile.to_dict`` shape + extras)."""
    import torch

    from .models.loader import load_model_config, load_tokenizer, resolve_model_path

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    records = read_data(args.data)
    model_path = resolve_model_path(args.model_path)
    tokenizer = load_tokenizer(model_path)
    samples = tokenize(records, tokenizer.encode, args.max_samples)
    if not samples:
        raise DataError(f"{args.data}: no usable samples")

    mcfg = load_model_config(model_path)
    L = mcfg.n_layers
    fractions = list(args.fractions)
    gens = gen_candidates(args.gen_length, args.block_length)
    tasks = plan_tasks(samples, fractions, gens, mcfg.max_position_embeddings, args.pair_tolerance)
    if not tasks:
        raise DataError(f"{args.data}: no sample reaches any prefix fraction in {fractions} with "
                        f"--gen-length {args.gen_length} (prompts too short; or pairs, whose question is kept "
                        f"whole: they reach r = |prefix| / (|prefix + suffix| + G) only for generation regions "
                        f"G = {gens[-1]}..{gens[0]} and r within --pair-tolerance {args.pair_tolerance:g} points "
                        "at or below a bucket; raise --gen-length for lower fractions, lower --block-length for "
                        "a finer grid)")
    _log_pair_placement(samples, fractions, tasks, args.pair_tolerance)
    items = _items(args, samples, tasks)
    driver = _driver(args, model_path, items)
    agreement = args.criterion == "agreement"
    exact = args.criterion == CRITERION_EXACT
    sampling = {"block_length": args.block_length, "cache_mode": args.cache_mode,
                "threshold": args.decode_threshold}
    if args.steps_per_block:
        sampling["steps_per_block"] = args.steps_per_block

    nb = len(fractions)
    tk, tv, th, ta = Tally(), Tally(), Tally(), Tally()
    per_r: list[list[float]] = [[] for _ in range(nb)]
    flips: list[list[tuple[int, int]]] = [[] for _ in range(nb)]
    flips_by_mode: dict[str, list[list[tuple[int, int]]]] = {m: [[] for _ in range(nb)] for m in args.gen_modes}
    t0 = time.time()

    def measure(it: Item) -> None:
        # the runs first: an item whose shared prefix the runtime would not reuse (span cut at 0)
        # raises NothingReused there and records nothing (Driver.run skips it)
        agr = driver.agreement(it, sampling)[0] if agreement else None
        outs_by_mode = {mode: driver.agreement(it, {**sampling, "ignore_eos": mode == "ignore_eos"})[1]
                        for mode in (args.gen_modes if exact else ())}
        sk, sv, sh = driver.similarity(it)
        tk.add(it, sk)
        tv.add(it, sv)
        th.add(it, sh)
        per_r[it.task.bucket].append(it.task.r)
        if agr is not None:
            ta.add(it, agr)
        for mode, outs in outs_by_mode.items():
            f = (first_flip(outs), L)
            flips[it.task.bucket].append(f)
            flips_by_mode[mode][it.task.bucket].append(f)

    driver.run(f"calibrate ({args.criterion})", items, measure, bar=not args.no_progress,
               postfix=lambda it: f"sample {it.task.sample + 1}/{len(samples)} r={fractions[it.task.bucket]:g}%")
    driver = None  # the measurement stack's pool goes with it

    sim_k = [tk.mean("data", b) for b in range(nb)]
    sim_v = [tv.mean("data", b) for b in range(nb)]
    sim_h = [th.mean("data", b) for b in range(nb)]
    sim = [None if k is None else [(a + b) / 2 for a, b in zip(k, v)] for k, v in zip(sim_k, sim_v)]
    agree = [ta.mean("data", b) for b in range(nb)] if agreement else None
    buckets = [exact_bucket(flips[b], args.tolerance, args.max_bound) for b in range(nb)] if exact else None
    raw: list[int | None] = []
    for bi in range(nb):
        if sim[bi] is None:
            raw.append(None)
        elif exact:
            raw.append(buckets[bi]["depth"])
        elif args.criterion == "kv-cosine":
            raw.append(depth_from_similarity(sim[bi], args.threshold, args.depth_rule))
        else:
            raw.append(depth_from_agreement(agree[bi], args.agreement))
    thr = args.threshold if args.criterion == "kv-cosine" else args.tolerance if exact else args.agreement
    prof = BicacheProfile(table=tuple(safe_table(fractions, raw)), n_layers=L,
                          model=_model_name(args.model_path, model_path), criterion=args.criterion, threshold=thr)
    counts = [len(tk.get("data", b)) for b in range(nb)]
    r_range = [[round(min(x), 6), round(max(x), 6)] if x else None for x in per_r]
    missing = [f"{fractions[i]:g}" for i in range(nb) if counts[i] == 0]
    if missing:
        log.warning("no sample reached prefix fraction(s) %s%%; the table has no entry there (lookup falls back "
                    "to the next lower fraction)", ", ".join(missing))

    def rnd(row):
        return None if row is None else [round(float(x), 6) for x in row]

    def mode_bucket(flips_b: list, b: int) -> dict | None:
        bk = exact_bucket(flips_b, args.tolerance, args.max_bound)
        return None if bk is None else {"r": fractions[b], **bk}

    buckets_by_mode = ({m: [mode_bucket(v[b], b) for b in range(nb)] for m, v in flips_by_mode.items()}
                       if exact else None)
    if exact:
        # a table per generation mode (the runtime serves each request by its mode's) and, for
        # readers that know one table, ``table`` = no deeper than any mode's (BicacheProfile.rederived)
        prof = BicacheProfile(table=prof.table, n_layers=L, model=prof.model, criterion=prof.criterion, threshold=thr,
                              extra={"buckets_by_mode": buckets_by_mode, "fractions": fractions,
                                     "tolerance": args.tolerance, "max_bound": args.max_bound}).rederived()
        prof = BicacheProfile(table=prof.table, n_layers=L, model=prof.model, criterion=prof.criterion, threshold=thr,
                              by_mode=prof.by_mode)

    return {
        **prof.to_dict(),
        "kv_threshold": args.threshold,
        "min_agreement": args.agreement if agreement else None,
        "tolerance": args.tolerance if exact else None,
        "confidence": 0.95 if exact else None,
        "max_bound": args.max_bound if exact else None,
        # exact: per bucket (aligned with "fractions"): n samples (items x --gen-modes), the depth, the
        # samples that differ from cache off at some depth <= it, the 95% upper bound on the flip rate,
        # and the same count at every depth 0..measured_depth (what --bicache-tolerance re-derives from)
        "buckets": ([None if bk is None else {"r": fractions[i], **bk} for i, bk in enumerate(buckets)]
                    if exact else None),
        "buckets_by_mode": buckets_by_mode,
        "gen_modes": list(args.gen_modes) if exact else None,
        "depth_rule": args.depth_rule if args.criterion == "kv-cosine" else None,
        "fractions": fractions,
        "samples_per_fraction": counts,
        "mean_prefix_fraction": [round(sum(x) / len(x), 6) if x else None for x in per_r],
        "prefix_fraction_range": r_range,
        "pair_tolerance": args.pair_tolerance,
        "depth_raw": raw,
        "similarity": [rnd(r) for r in sim],
        "similarity_k": [rnd(r) for r in sim_k],
        "similarity_v": [rnd(r) for r in sim_v],
        "similarity_h": [rnd(r) for r in sim_h],
        "agreement": None if agree is None else [rnd(r) for r in agree],
        "cached_context": args.cached_context,
        "span_cut": args.bicache_span_cut,
        "cached_state": CACHED_STATE[args.cached_context],
        "data": str(args.data),
        "num_samples": len(samples),
        "gen_length": args.gen_length,
        "block_length": args.block_length,
        "decode": ({"cache_mode": args.cache_mode, "threshold": args.decode_threshold,
                    "steps_per_block": args.steps_per_block, "temperature": 0.0}
                   if agreement or exact else None),
        "seconds": round(time.time() - t0, 2),
    }


def format_summary(result: dict) -> str:
    L = result["n_layers"]
    table = {float(r): b for r, b in result["table"]}
    agr = result.get("agreement")
    bks = result.get("buckets")
    head = "| r (%) | samples | mean r | b(r) | raw | similarity at layer b-1 | at layer b |"
    sep = "|---|---|---|---|---|---|---|"
    if bks is not None:
        head += " n (x modes) | differ at raw | 95% flip bound | differ at L |"
        sep += "---|---|---|---|"
    if agr is not None:
        head += " agreement at b | at L (naive) |"
        sep += "---|---|"
    lines = [head, sep]
    for i, r in enumerate(result["fractions"]):
        n = result["samples_per_fraction"][i]
        if n == 0:
            lines.append(f"| {r:g} | 0 | - | - | - | - | - |" + (" - | - |" if agr is not None else "")
                         + (" - | - | - | - |" if bks is not None else ""))
            continue
        b = table.get(float(r), 0)
        sim = result["similarity"][i]
        before = f"{sim[b - 1]:.4f}" if b >= 1 else "-"
        at = f"{sim[b]:.4f}" if b < L else "-"
        row = f"| {r:g} | {n} | {result['mean_prefix_fraction'][i]:.3f} | {b} | {result['depth_raw'][i]} | " \
              f"{before} | {at} |"
        if bks is not None and bks[i] is not None:
            bk = bks[i]
            row += f" {bk['n']} | {bk['disagreements']} | {bk['flip_bound95']:.3f} | " \
                   f"{bk['disagreements_by_depth'][-1]} |"
        if agr is not None:
            row += f" {agr[i][b]:.3f} | {agr[i][L]:.3f} |"
        lines.append(row)
    return "\n".join(lines)


def _plot_path(args: argparse.Namespace) -> str | None:
    """The PNG to write, or None; raises SystemExit if --plot was asked for without matplotlib."""
    plot_path: str | None = args.plot
    if plot_path is not None and plot_path.lower() == "none":
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if plot_path is not None:
            raise SystemExit("error: --plot needs matplotlib (pip install 'bicache-sgl[plot]')") from None
        log.warning("matplotlib is not installed (pip install 'bicache-sgl[plot]'); no plot written")
        return None
    return plot_path if plot_path is not None else str(Path(args.out).with_suffix(".png"))


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        check_engine_flags(args)
    except ValueError as e:
        ap.error(str(e))
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    plot_path = _plot_path(args)
    try:
        result = calibrate(args)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    BicacheProfile.load(args.out)  # what the runtime will read must load
    if plot_path:
        from .calibration.plot import plot_profile
        plot_profile(plot_path, result)
    print(f"\nbicache profile for {result['model']} ({result['n_layers']} layers), criterion {result['criterion']}"
          f" ({'tolerance' if result['criterion'] == CRITERION_EXACT else 'threshold'} {result['threshold']:g}), "
          f"cached context {result['cached_context']}, "
          f"{result['num_samples']} samples, {result['seconds']:.1f} s\n")
    print(format_summary(result))
    print(f"\ntable (r % -> b): {result['table']}")
    for mode, t in (result.get("table_by_mode") or {}).items():
        print(f"table for {mode} requests (r % -> b): {t}")
    print(f"wrote {args.out}" + (f" and {plot_path}" if plot_path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
