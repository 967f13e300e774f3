"""Build a bicache profile (prefix fraction r -> safe depth b) for a model from a prompt set.

    python -m bicache_sgl.calibrate --model-path M --data prompts.jsonl --out bicache_profile.json

For every sample and every prefix-fraction bucket r, the sequence is ``prompt tokens + G'
generation positions`` (all MASK) and the shared prefix S is its first r * N tokens. Two states
of S are compared layer by layer:

- cached: S alone through the model (a prefix-only forward: what an explicit ``cache_prefix``
  request, ``max_new_tokens: 0``, stores in the runtime's prefix pool);
- in context: the whole sequence through the model, sliced to S.

Per layer the similarity is the mean over S's tokens of the cosine similarity of K (heads
flattened) and of V, combined as their mean. Criteria:

- ``kv-cosine`` (the paper's): b(r) = number of leading layers whose similarity (mean over the
  bucket's samples) is >= --threshold. ``--depth-rule resume`` is stricter: in this runtime a
  request at depth d also resumes the prefix at layer d from the *cached* residual stream, so
  layer d's K/V of S are the cached ones too; that rule requires layers 0..d all above threshold.
- ``agreement`` (end to end): greedy decoding through the real Engine (prefix cache ``naive``,
  so the pool holds all L layers), prefix S filled by a prefix-only request, then the same request
  once per depth d = 0..L (``bicache_depth=d``, all in one batch); b(r) = the largest d whose
  token agreement with d = 0 (which is exactly cache-off) is >= --agreement.

The table is made non-decreasing (``BicacheProfile.monotone``) and written with the measured
matrices; a PNG shows the similarity heatmap (fraction x layer) with the chosen depth drawn on it.
Data: jsonl, one object per line: ``{"prompt": ...}`` / ``{"text": ...}`` (S is cut inside the
prompt, at most up to its second-to-last token, since the runtime always recomputes a prompt's
last token) or ``{"prefix": ..., "suffix": ...}`` (S is the prefix; r is reached by using more
or less of the suffix, and of the generation region in whole blocks). See docs/calibration.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence
from .scheduler.scheduler import common_prefix_len

log = logging.getLogger("bicache_sgl.calibrate")

CRITERIA = ("kv-cosine", "agreement")
DEPTH_RULES = ("leading", "resume")
DEFAULT_FRACTIONS = (10, 20, 30, 40, 50, 60, 70, 80, 90)


class DataError(ValueError):
    """The calibration data file is unusable; the message names the file and line."""


# ------------------------------------------------------------------------------------------ data
@dataclass
class Record:
    line: int
    kind: str  # "prompt" | "pair"
    text: str = ""
    prefix: str = ""
    suffix: str = ""


@dataclass
class Sample:
    line: int
    kind: str
    ids: list[int]  # prompt tokens (prompts) or prefix + suffix tokens (pairs)
    prefix_len: int = 0  # pairs: |S| (tokens shared by prefix and prefix + suffix)


@dataclass(frozen=True)
class Task:
    """One (sample, bucket) measurement."""

    sample: int
    bucket: int
    s_len: int  # |S|
    prompt_len: int  # tokens of the request's prompt (S + the rest of the prompt)
    gen_len: int  # generation positions (whole blocks)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def r(self) -> float:
        return self.s_len / self.seq_len


def read_data(path: str | Path) -> list[Record]:
    """Parse the jsonl file; raise DataError naming the first bad line."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {path} does not exist")
    out = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text: {e}") from e
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path} line {n}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if "prefix" in obj or "suffix" in obj:
            pre, suf = obj.get("prefix"), obj.get("suffix")
            if not isinstance(pre, str) or not isinstance(suf, str):
                raise DataError(f"{where}: a prefix/suffix pair needs both \"prefix\" and \"suffix\" as strings")
            if not pre or not suf:
                raise DataError(f"{where}: \"prefix\" and \"suffix\" must be non-empty")
            out.append(Record(n, "pair", prefix=pre, suffix=suf))
            continue
        key = "prompt" if "prompt" in obj else "text" if "text" in obj else None
        if key is None:
            raise DataError(f"{where}: expected {{\"prompt\": ...}}, {{\"text\": ...}} or "
                            f"{{\"prefix\": ..., \"suffix\": ...}}; got keys {sorted(obj)}")
        if not isinstance(obj[key], str) or not obj[key]:
            raise DataError(f"{where}: \"{key}\" must be a non-empty string")
        out.append(Record(n, "prompt", text=obj[key]))
    if not out:
        raise DataError(f"{path} holds no samples (one JSON object per line)")
    return out


