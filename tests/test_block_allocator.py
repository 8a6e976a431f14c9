from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sarathi_rt._C import BlockAllocator, OutOfBlocksError


def test_allocate_and_free_round_trip() -> None:
    a = BlockAllocator(8)
    ids = a.allocate(5)
    assert len(set(ids)) == 5 and all(0 <= i < 8 for i in ids)
    assert a.num_free == 3
    a.free(ids)
    assert a.num_free == 8


def test_allocating_too_many_raises_and_allocates_nothing() -> None:
    a = BlockAllocator(4)
    a.allocate(3)
    with pytest.raises(OutOfBlocksError, match="only 1 of 4"):
        a.allocate(2)
    assert a.num_free == 1
    assert isinstance(OutOfBlocksError("x"), MemoryError)


def test_double_free_and_unallocated_raise_without_side_effects() -> None:
    a = BlockAllocator(4)
    ids = a.allocate(2)
    a.free([ids[0]])
    with pytest.raises(ValueError, match="not allocated"):
        a.free([ids[0]])
    with pytest.raises(ValueError, match="freed more times"):
        a.free([ids[1], ids[1]])
    assert a.refcount(ids[1]) == 1
    with pytest.raises(ValueError, match="outside"):
        a.free([17])
    with pytest.raises(ValueError, match="not allocated"):
        a.incref([ids[0]])


def test_shared_block_freed_at_zero() -> None:
    a = BlockAllocator(2)
    (b,) = a.allocate(1)
    a.incref([b])
    a.free([b])
    assert a.num_free == 1 and a.refcount(b) == 1
    a.free([b])
    assert a.num_free == 2 and a.refcount(b) == 0


def test_bad_constructor_and_n() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(-1)
    with pytest.raises(ValueError, match="n must be"):
        BlockAllocator(2).allocate(-1)


ops = st.lists(st.tuples(st.sampled_from(["alloc", "incref", "free"]), st.integers(0, 6), st.integers(0, 10**6)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(0, 12), program=ops)
def test_random_programs_never_leak_or_double_hand_out(num_blocks: int, program: list) -> None:
    a = BlockAllocator(num_blocks)
    held: list[int] = []  # one entry per reference we hold
    for op, n, pick in program:
        if op == "alloc":
            if n > a.num_free:
                with pytest.raises(OutOfBlocksError):
                    a.allocate(n)
                continue
            ids = a.allocate(n)
            assert not set(ids) & set(held), "a block was handed out twice"
            held += ids
        elif held and op == "incref":
            b = held[pick % len(held)]
            a.incref([b])
            held.append(b)
        elif held and op == "free":
            b = held.pop(pick % len(held))
            a.free([b])
        for b in set(held):
            assert a.refcount(b) == held.count(b)
        assert a.num_free == num_blocks - len(set(held))
    a.free(held)
    assert a.num_free == num_blocks


def test_cached_blocks_stay_reusable_until_evicted_oldest_first() -> None:
    a = BlockAllocator(4)
    ids = a.allocate(4)
    a.mark_cached(ids[:3])
    a.free([ids[1], ids[0], ids[2], ids[3]])  # released in this order
    assert (a.num_free, a.num_cached_free) == (4, 3)
    assert all(a.refcount(i) == 0 for i in ids) and a.is_cached(ids[0]) and not a.is_cached(ids[3])
    # the uncached block goes first, then cached ones, least recently released first
    assert a.allocate(1) == [ids[3]]
    assert a.allocate(2) == [ids[1], ids[0]]
    assert not a.is_cached(ids[1]) and a.num_cached_free == 1
    with pytest.raises(OutOfBlocksError):
        a.allocate(2)
    assert a.num_cached_free == 1  # all or nothing: nothing evicted


def test_reuse_revives_a_cached_free_block_and_incref_does_not() -> None:
    a = BlockAllocator(3)
    ids = a.allocate(2)
    a.mark_cached([ids[0]])
    a.free(ids)
    with pytest.raises(ValueError, match="not allocated"):
        a.incref([ids[0]])
    with pytest.raises(ValueError, match="not allocated"):
        a.reuse([ids[1]])  # free, not cached: its contents are gone
    a.reuse([ids[0], ids[0]])
    assert a.refcount(ids[0]) == 2 and a.num_cached_free == 0 and a.num_free == 2
    a.free([ids[0], ids[0]])
    assert a.num_cached_free == 1 and a.is_cached(ids[0])
    with pytest.raises(ValueError, match="not allocated"):
        a.mark_cached([ids[1]])
