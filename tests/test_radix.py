"""Unit tests for radix.RadixTree / radix.NullRadixTree (pure bookkeeping, no torch)."""

from __future__ import annotations

import numpy as np
import pytest
from radix_support import depth_at, trim_candidates

from radix import InsertResult, MatchResult, NullRadixTree, PrefixIndex, RadixTree


def slots(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def freed_set(arrays: list[np.ndarray]) -> list[int]:
    return sorted(np.concatenate(arrays).tolist()) if arrays else []


def node_lens(tree: RadixTree) -> list[list[int]]:
    """Token ids of every node, sorted (shape of the tree, independent of dict order)."""
    return sorted(n.key.tolist() for n in tree.iter_nodes())


@pytest.fixture
def tree() -> RadixTree:
    return RadixTree()


# ---------------------------------------------------------------- match / split


def test_empty_tree_match_is_root(tree: RadixTree) -> None:
    m = tree.match_prefix([1, 2, 3])
    assert m.length == 0
    assert m.handle is tree._root
    assert m.values.dtype == np.int64 and m.values.size == 0
    assert m.segments == ()
    assert depth_at(m, 0) == 0


def test_full_match_returns_inserted_slots(tree: RadixTree) -> None:
    tree.insert([5, 6, 7], slots(10, 11, 12), depth=3)
    m = tree.match_prefix([5, 6, 7, 8, 9])
    assert m.length == 3
    assert m.values.tolist() == [10, 11, 12]
    assert m.segments == ((3, 3),)
    tree.check_integrity()


def test_split_on_partial_match(tree: RadixTree) -> None:
    ins = tree.insert([1, 2, 3, 4], slots(10, 11, 12, 13), depth=2)
    assert tree.num_nodes() == 1
    m = tree.match_prefix([1, 2, 9])
    assert m.length == 2
    assert m.values.tolist() == [10, 11]
    # The node was split so the handle ends exactly at the matched length.
    assert tree.num_nodes() == 2
    assert m.handle.key.tolist() == [1, 2]
    assert node_lens(tree) == [[1, 2], [3, 4]]
    # The old handle survives the split and still ends at length 4.
    assert ins.handle.alive and ins.handle.key.tolist() == [3, 4]
    assert ins.handle.parent is m.handle
    assert tree.total_size() == 4
    tree.check_integrity()


def test_match_of_query_shorter_than_node_splits(tree: RadixTree) -> None:
    tree.insert([1, 2, 3, 4], slots(10, 11, 12, 13), depth=2)
    m = tree.match_prefix([1, 2, 3])
    assert m.length == 3 and m.handle.key.tolist() == [1, 2, 3]
    assert node_lens(tree) == [[1, 2, 3], [4]]
    tree.check_integrity()


def test_no_match_at_first_token_gives_root(tree: RadixTree) -> None:
    tree.insert([1, 2], slots(10, 11), depth=1)
    m = tree.match_prefix([2, 1])
    assert m.length == 0 and m.handle is tree._root
    assert tree.num_nodes() == 1  # no spurious split


def test_match_updates_lru_time(tree: RadixTree) -> None:
    a = tree.insert([1, 2], slots(0, 1), depth=1).handle
    b = tree.insert([3, 4], slots(2, 3), depth=1).handle
    assert a.last_access < b.last_access
    tree.match_prefix([1, 2])
    assert a.last_access > b.last_access


# ---------------------------------------------------------------- insert


def test_insert_new_returns_everything_taken(tree: RadixTree) -> None:
    r = tree.insert([1, 2, 3], slots(7, 8, 9), depth=4)
    assert isinstance(r, InsertResult)
    assert r.prefix_len == 0
    assert r.taken.tolist() == [True, True, True]
    assert r.to_free == []
    assert tree.total_size() == 3 and tree.total_layer_tokens() == 12
    tree.check_integrity()


def test_insert_overlapping_keeps_existing_slots(tree: RadixTree) -> None:
    tree.insert([1, 2, 3], slots(10, 11, 12), depth=4)
    r = tree.insert([1, 2, 3, 4, 5], slots(20, 21, 22, 23, 24), depth=4)
    assert r.prefix_len == 3
    assert r.taken.tolist() == [False, False, False, True, True]
    assert freed_set(r.to_free) == [20, 21, 22]
    m = tree.match_prefix([1, 2, 3, 4, 5])
    assert m.values.tolist() == [10, 11, 12, 23, 24]
    assert r.handle is m.handle
    assert tree.total_size() == 5
    tree.check_integrity()


def test_insert_prefix_of_existing_splits_and_returns_handle(tree: RadixTree) -> None:
    tree.insert([1, 2, 3, 4], slots(10, 11, 12, 13), depth=2)
    r = tree.insert([1, 2], slots(20, 21), depth=2)
    assert r.prefix_len == 2
    assert r.handle.key.tolist() == [1, 2]
    assert freed_set(r.to_free) == [20, 21]
    assert tree.total_size() == 4
    tree.check_integrity()


def test_insert_lower_depth_does_not_downgrade(tree: RadixTree) -> None:
    tree.insert([1, 2], slots(10, 11), depth=6)
    r = tree.insert([1, 2], slots(20, 21), depth=3)
    assert not r.taken.any()
    assert freed_set(r.to_free) == [20, 21]
    assert tree.match_prefix([1, 2]).segments == ((2, 6),)


def test_branching(tree: RadixTree) -> None:
    tree.insert([1, 2, 3, 4], slots(0, 1, 2, 3), depth=2)
    r = tree.insert([1, 2, 7, 8], slots(10, 11, 12, 13), depth=2)
    assert r.prefix_len == 2
    assert freed_set(r.to_free) == [10, 11]
    assert node_lens(tree) == [[1, 2], [3, 4], [7, 8]]
    assert tree.match_prefix([1, 2, 3, 4]).values.tolist() == [0, 1, 2, 3]
    assert tree.match_prefix([1, 2, 7, 8]).values.tolist() == [0, 1, 12, 13]
    assert tree.match_prefix([1, 2, 5]).length == 2
    assert tree.total_size() == 6
    tree.check_integrity()


def test_insert_does_not_alias_caller_buffer(tree: RadixTree) -> None:
    buf = slots(1, 2, 3)
    tree.insert([4, 5, 6], buf, depth=1)
    buf[:] = 99
    assert tree.match_prefix([4, 5, 6]).values.tolist() == [1, 2, 3]


def test_insert_validates_arguments(tree: RadixTree) -> None:
    with pytest.raises(ValueError):
        tree.insert([1, 2], slots(1), depth=1)
    with pytest.raises(ValueError):
        tree.insert([1, 2], slots(1, 2), depth=-1)
    with pytest.raises(ValueError):
        tree.insert([1, 2], np.array([1.0, 2.0]), depth=1)
    assert tree.total_size() == 0


def test_insert_empty_is_noop(tree: RadixTree) -> None:
    r = tree.insert([], slots(), depth=3)
    assert r.prefix_len == 0 and r.handle is tree._root and r.to_free == []
    assert tree.total_size() == 0


def test_insert_on_locked_path_works(tree: RadixTree) -> None:
    h = tree.insert([1, 2, 3], slots(0, 1, 2), depth=2).handle
    tree.lock(h)
    r = tree.insert([1, 2, 3, 4, 5], slots(10, 11, 12, 13, 14), depth=2)
    assert r.taken.tolist() == [False, False, False, True, True]
    # The new tokens are not locked; the old ones stay locked.
    assert tree.protected_size() == 3 and tree.evictable_size() == 2
    assert freed_set(tree.evict(100)) == [13, 14]
    tree.check_integrity()


def test_insert_passing_tree_owned_slots_is_not_freed(tree: RadixTree) -> None:
    """The engine may pass match.values + fresh slots: the tree's own slots must not be freed."""
    tree.insert([1, 2, 3], slots(0, 1, 2), depth=2)
    m = tree.match_prefix([1, 2, 3, 4])
    r = tree.insert([1, 2, 3, 4], np.concatenate([m.values, slots(9)]), depth=2)
    assert r.taken.tolist() == [True, True, True, True]
    assert r.to_free == []
    assert sorted(tree.all_values().tolist()) == [0, 1, 2, 9]
    tree.check_integrity()


# ---------------------------------------------------------------- depth


def test_segments_and_depth_at(tree: RadixTree) -> None:
    tree.insert([1, 2, 3], slots(0, 1, 2), depth=8)
    tree.insert([1, 2, 3, 4, 5], slots(10, 11, 12, 3, 4), depth=8)
    h = tree.match_prefix([1, 2, 3, 4, 5]).handle
    tree.set_depth(h, 3)
    tree.insert([1, 2, 3, 4, 5, 6, 7], slots(20, 21, 22, 23, 24, 5, 6), depth=2)
    m = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert isinstance(m, MatchResult)
    assert m.length == 7
    assert m.segments == ((3, 8), (5, 3), (7, 2))
    assert m.values.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert [depth_at(m, p) for p in range(8)] == [0, 8, 8, 8, 3, 3, 2, 2]
    with pytest.raises(ValueError):
        depth_at(m, 8)
    with pytest.raises(ValueError):
        depth_at(m, -1)


def test_depth_at_takes_minimum_not_last() -> None:
    m = MatchResult(length=6, handle=None, values=slots(0, 1, 2, 3, 4, 5),  # type: ignore[arg-type]
                    segments=((2, 4), (4, 1), (6, 9)))
    assert depth_at(m, 2) == 4
    assert depth_at(m, 3) == 1
    assert depth_at(m, 6) == 1


def test_insert_never_upgrades_set_depth_does(tree: RadixTree) -> None:
    """One way to upgrade a node: an insert over a shallower node keeps its slots and depth (the
    caller's differing slots come back), set_depth raises it."""
    tree.insert([1, 2, 3, 4], slots(0, 1, 2, 3), depth=2)
    r = tree.insert([1, 2, 3, 4, 5], slots(10, 11, 12, 13, 14), depth=6)
    assert r.prefix_len == 4
    assert r.taken.tolist() == [False, False, False, False, True]
    assert freed_set(r.to_free) == [10, 11, 12, 13]
    m = tree.match_prefix([1, 2, 3, 4, 5])
    assert m.values.tolist() == [0, 1, 2, 3, 14]
    assert m.segments == ((4, 2), (5, 6))
    tree.set_depth(tree.match_prefix([1, 2, 3, 4]).handle, 6)
    assert tree.match_prefix([1, 2, 3, 4, 5]).segments == ((4, 6), (5, 6))
    assert tree.total_layer_tokens() == 5 * 6
    assert tree.depth_histogram() == {6: 5}
    tree.check_integrity()


def test_set_depth_of_a_split_part_only_changes_that_part(tree: RadixTree) -> None:
    tree.insert([1, 2, 3, 4], slots(0, 1, 2, 3), depth=2)
    r = tree.insert([1, 2, 9], slots(10, 11, 12), depth=5)
    assert freed_set(r.to_free) == [10, 11]
    tree.set_depth(tree.match_prefix([1, 2]).handle, 5)
    m = tree.match_prefix([1, 2, 3, 4])
    assert m.values.tolist() == [0, 1, 2, 3]
    assert m.segments == ((2, 5), (4, 2))
    assert tree.total_layer_tokens() == 2 * 5 + 2 * 2 + 1 * 5
    assert tree.depth_histogram() == {2: 2, 5: 3}
    tree.check_integrity()


def test_depth_upgrade_of_locked_node_allowed(tree: RadixTree) -> None:
    h = tree.insert([1, 2], slots(0, 1), depth=1).handle
    tree.lock(h)
    tree.set_depth(h, 4)
    assert h.depth == 4 and tree.total_layer_tokens() == 8
    assert tree.protected_size() == 2
    tree.unlock(h)
    tree.check_integrity()


def test_insert_of_held_slots_frees_nothing_and_keeps_depth(tree: RadixTree) -> None:
    tree.insert([1, 2, 3], slots(0, 1, 2), depth=2)
    r = tree.insert([1, 2, 3], slots(0, 1, 2), depth=5)
    assert r.taken.all() and r.to_free == []
    assert tree.match_prefix([1, 2, 3]).segments == ((3, 2),)


def test_set_depth_lowers_and_raises(tree: RadixTree) -> None:
    h = tree.insert([1, 2, 3], slots(0, 1, 2), depth=6).handle
    tree.set_depth(h, 2)
    assert tree.total_layer_tokens() == 6
    assert depth_at(tree.match_prefix([1, 2, 3]), 3) == 2
    tree.set_depth(h, 0)
    assert tree.total_layer_tokens() == 0
    assert tree.total_size() == 3  # slots still held
    with pytest.raises(ValueError):
        tree.set_depth(h, -1)
    with pytest.raises(TypeError):
        tree.set_depth(h, 1.5)  # type: ignore[arg-type]
    tree.set_depth(h, 3)
    assert tree.total_layer_tokens() == 9 and tree.depth_histogram() == {3: 3}
    tree.check_integrity()


def test_trim_locked_node_raises(tree: RadixTree) -> None:
    h = tree.insert([1, 2, 3], slots(0, 1, 2), depth=6).handle
    parent = tree.match_prefix([1]).handle
    tree.lock(h)
    with pytest.raises(RuntimeError):
        tree.set_depth(h, 2)
    with pytest.raises(RuntimeError):  # locked through its descendant
        tree.set_depth(parent, 2)
    assert tree.total_layer_tokens() == 18
    tree.unlock(h)
    tree.set_depth(h, 2)
    assert h.depth == 2


def test_trim_candidates_lru_order_in_passes(tree: RadixTree) -> None:
    """Unlocked nodes deeper than the floor, coldest first; a node left deep comes again in the
    next pass, after every other; locked and shallow nodes never come."""
    a = tree.insert([1], slots(0), depth=8).handle
    b = tree.insert([2], slots(1), depth=8).handle
    c = tree.insert([3], slots(2), depth=1).handle  # at the floor
    d = tree.insert([4], slots(3), depth=8).handle
    tree.lock(d)
    seen = []
    for node in trim_candidates(tree, 1):
        seen.append(node)
        tree.set_depth(node, max(1, node.depth // 2))
    assert seen == [a, b, a, b, a, b]  # 8 -> 4 -> 2 -> 1, one halving per pass
    assert (a.depth, b.depth, c.depth, d.depth) == (1, 1, 1, 8)
    assert list(trim_candidates(tree, 1)) == []
    tree.unlock(d)
    tree.set_depth(a, 4)  # raised again: a candidate again
    tree.match_prefix([1])  # a is now the most recent
    from contextlib import closing
    from itertools import islice
    with closing(trim_candidates(tree, 1)) as it:
        assert list(islice(it, 4)) == [d, a, d, a]  # left deep: every pass again
    tree.check_integrity()


def test_trim_candidates_stopped_early_keeps_every_candidate(tree: RadixTree) -> None:
    from contextlib import closing
    nodes = [tree.insert([i], slots(i), depth=4).handle for i in range(5)]
    with closing(trim_candidates(tree, 1)) as it:
        first = next(it)
        tree.set_depth(first, 2)
    assert first is nodes[0]
    tree.check_integrity()  # the trim heap still has a live entry for every candidate
    order = []
    with closing(trim_candidates(tree, 1)) as it:
        for node in it:
            order.append(node)
            if len(order) == 5:
                break
    assert order == nodes  # LRU order (ties: creation order), the stopped one included
    from itertools import islice
    with closing(trim_candidates(tree, 0)) as it:  # a lower floor rebuilds the heap
        assert list(islice(it, 5)) == nodes
    tree.check_integrity()


# ---------------------------------------------------------------- locks


def test_lock_protects_from_eviction(tree: RadixTree) -> None:
    a = tree.insert([1, 2, 3], slots(0, 1, 2), depth=1).handle
    tree.insert([7, 8], slots(3, 4), depth=1)
    tree.lock(a)
    assert tree.protected_size() == 3 and tree.evictable_size() == 2
    assert freed_set(tree.evict(100)) == [3, 4]
    assert tree.total_size() == 3
    assert tree.match_prefix([1, 2, 3]).length == 3
    tree.unlock(a)
    assert tree.protected_size() == 0 and tree.evictable_size() == 3
    assert freed_set(tree.evict(100)) == [0, 1, 2]
    assert tree.total_size() == 0
    tree.check_integrity()


def test_lock_covers_ancestors_only(tree: RadixTree) -> None:
    tree.insert([1, 2, 3, 4], slots(0, 1, 2, 3), depth=1)
    h = tree.match_prefix([1, 2]).handle
    tree.lock(h)
    assert tree.protected_size() == 2 and tree.evictable_size() == 2
    assert freed_set(tree.evict(100)) == [2, 3]  # the child below the lock goes
    tree.check_integrity()


def test_nested_locks(tree: RadixTree) -> None:
    h = tree.insert([1, 2], slots(0, 1), depth=1).handle
    tree.lock(h)
    tree.lock(h)
    tree.unlock(h)
    assert tree.evict(10) == []
    tree.unlock(h)
    assert freed_set(tree.evict(10)) == [0, 1]


def test_unlock_below_zero_raises(tree: RadixTree) -> None:
    h = tree.insert([1, 2], slots(0, 1), depth=1).handle
    with pytest.raises(RuntimeError):
        tree.unlock(h)
    tree.lock(h)
    tree.unlock(h)
    with pytest.raises(RuntimeError):
        tree.unlock(h)
    assert h.lock_ref == 0 and tree.evictable_size() == 2
    tree.check_integrity()


def test_split_of_locked_node_keeps_lock(tree: RadixTree) -> None:
    h = tree.insert([1, 2, 3, 4], slots(0, 1, 2, 3), depth=1).handle
    tree.lock(h)
    upper = tree.match_prefix([1, 2, 9]).handle
    assert upper.lock_ref == 1
    tree.unlock(h)
    assert upper.lock_ref == 0 and tree.protected_size() == 0
    tree.check_integrity()


def test_root_lock_is_noop(tree: RadixTree) -> None:
    root = tree.match_prefix([1]).handle
    tree.lock(root)
    tree.unlock(root)
    tree.unlock(root)
    assert tree.protected_size() == 0
    tree.check_integrity()


def test_dead_and_foreign_handles_rejected(tree: RadixTree) -> None:
    h = tree.insert([1, 2], slots(0, 1), depth=1).handle
    tree.evict(10)
    with pytest.raises(ValueError):
        tree.lock(h)
    other = RadixTree().insert([1], slots(0), depth=1).handle
    with pytest.raises(ValueError):
        tree.lock(other)
    with pytest.raises(ValueError):
        tree.set_depth(other, 0)


# ---------------------------------------------------------------- eviction


def test_eviction_lru_order(tree: RadixTree) -> None:
    tree.insert([1], slots(1), depth=1)
    tree.insert([2], slots(2), depth=1)
    tree.insert([3], slots(3), depth=1)
    tree.match_prefix([1])  # 1 is now the most recent; 2 the least
    assert freed_set(tree.evict(1)) == [2]
    assert freed_set(tree.evict(1)) == [3]
    assert freed_set(tree.evict(1)) == [1]
    assert tree.evict(1) == []


def test_eviction_order_exact(tree: RadixTree) -> None:
    for i in range(5):
        tree.insert([i, 100 + i], slots(2 * i, 2 * i + 1), depth=1)
    for i in (3, 0, 4):
        tree.match_prefix([i, 100 + i])
    freed = tree.evict(10)
    order = [int(a[0]) // 2 for a in freed]
    assert order == [1, 2, 3, 0, 4]


def test_evict_stops_at_target(tree: RadixTree) -> None:
    tree.insert([1, 1, 1], slots(0, 1, 2), depth=1)
    tree.insert([2, 2, 2], slots(3, 4, 5), depth=1)
    tree.insert([3, 3, 3], slots(6, 7, 8), depth=1)
    freed = tree.evict(4)
    assert freed_set(freed) == [0, 1, 2, 3, 4, 5]  # two leaves of 3 tokens, not three
    assert tree.total_size() == 3
    assert tree.evict(0) == []


def test_parent_becomes_leaf_and_is_evicted(tree: RadixTree) -> None:
    tree.insert([1, 2, 3], slots(0, 1, 2), depth=1)
    tree.insert([1, 2, 4], slots(8, 9, 3), depth=1)  # shares [1, 2]
    tree.insert([5], slots(4), depth=1)
    # Order of recency: [1,2,3] < [1,2,4] == [1,2] < [5]
    freed = tree.evict(4)
    assert [a.tolist() for a in freed] == [[2], [3], [0, 1]]
    assert tree.total_size() == 1
    tree.check_integrity()


def test_freed_slots_are_exactly_what_was_inserted(tree: RadixTree) -> None:
    rng = np.random.default_rng(0)
    given: list[int] = []
    returned: list[int] = []
    next_slot = 0
    for _ in range(50):
        ids = rng.integers(0, 4, size=int(rng.integers(1, 8))).tolist()
        vals = np.arange(next_slot, next_slot + len(ids), dtype=np.int64)
        next_slot += len(ids)
        given += vals.tolist()
        r = tree.insert(ids, vals, depth=int(rng.integers(0, 5)))
        returned += freed_set(r.to_free)
        tree.check_integrity()
    returned += freed_set(tree.evict(10**9))
    assert tree.total_size() == 0
    assert sorted(returned) == sorted(given)
    tree.check_integrity()


def test_heap_stays_bounded(tree: RadixTree) -> None:
    tree.insert([1, 2], slots(0, 1), depth=1)
    for _ in range(1000):
        tree.match_prefix([1, 2])
    assert len(tree._heap) <= 2 * tree.num_nodes() + 65
    tree.check_integrity()
    assert freed_set(tree.evict(1)) == [0, 1]


# ---------------------------------------------------------------- sizes / reset / debug


def test_sizes_and_all_values(tree: RadixTree) -> None:
    tree.insert([1, 2, 3], slots(0, 1, 2), depth=2)
    h = tree.insert([1, 2, 4, 5], slots(7, 7, 3, 4), depth=2).handle
    tree.lock(h)
    assert tree.total_size() == 5
    assert tree.protected_size() == 4  # [1, 2] + [4, 5]
    assert tree.evictable_size() == 1
    assert tree.total_layer_tokens() == 10
    assert sorted(tree.all_values().tolist()) == [0, 1, 2, 3, 4]
    assert tree.all_values().dtype == np.int64


def test_reset(tree: RadixTree) -> None:
    h = tree.insert([1, 2, 3], slots(0, 1, 2), depth=2).handle
    tree.insert([4], slots(3), depth=2)
    tree.lock(h)
    with pytest.raises(RuntimeError):
        tree.reset()
    assert tree.total_size() == 4
    tree.unlock(h)
    assert freed_set(tree.reset()) == [0, 1, 2, 3]
    assert tree.total_size() == tree.evictable_size() == tree.total_layer_tokens() == 0
    assert tree.all_values().size == 0
    assert not h.alive
    with pytest.raises(ValueError):
        tree.lock(h)
    assert tree.match_prefix([1, 2, 3]).length == 0
    tree.insert([1], slots(0), depth=1)  # usable again
    tree.check_integrity()


def test_check_integrity_detects_corruption(tree: RadixTree) -> None:
    h = tree.insert([1, 2], slots(0, 1), depth=1).handle
    tree.insert([3], slots(2), depth=1)
    tree.check_integrity()
    h.lock_ref = 1  # bypassing lock(): counters now disagree
    with pytest.raises(AssertionError, match="evictable counter"):
        tree.check_integrity()
    h.lock_ref = 0
    h.value = slots(2, 5)  # slot 2 now held twice
    with pytest.raises(AssertionError, match="unique slots"):
        tree.check_integrity()
    h.value = slots(0, 1)
    tree._heap.clear()  # an evictable leaf would never be evicted
    with pytest.raises(AssertionError, match="eviction heap"):
        tree.check_integrity()


def test_pretty_lists_nodes(tree: RadixTree) -> None:
    tree.insert([1, 2, 3], slots(0, 1, 2), depth=2)
    tree.match_prefix([1, 9])
    out = tree.pretty()
    assert "ids=[1]" in out and "ids=[2, 3]" in out and "depth=2" in out


# ---------------------------------------------------------------- NullRadixTree


def test_null_tree() -> None:
    t = NullRadixTree()
    assert isinstance(t, PrefixIndex) and isinstance(RadixTree(), PrefixIndex)
    r = t.insert([1, 2, 3], slots(4, 5, 6), depth=3)
    assert r.prefix_len == 0
    assert not r.taken.any() and len(r.taken) == 3
    assert freed_set(r.to_free) == [4, 5, 6]
    m = t.match_prefix([1, 2, 3])
    assert m.length == 0 and m.values.size == 0 and m.segments == () and depth_at(m, 0) == 0
    t.lock(m.handle)
    t.unlock(m.handle)
    t.set_depth(m.handle, 0)
    assert list(trim_candidates(t, 1)) == [] and t.caches is False and RadixTree().caches
    assert t.evict(100) == []
    assert (t.evictable_size(), t.protected_size(), t.total_size(),
            t.total_layer_tokens()) == (0, 0, 0, 0)
    assert t.all_values().size == 0
    t.check_integrity()
    with pytest.raises(ValueError):
        t.insert([1, 2], slots(1), depth=1)
    with pytest.raises(ValueError):
        t.lock(RadixTree().insert([1], slots(0), depth=1).handle)


def test_peek_prefix_len_changes_nothing():
    """The scheduler peeks at every waiting request on every step: a peek must not split nodes
    or refresh LRU times (so it cannot change which prefix is evicted next)."""
    t = RadixTree()
    t.insert([1, 2, 3, 4], np.arange(4), 2)
    t.insert([9, 9], np.arange(4, 6), 2)
    before = (t.num_nodes(), t.pretty(), t._clock)
    assert t.peek_prefix_len([1, 2, 7]) == 2  # partial match inside a node: no split
    assert t.peek_prefix_len([1, 2, 3, 4, 5]) == 4
    assert t.peek_prefix_len([5]) == 0
    assert (t.num_nodes(), t.pretty(), t._clock) == before
    assert t.match_prefix([1, 2, 7]).length == 2 and t.num_nodes() == before[0] + 1  # a real match splits
    assert NullRadixTree().peek_prefix_len([1, 2]) == 0


def _halve_by_candidates(tree: RadixTree, min_depth: int, need: int) -> tuple[list, list, int]:
    """The reference: trim_candidates + set_depth per node, as the cache manager did."""
    from contextlib import closing
    nodes, kept, dropped = [], [], 0
    if need <= 0:
        return nodes, kept, dropped
    with closing(trim_candidates(tree, min_depth)) as it:
        for node in it:
            new = max(min_depth, node.depth // 2)
            dropped += len(node.value) * (node.depth - new)
            tree.set_depth(node, new)
            nodes.append(node)
            kept.append(new)
            if dropped >= need:
                break
    return nodes, kept, dropped


def _twin_random_trees(rng, max_inserts: int, max_len: int, locks_and_probes: bool = False):
    """Two radix trees built by the same random inserts (tokens 0-3, depths 0-8, fresh slots);
    with ``locks_and_probes`` some inserts are locked (their handles returned per tree) and some
    are followed by a probe match (splits, fresh LRU times)."""
    import numpy as np
    trees = [RadixTree(), RadixTree()]
    handles: list[list] = [[], []]
    next_slot = 0
    for _ in range(int(rng.integers(5, max_inserts))):
        ids = rng.integers(0, 4, int(rng.integers(1, max_len)))
        depth = int(rng.integers(0, 9))
        vals = np.arange(next_slot, next_slot + len(ids))
        next_slot += len(ids)
        lock = locks_and_probes and rng.random() < 0.2
        for t, h in zip(trees, handles):
            res = t.insert(ids, vals, depth)
            if lock:
                t.lock(res.handle)
                h.append(res.handle)
        if locks_and_probes and rng.random() < 0.3:
            probe = rng.integers(0, 4, 5)
            for t in trees:
                t.match_prefix(probe)
    return trees, handles


def test_halve_cold_is_trim_candidates_with_set_depth() -> None:
    """The one-loop trim makes the same choices in the same order as the generator + set_depth
    per node, leaves the same depths, counters and heaps (a second trim agrees too)."""
    import numpy as np
    for seed in range(30):
        rng = np.random.default_rng(seed)
        trees, handles = _twin_random_trees(rng, max_inserts=40, max_len=12, locks_and_probes=True)
        for t, h in zip(trees, handles):  # unlock some: those nodes are pushed back
            for handle in h[: len(h) // 2]:
                t.unlock(handle)
        for need in (int(rng.integers(1, 60)), int(rng.integers(1, 400))):
            floor = int(rng.integers(1, 3))
            ref = _halve_by_candidates(trees[0], floor, need)
            got = trees[1].halve_cold(floor, need)
            assert [n.serial for n in got[0]] == [n.serial for n in ref[0]], seed
            assert got[1] == ref[1] and got[2] == ref[2], seed
            assert trees[0].depth_histogram() == trees[1].depth_histogram()
            assert trees[0].total_layer_tokens() == trees[1].total_layer_tokens()
            for t in trees:
                t.check_integrity()


def test_evict_by_layer_tokens_is_leaf_by_leaf_eviction() -> None:
    """``evict(tokens, layer_tokens)`` frees the leaves a leaf-by-leaf loop counting ``len *
    depth`` frees until both targets are met, in the same LRU order, and no more."""
    import numpy as np
    for seed in range(30):
        rng = np.random.default_rng(seed)
        trees, _ = _twin_random_trees(rng, max_inserts=30, max_len=10)
        want_tokens, want_layers = int(rng.integers(0, 40)), int(rng.integers(0, 200))
        ref, got_t, got_l = [], 0, 0
        depth_of = {int(n.value[0]): n.depth for n in trees[0].iter_nodes()}
        while (got_t < want_tokens or got_l < want_layers) and trees[0].evictable_size() > 0:
            for arr in trees[0].evict(1):
                ref.append(arr)
                got_t += len(arr)
                got_l += len(arr) * depth_of[int(arr[0])]
        got = trees[1].evict(want_tokens, want_layers)
        assert [a.tolist() for a in got] == [a.tolist() for a in ref], seed
        assert trees[0].total_size() == trees[1].total_size()
        trees[1].check_integrity()
    assert RadixTree().evict(0, 0) == [] and NullRadixTree().evict(3, 5) == []


def test_prefix_indexes_are_chosen_by_name() -> None:
    """The cache manager's index comes from the registry by name; an unknown name lists the known."""
    from radix import INDEXES, make_index

    assert isinstance(make_index("radix"), RadixTree) and isinstance(make_index("none"), NullRadixTree)
    assert make_index("radix") is not make_index("radix")  # a fresh, empty index each time
    assert all(issubclass(cls, PrefixIndex) for cls in INDEXES.values())
    with pytest.raises(ValueError, match="known: none, radix"):
        make_index("lfu")


def test_eviction_order_is_given_to_the_tree() -> None:
    """The tree evicts and trims in the order it is given: LRU by default, here the most recently
    used first, with every invariant (heap liveness included) holding under the other order."""
    from radix import EvictionOrder

    class MostRecentFirst(EvictionOrder):
        name = "mru"

        def key(self, node) -> int:
            return 1_000_000 - node.last_access

    for order, evicted, survivor in ((None, [[0, 1]], [3, 4]), (MostRecentFirst(), [[2, 3]], [1, 2])):
        t = RadixTree(order)
        t.insert([1, 2], slots(0, 1), 2)
        t.insert([3, 4], slots(2, 3), 2)  # the more recent one
        t.check_integrity()
        assert [v.tolist() for v in t.evict(2)] == evicted
        t.check_integrity()
        assert t.match_prefix(survivor).length == 2
        nodes, _, _ = t.halve_cold(0, 1)
        assert len(nodes) == 1
        t.check_integrity()