def tokenize(records: Sequence[Record], encode, max_samples: int | None) -> list[Sample]:
    """Token ids per record. For a pair, |S| = the tokens that encode(prefix) and
    encode(prefix + suffix) share (a merge across the boundary is not part of the prefix)."""
    out = []
    for rec in records:
        if max_samples is not None and len(out) >= max_samples:
            break
        if rec.kind == "prompt":
            ids = list(encode(rec.text))
            if len(ids) < 2:
                log.warning("data line %d: prompt has %d token(s), too short for a shared prefix; skipped",
                            rec.line, len(ids))
                continue
            out.append(Sample(rec.line, "prompt", ids))
        else:
            full = list(encode(rec.prefix + rec.suffix))
            p = common_prefix_len(list(encode(rec.prefix)), full)
            if p < 1 or len(full) <= p:
                log.warning("data line %d: prefix and suffix do not tokenize into a non-empty prefix plus "
                            "a non-empty rest; skipped", rec.line)
                continue
            out.append(Sample(rec.line, "pair", full, p))
    return out


def gen_candidates(gen_length: int, block_length: int) -> list[int]:
    """Generation-region sizes to try, largest first: the full region (max_new_tokens rounded up
    to whole blocks, as the engine does), then one block less, ... down to one block."""
    g = -(-gen_length // block_length) * block_length
    return list(range(g, 0, -block_length))


def plan_task(sample: Sample, si: int, bi: int, r_pct: float, gens: Sequence[int], max_len: int) -> Task | None:
    """The sequence that puts this sample at prefix fraction r, or None if it cannot."""
    r = r_pct / 100.0
    for g in gens:
        if sample.kind == "prompt":
            P = len(sample.ids)
            s = int(round(r * (P + g)))
            # S stays inside the prompt and leaves its last token (always recomputed by the runtime)
            if 1 <= s <= P - 1 and P + g <= max_len:
                return Task(si, bi, s, P, g)
        else:
            p = sample.prefix_len
            prompt_len = int(round(p / r)) - g
            if p + 1 <= prompt_len <= len(sample.ids) and prompt_len + g <= max_len:
                return Task(si, bi, p, prompt_len, g)
    return None


# ------------------------------------------------------------------------------- measurement
def _token_cosine(a, b):
    """Mean over tokens of the cosine similarity of rows (trailing dims flattened), in float64.
    Identical rows give exactly 1.0."""
    import torch
    a = a.reshape(a.shape[0], -1).double()
    b = b.reshape(b.shape[0], -1).double()
    dot = (a * b).sum(-1)
    den = torch.sqrt((a * a).sum(-1) * (b * b).sum(-1))
    cos = torch.where(den > 0, dot / den.clamp_min(1e-300), torch.ones_like(dot))
    return float(cos.mean())


class SimilarityMeter:
    """K / V / h similarity per layer between the prefix-only state and the in-context state."""

    def __init__(self, model, mask_id: int, device) -> None:
        self.model, self.mask_id, self.device = model, mask_id, device
        self._full_key = None
        self._full_states = None

    def measure(self, sample: Sample, task: Task) -> tuple[list[float], list[float], list[float]]:
        import torch
        key = (task.sample, task.prompt_len, task.gen_len)
        if key != self._full_key:  # prompts: one full forward serves every bucket of the sample
            full = torch.tensor(sample.ids[:task.prompt_len] + [self.mask_id] * task.gen_len, dtype=torch.long,
                                device=self.device)
            self._full_states = self.model.forward_dense(full, return_states=True)[1]
            self._full_key = key
        s_ids = torch.tensor(sample.ids[:task.s_len], dtype=torch.long, device=self.device)
        cached = self.model.forward_dense(s_ids, return_states=True)[1]
        S = task.s_len
        sk, sv, sh = [], [], []
        for (h_c, k_c, v_c), (h_f, k_f, v_f) in zip(cached, self._full_states):
            sk.append(_token_cosine(k_c, k_f[:S]))
            sv.append(_token_cosine(v_c, v_f[:S]))
            sh.append(_token_cosine(h_c, h_f[:S]))
        return sk, sv, sh


def token_agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Fraction of positions holding the same token, over the longer output (outputs stop at
    EOS, so a shorter output counts its missing positions as disagreements); 1.0 if both empty."""
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    return sum(1 for x, y in zip(a, b) if x == y) / n


class AgreementMeter:
    """End-to-end: the same request at every depth 0..L through a ``naive`` Engine whose prefix
    cache holds S from a prefix-only request."""

    def __init__(self, engine, gen_length: int) -> None:
        self.engine = engine
        self.L = engine.model_config.n_layers
        self.gen_length = gen_length
        # All L+1 requests share their whole prompt: admit them in one step (no prefix-aware
        # deferral), so every one of them matches exactly S and nothing a sibling inserted.
        engine.scheduler.prefix_aware = False

    def _run(self, greqs) -> list:
        results: list = [None] * len(greqs)
        done = threading.Semaphore(0)

        def make_cb(i):
            def cb(ev):
                if ev.finished:
                    results[i] = ev
                    done.release()
            return cb

        self.engine.submit_many(greqs, [make_cb(i) for i in range(len(greqs))])
        for _ in greqs:
            done.acquire()
        for ev in results:
            if ev.error:
                raise RuntimeError(f"calibration request failed: {ev.error}")
        return results

    def measure(self, sample: Sample, task: Task, sampling: dict) -> tuple[list[float], list[list[int]]]:
        from .config import SamplingParams
        from .io_struct import GenerateRequest
        eng = self.engine
        if not eng.flush_cache():
            raise RuntimeError("could not flush the prefix cache")
        s_ids = sample.ids[:task.s_len]
        self._run([GenerateRequest(s_ids, SamplingParams(max_new_tokens=0))])
        params = SamplingParams.from_dict({**sampling, "max_new_tokens": min(self.gen_length, task.gen_len),
                                           "temperature": 0.0})
        prompt = sample.ids[:task.prompt_len]
        evs = self._run([GenerateRequest(prompt, params, bicache_depth=d) for d in range(self.L + 1)])
        for d, ev in enumerate(evs):
            m = ev.meta_info
            if m.get("bicache_depth") != d or (d > 0 and m.get("reused_prefix_tokens") != task.s_len):
                raise RuntimeError(
                    f"calibration request at depth {d} reused {m.get('reused_prefix_tokens')} prefix tokens at depth "
                    f"{m.get('bicache_depth')}; expected {task.s_len} at depth {d} (is the prefix cache large enough?)")
        outs = [list(ev.output_ids) for ev in evs]
        return [token_agreement(outs[0], o) for o in outs], outs


# ---------------------------------------------------------------------------------- decisions
def depth_from_similarity(sim: Sequence[float], threshold: float, rule: str = "resume") -> int:
    """``leading``: number of leading layers with sim >= threshold. ``resume``: the largest d with
    layers 0..d all >= threshold (layer d's K/V of S come from the cached residual stream), L if
    every layer passes."""
    L = len(sim)
    c = 0
    while c < L and sim[c] >= threshold:
        c += 1
    if rule == "leading" or c == L:
        return c
    return max(0, c - 1)


def depth_from_agreement(agr: Sequence[float], min_agreement: float) -> int:
    """The largest depth d whose token agreement with cache-off is >= min_agreement (0 always is)."""
    best = 0
    for d, a in enumerate(agr):
        if a >= min_agreement - 1e-12:
            best = d
    return best


def _mean_rows(rows: list[list[float]]) -> list[float] | None:
    if not rows:
        return None
    return [sum(col) / len(col) for col in zip(*rows)]


def kv_cosine_profile(model, model_config, samples: Sequence[Sample], *, fractions: Sequence[float] = DEFAULT_FRACTIONS,
                      gen_length: int = 32, block_length: int = 32, threshold: float = 0.97,
                      depth_rule: str = "resume", model_name: str = ""):
    """The kv-cosine profile of already tokenized samples (for scripts that build their own
    workload, e.g. examples/bench_prefix.py). Returns (BicacheProfile, per-bucket similarity)."""
    import torch

    from .bicache.profile import BicacheProfile
    device = next(model.parameters()).device
    meter = SimilarityMeter(model, model_config.mask_token_id, device)
    gens = gen_candidates(gen_length, block_length)
    rows: list[list[list[float]]] = [[] for _ in fractions]
    with torch.no_grad():
        for si, s in enumerate(samples):
            for bi, r in enumerate(fractions):
                t = plan_task(s, si, bi, r, gens, model_config.max_position_embeddings)
                if t is not None:
                    sk, sv, _ = meter.measure(s, t)
                    rows[bi].append([(a + b) / 2 for a, b in zip(sk, sv)])
    sims = [_mean_rows(x) for x in rows]
    entries = [(0.0, 0)] + [(float(r), depth_from_similarity(sim, threshold, depth_rule))
                            for r, sim in zip(fractions, sims) if sim is not None and r > 0]
    prof = BicacheProfile(table=tuple(BicacheProfile.monotone(entries)), n_layers=model_config.n_layers,
                          model=model_name, criterion="kv-cosine", threshold=threshold,
                          extra={"fractions": list(fractions), "similarity": sims, "depth_rule": depth_rule})
    return prof, sims


# --------------------------------------------------------------------------------------- plot
def plot_profile(path: str | Path, result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    fr = result["fractions"]
    L = result["n_layers"]
    sim = np.array([[np.nan] * L if row is None else row for row in result["similarity"]], dtype=float)
    table = dict((float(r), b) for r, b in result["table"])
    depth = [table.get(float(r), np.nan) if result["samples_per_fraction"][i] else np.nan for i, r in enumerate(fr)]
    agr = result.get("agreement")
    ncols = 2 if agr is not None else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols + 1, 0.45 * len(fr) + 2.6), squeeze=False)
    ys = np.arange(len(fr))

    ax = axes[0][0]
    finite = sim[np.isfinite(sim)]
    vmin = float(min(finite.min(), result["kv_threshold"] - 0.05)) if finite.size else 0.0
    im = ax.imshow(np.ma.masked_invalid(sim), aspect="auto", origin="lower", cmap="viridis", vmin=vmin, vmax=1.0,
                   extent=(-0.5, L - 0.5, -0.5, len(fr) - 0.5), interpolation="nearest")
    fig.colorbar(im, ax=ax, label="K/V cosine (prefix-only vs in-context)")
    # the chosen depth as a boundary: layers left of it are reused from the cache
    bx, by = [], []
    for i, d in enumerate(depth):
        if np.isnan(d):
            bx.append(np.nan)
            by.append(np.nan)
            ax.text((L - 1) / 2, i, "no sample reaches this fraction", ha="center", va="center", fontsize=7)
            continue
        bx += [d - 0.5, d - 0.5]
        by += [i - 0.5, i + 0.5]
    ax.plot(bx, by, color="red", lw=2.5, label="chosen depth b(r)")
    if result["criterion"] == "kv-cosine":
        raw = [np.nan if d is None else d for d in result["depth_raw"]]
        ax.plot([d - 0.5 for d in raw], ys, "x", color="white", ms=7, mew=2, label="per bucket, before monotone")
    ax.set_xlabel("layer")
    ax.set_ylabel("shared prefix fraction r (%)")
    ax.set_yticks(ys, [f"{r:g}" for r in fr])
    ax.set_xlim(-0.5, L - 0.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"K/V similarity, threshold {result['kv_threshold']:g}" if result["criterion"] == "kv-cosine"
                 else "K/V similarity (depth chosen by agreement)")
    ax.legend(loc="lower right", fontsize=7, facecolor="silver", framealpha=0.8)

    if agr is not None:
        ax = axes[0][1]
        a = np.array([[np.nan] * (L + 1) if row is None else row for row in agr], dtype=float)
        im = ax.imshow(np.ma.masked_invalid(a), aspect="auto", origin="lower", cmap="magma", vmin=0.0, vmax=1.0,
                       extent=(-0.5, L + 0.5, -0.5, len(fr) - 0.5), interpolation="nearest")
        fig.colorbar(im, ax=ax, label="token agreement with cache-off")
        ax.plot([x + 1 for x in bx], by, color="cyan", lw=2.5, label="chosen depth b(r) (cells left of the line)")
        raw = [np.nan if d is None else d for d in result["depth_raw"]]
        ax.plot(raw, ys, "x", color="cyan", ms=7, mew=2, label="per bucket, before monotone")
        ax.set_xlabel("bicache depth d (layers reused)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_yticks(ys, [f"{r:g}" for r in fr])
        ax.set_title(f"greedy agreement, min {result['min_agreement']:g}")
        ax.legend(loc="lower right", fontsize=7, facecolor="silver", framealpha=0.8)
    fig.suptitle(f"bicache profile: {result['model']} ({L} layers, {result['criterion']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------- CLI
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m bicache_sgl.calibrate",
        description="Measure how far a cached shared prefix can be reused for a diffusion LM and write "
                    "its bicache profile (prefix fraction r -> safe depth b) as JSON plus a PNG plot.",
        epilog="Put the result beside the model as bicache_profile.json, or pass it to the server / Engine "
               "with --bicache-profile. Details: docs/calibration.md.",
        formatter_class=_HelpFormatter)
    ap.add_argument("--model-path", default=None,
                    help="checkpoint folder or Hugging Face id (default: the bundled model)")
    ap.add_argument("--data", required=True,
                    help='jsonl, one object per line: {"prompt": ...} / {"text": ...} or '
                         '{"prefix": ..., "suffix": ...}')
    ap.add_argument("--out", required=True, help="profile JSON to write")
    ap.add_argument("--plot", default=None,
                    help="PNG to write (default: the --out path with .png; 'none' for no plot)")
    ap.add_argument("--criterion", choices=CRITERIA, default="kv-cosine",
                    help="kv-cosine: leading layers whose K/V similarity >= --threshold; agreement: largest depth "
                         "whose greedy output agrees with cache-off on >= --agreement of the tokens")
    ap.add_argument("--threshold", type=_unit("--threshold"), default=0.97,
                    help="K/V cosine threshold (kv-cosine criterion)")
    ap.add_argument("--depth-rule", choices=DEPTH_RULES, default="resume",
                    help="kv-cosine: 'leading' = count of leading layers above threshold (the paper); 'resume' = "
                         "also require layer b itself, whose K/V of the prefix come from the cached residual stream")
    ap.add_argument("--agreement", type=_unit("--agreement"), default=0.9,
                    help="minimum token agreement with cache-off (agreement criterion)")
    ap.add_argument("--fractions", type=_parse_fractions, default=",".join(map(str, DEFAULT_FRACTIONS)),
                    help="prefix-fraction buckets in percent, comma-separated")
    ap.add_argument("--gen-length", type=_positive_int, default=32, help="generation positions (max_new_tokens)")
    ap.add_argument("--block-length", type=_positive_int, default=32,
                    help="decoding block; the generation region is whole blocks")
    ap.add_argument("--max-samples", type=_positive_int, default=None, help="use at most this many samples")
    ap.add_argument("--decode-threshold", type=_unit("--decode-threshold"), default=0.9,
                    help="agreement: confidence-threshold decoding (0: fixed one-token-per-step schedule)")
    ap.add_argument("--cache-mode", choices=("none", "prefix", "dual"), default="dual",
                    help="agreement: in-request cache of the decoding runs")
    ap.add_argument("--steps-per-block", type=_positive_int, default=None,
                    help="agreement: denoising steps per block (default: one per token)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                    help="auto: float32 on CPU, the checkpoint's dtype on CUDA")
    ap.add_argument("--num-threads", type=_positive_int, default=None, help="torch CPU threads")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _model_name(model_arg: str | None, resolved: str) -> str:
    if model_arg and not Path(model_arg).expanduser().exists() and model_arg.count("/") == 1:
        return model_arg  # hub id
    return Path(resolved).resolve().name


def calibrate(args: argparse.Namespace) -> dict:
    """Run the measurement; returns the profile dict (``BicacheProfile.to_dict`` shape + extras)."""
    import torch
    from tqdm import tqdm

    from .bicache.profile import BicacheProfile
    from .models.loader import load_model, load_model_config, load_tokenizer, resolve_model_path

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
    gens = gen_candidates(args.gen_length, args.block_length)
    fractions = list(args.fractions)
    tasks = []
    for si, s in enumerate(samples):
        for bi, r in enumerate(fractions):
            t = plan_task(s, si, bi, r, gens, mcfg.max_position_embeddings)
            if t is not None:
                tasks.append(t)
    if not tasks:
        raise DataError(f"{args.data}: no sample reaches any prefix fraction in {fractions} with "
                        f"--gen-length {args.gen_length} (prompts too short, or pairs whose suffix is too short "
                        "or too long for the buckets)")

    engine = None
    if args.criterion == "agreement":
        from .engine.engine import Engine
        # the pool only ever holds one S (flushed between measurements) plus one request's tail
        cap = max(t.prompt_len for t in tasks) + 1
        engine = Engine(model_path, prefix_cache="naive", device=args.device, dtype=args.dtype,
                        max_running_requests=L + 1, max_prefix_cache_tokens=cap,
                        block_length=args.block_length, threshold=args.decode_threshold or None,
                        cache_mode=args.cache_mode, steps_per_block=args.steps_per_block)
        model, device = engine.model, engine.device
    else:
        dev = args.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        model, _ = load_model(model_path, args.dtype, dev)
        device = torch.device(dev)
    sim_meter = SimilarityMeter(model, mcfg.mask_token_id, device)
    agr_meter = AgreementMeter(engine, args.gen_length) if engine is not None else None
    sampling = {"block_length": args.block_length, "cache_mode": args.cache_mode,
                "threshold": args.decode_threshold}
    if args.steps_per_block:
        sampling["steps_per_block"] = args.steps_per_block

    nb = len(fractions)
    per_k: list[list[list[float]]] = [[] for _ in range(nb)]
    per_v: list[list[list[float]]] = [[] for _ in range(nb)]
    per_h: list[list[list[float]]] = [[] for _ in range(nb)]
    per_a: list[list[list[float]]] = [[] for _ in range(nb)]
    per_r: list[list[float]] = [[] for _ in range(nb)]
    t0 = time.time()
    bar = tqdm(tasks, desc=f"calibrate ({args.criterion})", unit="task", disable=args.no_progress,
               file=sys.stderr, dynamic_ncols=True)
    try:
        for t in bar:
            bar.set_postfix_str(f"sample {t.sample + 1}/{len(samples)} r={fractions[t.bucket]:g}%", refresh=False)
            s = samples[t.sample]
            sk, sv, sh = sim_meter.measure(s, t)
            per_k[t.bucket].append(sk)
            per_v[t.bucket].append(sv)
            per_h[t.bucket].append(sh)
            per_r[t.bucket].append(t.r)
            if agr_meter is not None:
                agr, _ = agr_meter.measure(s, t, sampling)
                per_a[t.bucket].append(agr)
    finally:
        bar.close()
        if engine is not None:
            engine.shutdown()

    sim_k = [_mean_rows(x) for x in per_k]
    sim_v = [_mean_rows(x) for x in per_v]
    sim_h = [_mean_rows(x) for x in per_h]
    sim = [None if k is None else [(a + b) / 2 for a, b in zip(k, v)] for k, v in zip(sim_k, sim_v)]
    agree = [_mean_rows(x) for x in per_a] if engine is not None else None
    raw: list[int | None] = []
    for bi in range(nb):
        if sim[bi] is None:
            raw.append(None)
        elif args.criterion == "kv-cosine":
            raw.append(depth_from_similarity(sim[bi], args.threshold, args.depth_rule))
        else:
            raw.append(depth_from_agreement(agree[bi], args.agreement))
    entries = [(fractions[bi], raw[bi]) for bi in range(nb) if raw[bi] is not None]
    if not any(r == 0 for r, _ in entries):
        entries.insert(0, (0.0, 0))
    table = BicacheProfile.monotone(entries)
    thr = args.threshold if args.criterion == "kv-cosine" else args.agreement
    prof = BicacheProfile(table=tuple(table), n_layers=L, model=_model_name(args.model_path, model_path),
                          criterion=args.criterion, threshold=thr)
    counts = [len(x) for x in per_k]
    missing = [f"{fractions[i]:g}" for i in range(nb) if counts[i] == 0]
    if missing:
        log.warning("no sample reached prefix fraction(s) %s%%; the table has no entry there (lookup falls back "
                    "to the next lower fraction)", ", ".join(missing))
    rnd = lambda row: None if row is None else [round(float(x), 6) for x in row]  # noqa: E731
    result = {
        **prof.to_dict(),
        "kv_threshold": args.threshold,
        "min_agreement": args.agreement if args.criterion == "agreement" else None,
        "depth_rule": args.depth_rule if args.criterion == "kv-cosine" else None,
        "fractions": fractions,
        "samples_per_fraction": counts,
        "mean_prefix_fraction": [round(sum(x) / len(x), 6) if x else None for x in per_r],
        "depth_raw": raw,
        "similarity": [rnd(r) for r in sim],
        "similarity_k": [rnd(r) for r in sim_k],
        "similarity_v": [rnd(r) for r in sim_v],
        "similarity_h": [rnd(r) for r in sim_h],
        "agreement": None if agree is None else [rnd(r) for r in agree],
        "cached_state": "prefix-only forward (as an explicit cache_prefix request fills the prefix cache)",
        "data": str(args.data),
        "num_samples": len(samples),
        "gen_length": args.gen_length,
        "block_length": args.block_length,
        "decode": ({"cache_mode": args.cache_mode, "threshold": args.decode_threshold,
                    "steps_per_block": args.steps_per_block, "temperature": 0.0}
                   if args.criterion == "agreement" else None),
        "seconds": round(time.time() - t0, 2),
    }
    return result


def format_summary(result: dict) -> str:
    L = result["n_layers"]
    table = dict((float(r), b) for r, b in result["table"])
    agr = result.get("agreement")
    head = "| r (%) | samples | mean r | b(r) | raw | similarity at layer b-1 | at layer b |"
    sep = "|---|---|---|---|---|---|---|"
    if agr is not None:
        head += " agreement at b | at L (naive) |"
        sep += "---|---|"
    lines = [head, sep]
    for i, r in enumerate(result["fractions"]):
        n = result["samples_per_fraction"][i]
        if n == 0:
            lines.append(f"| {r:g} | 0 | - | - | - | - | - |" + (" - | - |" if agr is not None else ""))
            continue
        b = table.get(float(r), 0)
        sim = result["similarity"][i]
        before = f"{sim[b - 1]:.4f}" if b >= 1 else "-"
        at = f"{sim[b]:.4f}" if b < L else "-"
        row = f"| {r:g} | {n} | {result['mean_prefix_fraction'][i]:.3f} | {b} | {result['depth_raw'][i]} | " \
              f"{before} | {at} |"
        if agr is not None:
            row += f" {agr[i][b]:.3f} | {agr[i][L]:.3f} |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    plot_path: str | None = args.plot
    if plot_path is None:
        plot_path = str(Path(args.out).with_suffix(".png"))
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            log.warning("matplotlib is not installed (pip install 'bicache-sgl[plot]'); no plot written")
            plot_path = None
    elif plot_path.lower() == "none":
        plot_path = None
    else:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("error: --plot needs matplotlib (pip install 'bicache-sgl[plot]')") from None
    try:
        result = calibrate(args)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    from .bicache.profile import BicacheProfile
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    BicacheProfile.load(args.out)  # what the runtime will read must load
    if plot_path:
        plot_profile(plot_path, result)
    print(f"\nbicache profile for {result['model']} ({result['n_layers']} layers), criterion {result['criterion']}"
          f" (threshold {result['threshold']:g}), {result['num_samples']} samples, {result['seconds']:.1f} s\n")
    print(format_summary(result))
    print(f"\ntable (r % -> b): {result['table']}")
    print(f"wrote {args.out}" + (f" and {plot_path}" if plot_path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
