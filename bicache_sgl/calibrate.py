"""``python -m bicache_sgl.calibrate``: kept as the entry point; the code lives in
``bicache_sgl.calibration`` (data, measure, cli, plot). The names scripts import from here
(``Sample``, ``kv_cosine_profile``, ...) are re-exported."""

import sys

from .calibration import (
    DataError,
    Sample,
    depth_from_agreement,
    depth_from_similarity,
    gen_candidates,
    kv_cosine_profile,
    plan_task,
    token_agreement,
)
from .calibration.cli import build_parser, calibrate, main

__all__ = ["DataError", "Sample", "build_parser", "calibrate", "depth_from_agreement", "depth_from_similarity",
           "gen_candidates", "kv_cosine_profile", "main", "plan_task", "token_agreement"]

if __name__ == "__main__":
    sys.exit(main())
