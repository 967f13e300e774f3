"""The calibration plot (needs matplotlib: ``pip install 'bicache-sgl[plot]'``)."""

from __future__ import annotations

from pathlib import Path


def plot_profile(path: str | Path, result: dict) -> None:
    """PNG: the similarity heatmap (fraction x layer) with the chosen depth drawn on it; with the
    agreement criterion a second panel shows agreement over fraction x depth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    fr = result["fractions"]
    L = result["n_layers"]
    sim = np.array([[np.nan] * L if row is None else row for row in result["similarity"]], dtype=float)
    table = {float(r): b for r, b in result["table"]}
    depth = [table.get(float(r), np.nan) if result["samples_per_fraction"][i] else np.nan for i, r in enumerate(fr)]
    agr = result.get("agreement")
    ncols = 2 if agr is not None else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols + 1, 0.45 * len(fr) + 2.6), squeeze=False)
    ys = np.arange(len(fr))
    ctx = (result.get("cached_context") or "prefix_only").replace("_", "-")

    ax = axes[0][0]
    finite = sim[np.isfinite(sim)]
    vmin = float(min(finite.min(), result["kv_threshold"] - 0.05)) if finite.size else 0.0
    im = ax.imshow(np.ma.masked_invalid(sim), aspect="auto", origin="lower", cmap="viridis", vmin=vmin, vmax=1.0,
                   extent=(-0.5, L - 0.5, -0.5, len(fr) - 0.5), interpolation="nearest")
    fig.colorbar(im, ax=ax, label=f"K/V cosine ({ctx} vs in-context)")
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
        ax.plot([d - 0.5 for d in raw], ys, "x", color="white", ms=7, mew=2, label="per bucket, before the safe pass")
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
        ax.plot(raw, ys, "x", color="cyan", ms=7, mew=2, label="per bucket, before the safe pass")
        ax.set_xlabel("bicache depth d (layers reused)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_yticks(ys, [f"{r:g}" for r in fr])
        ax.set_title(f"greedy agreement, min {result['min_agreement']:g}")
        ax.legend(loc="lower right", fontsize=7, facecolor="silver", framealpha=0.8)
    fig.suptitle(f"bicache profile: {result['model']} ({L} layers, {result['criterion']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
