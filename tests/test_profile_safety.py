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
this test fails: 11 of 72 answers differ from cache off, all reused at depth 8 (re-checked with
the per-mode runtime: ``workload_stats`` on that profile). The shipped exact profile has a table
per generation mode (bicache/profile.py): answers that stop at EOS read the "stop" table, depth 8
from r = 70% (n = 60 calibration samples without a disagreement, 95% bound 4.87%), answers forced
past EOS the "ignore_eos" table, depth 0 everywhere. So the test also asserts that the stop
requests whose shared fraction reaches the stop table's reusable range are reused at depth > 0
on most of them (measured: 16 of the 21 such requests over the 4 seeds; those left out had their
rows captured beside a longer sequence, so their own r stays below 70%), and that no ignore_eos
request is reused. Of all 56 stop requests, 16 reuse; most of the others share only a head or a
first block with what the cache holds (r below 70%, where the calibration found flips).
The workload generator is ``bicache_sgl.training.calib_shapes.compositions`` (also
``examples/bench_profile_safety.py``).
"""

from __future__ import annotations

import pytest

from bicache_sgl import Engine
from bicache_sgl.bicache.policy import request_mode
from bicache_sgl.bicache.profile import MODE_IGNORE_EOS, MODE_STOP, PROFILE_FILENAME, BicacheProfile
from bicache_sgl.config import SamplingParams
from bicache_sgl.io_struct import GenerateRequest, span_depth
from bicache_sgl.models.loader import resolve_model_path
from bicache_sgl.training.calib_shapes import compositions

SEEDS = (0, 1, 2, 3)
BATCH = 4
GEN_REGION = 32  # the generation region of 8 or 32 new tokens: one block of 32 positions


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


def workload_stats(off: Engine, bic: Engine, profile: BicacheProfile) -> dict:
    """Run the workload on both engines; the answers that differ and the reuse per generation mode.
    ``in_range``: stop requests whose shared fraction can reach the stop table's first reusable
    bucket (r_max = cached_tokens / the request's positions: the capturer sharing every matched
    token, with no more positions than the request)."""
    first_reusable = min((r for r, b in profile.table_for(MODE_STOP) if b > 0), default=None)
    n = matched = 0
    diffs, stop, ign = [], [], []
    for seed in SEEDS:
        reqs = compositions(seed)
        for (_prompt, sp), a, b in zip(reqs, run_batches(off, reqs), run_batches(bic, reqs)):
            assert a.error is None and b.error is None
            m = b.meta_info
            n += 1
            matched += m["cached_tokens"] > 0
            mode = request_mode(SamplingParams.from_dict(sp), bic.eos_ids)
            depth = span_depth(m)  # the depth its reused span was read at (bicache_depth: most of the match)
            assert m["bicache_depth"] <= depth <= profile.lookup(1.0, mode)
            r_max = m["cached_tokens"] / (m["prompt_tokens"] + GEN_REGION)
            (stop if mode == MODE_STOP else ign).append((r_max, depth))
            if list(a.output_ids) != list(b.output_ids):
                diffs.append((seed, mode, depth, m["prefix_fraction"], a.text, b.text))
    in_range = [d for r, d in stop if first_reusable is not None and 100 * r >= first_reusable]
    return {"n": n, "matched": matched, "diffs": diffs, "stop": stop, "ignore_eos": ign, "in_range": in_range}


def test_shipped_profile_answers_equal_cache_off_and_reuse_stop_answers_where_it_allows(engines):
    off, bic = engines
    shipped = BicacheProfile.load(resolve_model_path(None) + "/" + PROFILE_FILENAME)
    assert bic.profile == shipped and bic.profile.by_mode == shipped.by_mode  # default flags: the shipped profile
    st = workload_stats(off, bic, shipped)
    n, diffs = st["n"], st["diffs"]
    assert n >= 60 and len(st["ignore_eos"]) >= 10
    long_diffs = sum(1 for d in diffs if d[1] == MODE_IGNORE_EOS)
    assert diffs == [], (f"{len(diffs)} of {n} answers differ from cache off ({len(diffs) - long_diffs} that stop "
                         f"at EOS, {long_diffs} forced past it), depths {sorted({d[2] for d in diffs})}: {diffs[:3]}")
    # later requests find earlier captures: the prefix cache matches most of them
    assert st["matched"] >= 0.7 * n, (st["matched"], n)
    # the ignore_eos table allows nothing on this model: no request forced past EOS is reused
    assert all(d == 0 for _, d in st["ignore_eos"])
    # stop requests are reused wherever their shared fraction reaches the stop table's reusable range
    in_range = st["in_range"]
    assert len(in_range) >= 15, in_range
    reused = sum(d > 0 for d in in_range)
    assert reused >= 0.6 * len(in_range), (reused, len(in_range))
