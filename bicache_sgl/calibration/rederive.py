"""Re-derive the per-generation-mode tables of exact profiles from the counts they carry.

    python -m bicache_sgl.calibration.rederive bicache_sgl/assets/*/bicache_profile.json
    python -m bicache_sgl.calibration.rederive --check bicache_sgl/assets/*/bicache_profile.json

No model and no measurement: ``BicacheProfile.rederived`` applies the exact rule, the bound and the
monotone pass to ``buckets_by_mode`` and writes ``table_by_mode`` (and ``table`` no deeper than
any mode's). Deterministic: a second run changes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..bicache.profile import BicacheProfile


def main(argv: list[str] | None = None) -> None:
    """``python -m bicache_sgl.calibration.rederive FILE...``: rewrite each exact profile's per-mode
    tables (``table_by_mode``) from the counts it carries (``BicacheProfile.rederived``); no model,
    no measurement. Prints each file's tables."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0] if main.__doc__ else None)
    ap.add_argument("files", nargs="+", help="bicache_profile.json files (rewritten in place)")
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if a file would change")
    args = ap.parse_args(argv)
    stale = []
    for f in args.files:
        old = Path(f).read_text()
        prof = BicacheProfile.load(f).rederived()
        new = json.dumps(prof.to_dict(), indent=1) + "\n"
        print(f"{f}: table {[list(e) for e in prof.table]}; "
              + "; ".join(f"{m}: {[list(e) for e in t]}" for m, t in prof.by_mode))
        if new != old:
            stale.append(f)
            if not args.check:
                Path(f).write_text(new)
    if args.check and stale:
        raise SystemExit(f"not up to date: {', '.join(stale)}")


if __name__ == "__main__":
    main()
