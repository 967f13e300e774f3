"""The shipped profile keeps the promise of the rule: on the bundled default model with its shipped
bicache_profile.json and default flags, random but ordinary compositions (issue 34) answer exactly
as with the prefix cache off, token for token, while later requests match earlier captures.

The compositions are the shapes a user sends to a few-shot model: an optional shared system line in
front of 2-6 few-shot examples of one family of the bundled task, sometimes a second family's
examples after them, then the question; 8 new tokens (stopping at EOS), or 32 with ``ignore_eos``
(the generated region past EOS, where the model's text is out of distribution, must be equal too).
Requests sharing a head + first block arrive in small batches in shuffled order, so a request
reuses state captured in ANOTHER request's context (another question, another second family) as
the runtime does. Several seeds.

On the profile shipped before issue 34 (criterion "mean agreement >= 0.9", depth 8 from r = 10%)
this test failed: 11 of 72 answers differed from cache off (6 that stop at EOS, the answer digit
itself, e.g. off " 0", bicache " 5"; 5 that run past EOS), all reused at depth 8. In a draft of the
same generator a depth-1 profile at every r changed 15 of 73: on this model no depth above 0 is
exact in these shapes, which is what the recalibrated profile (criterion "exact") says: depth 0
at every r (docs/calibration.md). So the reuse this test can ask of the shipped profile is honestly
none; it asserts that the prefixes are still matched, and that a profile which does allow a depth
here would have to reuse on most requests. The workload generator is
``bicache_sgl.training.calib_shapes.compositions`` (also ``examples/bench_profile_safety.py``).
"""

from __future__ import annotations

import pytest

from bicache_sgl import Engine
from bicache_sgl.bicache.profile import PROFILE_FILENAME, BicacheProfile
from bicache_sgl.config import SamplingParams
from bicache_sgl.io_struct import GenerateRequest
from bicache_sgl.models.loader import resolve_model_path
from bicache_sgl.training.calib_shapes import compositions

SEEDS = (0, 1, 2, 3)
BATCH = 4


def run_batches(eng: Engine, reqs: list[tuple[str, dict]]) -> list:
    """Small batches, one after another on this thread: a later batch matches what earlier ones stored."""
    events = []
    for i in range(0, len(reqs), BATCH):
        greqs = [GenerateRequest(eng.encode(p), SamplingParams.from_dict(sp)) for p, sp in reqs[i:i + BATCH]]
        events += eng.run_sync(greqs)
    return events


@pytest.fixture(scope="module")
def engines():
    off = Engine(prefix_cache="off", device="cpu", num_threads=1)
    bic = Engine(device="cpu", num_threads=1)  # default flags: bicache, the shipped profile
    yield off, bic
    off.shutdown()
    bic.shutdown()


def test_shipped_profile_answers_equal_cache_off_on_ordinary_compositions(engines):
    off, bic = engines
    shipped = BicacheProfile.load(resolve_model_path(None) + "/" + PROFILE_FILENAME)
    assert bic.profile == shipped  # default flags run the shipped profile
    n = matched = reused = 0
    diffs = []
    for seed in SEEDS:
        reqs = compositions(seed)
        for (_prompt, sp), a, b in zip(reqs, run_batches(off, reqs), run_batches(bic, reqs)):
            assert a.error is None and b.error is None
            m = b.meta_info
            n += 1
            matched += m["cached_tokens"] > 0
            reused += m["bicache_depth"] > 0
            assert m["bicache_depth"] <= shipped.max_depth
            if list(a.output_ids) != list(b.output_ids):
                diffs.append((seed, sp.get("ignore_eos", False), m["bicache_depth"], m["prefix_fraction"],
                              a.text, b.text))
    assert n >= 60
    long_diffs = sum(1 for d in diffs if d[1])
    assert diffs == [], (f"{len(diffs)} of {n} answers differ from cache off ({len(diffs) - long_diffs} that stop "
                         f"at EOS, {long_diffs} past EOS), depths {sorted({d[2] for d in diffs})}: {diffs[:3]}")
    # later requests find earlier captures: the prefix cache matches most of them
    assert matched >= 0.7 * n, (matched, n)
    # and reuse at depth > 0 happens wherever the profile allows it. The recalibrated profile of
    # this model allows none in these shapes (every depth >= 1 changed answers in calibration), so
    # this is honest only as "reuse iff the profile allows it": a profile with depth somewhere
    # reachable must reuse on most requests.
    if any(b > 0 for r, b in shipped.table if r <= 60):
        assert reused >= 0.7 * n, (reused, n)
    else:
        assert reused == 0
