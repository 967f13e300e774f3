"""Admission's rule for output captures (tensor-free, milliseconds): the next turn of a
conversation waits for the previous turn's pending prompt + answer capture whatever the answer's
length, and captures never wait for each other in a cycle."""

from __future__ import annotations

import numpy as np

from bicache_sgl.scheduler.scheduler import Admission


class _R:
    """A waiting request as Admission sees it (the Schedulable protocol)."""

    def __init__(self, prompt: list[int], *, internal: bool = False, kv_tokens: int = 10) -> None:
        self.prompt, self.kv_tokens, self.internal = prompt, kv_tokens, internal
        self.prompt_ids = np.asarray(prompt, dtype=np.int64)


TURN1 = list(range(100, 140))  # 40 tokens, cached by turn 1's own first forward


def _cached(cache: list[list[int]]):
    """cached_len over a set of inserted prompts: the longest common prefix with any, capped as
    the cache manager caps it (the last prompt token is always recomputed)."""
    def peek(r: _R) -> int:
        best = 0
        for p in cache:
            n = 0
            while n < min(len(p), len(r.prompt) - 1) and p[n] == r.prompt[n]:
                n += 1
            best = max(best, n)
        return best
    return peek


def test_next_turn_waits_for_a_short_answer_capture():
    """The flake of test_multiturn_reuse_of_cached_answers_answers_as_cache_off: turn 2 arrives
    in the same round as turn 1's capture (a 2-token answer, under min_shared); admitted together,
    turn 2 would match only turn 1's prompt. It waits for the capture and then matches the answer."""
    adm = Admission(max_running=4, kv_budget=1000, min_shared=16)
    capture = _R(TURN1 + [7, 8], internal=True)
    turn2 = _R(TURN1 + [7, 8] + [200, 201, 202])
    adm.add(capture)
    adm.add(turn2)
    cache = [TURN1]
    assert adm.select(0, _cached(cache)) == [capture]  # the old rule admitted [capture, turn2]
    cache.append(capture.prompt)  # the capture's forward inserted prompt + answer
    adm.finished(capture)
    assert adm.select(0, _cached(cache)) == [turn2]
    assert _cached(cache)(turn2) == len(capture.prompt)  # turn 2 reuses the whole answer


def test_capture_held_back_still_holds_the_next_turn():
    """A capture deferred behind a picked request that computes their shared prefix: the next
    turn waits with it, and again in the capture's own round (the old rule admitted both then)."""
    adm = Admission(max_running=4, kv_budget=1000, min_shared=16)
    shared = list(range(300, 340))
    first = _R(shared + [1])
    capture = _R(shared + [2, 3], internal=True)
    turn2 = _R(shared + [2, 3, 4, 5])
    for r in (first, capture, turn2):
        adm.add(r)
    assert adm.select(0, lambda r: 0) == [first]
    cache = [shared + [1]]
    assert adm.select(1, _cached(cache)) == [capture]
    cache.append(capture.prompt)
    assert adm.select(2, _cached(cache)) == [turn2]


def test_unrelated_requests_and_other_captures_do_not_wait():
    """Only a request that continues past what is cached waits: one sharing just the cached
    template is admitted with the capture, and of two captures that share more than is cached
    (two samples of one prompt) the later waits one round, the earlier never (no cycle)."""
    adm = Admission(max_running=8, kv_budget=1000)
    capture = _R(TURN1 + [7, 8], internal=True)
    unrelated = _R(TURN1[:5] + [900, 901])  # shares only the cached template start
    adm.add(capture)
    adm.add(unrelated)
    assert adm.select(0, _cached([TURN1])) == [capture, unrelated]

    adm = Admission(max_running=8, kv_budget=1000)
    c1, c2 = _R(TURN1 + [7, 8], internal=True), _R(TURN1 + [7, 9], internal=True)
    adm.add(c1)
    adm.add(c2)
    assert adm.select(0, _cached([TURN1])) == [c1]
    assert adm.select(1, _cached([TURN1, c1.prompt])) == [c2]


def test_without_prefix_awareness_captures_hold_nothing():
    """Arrival-order admission (a calibration's stack) keeps its rule: everything that fits goes."""
    adm = Admission(max_running=4, kv_budget=1000, prefix_aware=False)
    capture, turn2 = _R(TURN1 + [7, 8], internal=True), _R(TURN1 + [7, 8, 9, 10])
    adm.add(capture)
    adm.add(turn2)
    assert adm.select(0, lambda r: 0) == [capture, turn2]


def test_requests_that_could_reuse_a_shared_prefix_wait_for_it_and_others_do_not():
    """Eight requests sharing a 256-token uncached head (bench_serving's generated-shared-prefix):
    when the policy would let them reuse it, only the first is admitted and the rest wait one
    forward for its capture; when it would not (their mode's table gives depth 0 there), waiting
    gains nothing, so all are admitted together in one batch."""
    head = list(range(1000, 1256))
    group = [_R(head + [5000 + i, 6000 + i]) for i in range(8)]
    for reusable, first_round in ((lambda r, n: True, 1), (lambda r, n: False, 8), (None, 1)):
        adm = Admission(max_running=16, kv_budget=1000, min_shared=16)
        for r in group:
            adm.add(r)
        got = adm.select(0, _cached([]), reusable)
        assert len(got) == first_round and got[0] is group[0]
        # once the head is cached nobody waits for it
        assert len(adm.select(0, _cached([head]), lambda r, n: True)) == 8 - first_round


def test_a_cached_prefix_that_cannot_serve_is_computed_once_then_reused():
    """A prefill-only hint cached the family's 115-token block, but its rows cannot serve a
    question (b(115 / N) = 0); the questions share 125 tokens, which they could reuse (b > 0). One
    question is admitted to re-capture the block; the others wait one forward for its rows."""
    block = list(range(2000, 2115))
    qs = [_R(block + list(range(3000, 3010)) + [4000 + i, 4100 + i]) for i in range(5)]
    adm = Admission(max_running=16, kv_budget=1000, min_shared=16)
    for r in qs:
        adm.add(r)
    could = lambda r, n: n >= 120  # noqa: E731  (the hint's 115 tokens: no; the 125 shared: yes)
    assert adm.select(0, _cached([block]), could) == [qs[0]]
    assert adm.select(1, _cached([block, qs[0].prompt]), could) == qs[1:]
