"""Prefill's local page allocator: lowest page first, contiguous runs, strict frees."""
import pytest

from pdserve.engine.page_allocator import PageAllocator


def test_allocates_lowest_first_and_contiguous():
    a = PageAllocator(10)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(4) == [3, 4, 5, 6]
    assert a.num_free == 3


def test_freed_pages_are_reused_lowest_first():
    a = PageAllocator(8)
    first = a.allocate(3)
    second = a.allocate(3)
    assert second == [3, 4, 5]
    a.deallocate(first)
    assert a.num_free == 5
    # freed 0..2 come back before the untouched 6..7, still in a contiguous run
    assert a.allocate(4) == [0, 1, 2, 6]
    a.deallocate([4, 3])
    assert a.allocate(2) == [3, 4]


def test_free_out_of_order_still_gives_a_run():
    a = PageAllocator(6)
    pages = a.allocate(6)
    a.deallocate([pages[4], pages[1], pages[3], pages[2]])
    assert a.allocate(3) == [1, 2, 3]


def test_double_free_raises():
    a = PageAllocator(4)
    pages = a.allocate(2)
    a.deallocate(pages[:1])
    with pytest.raises(ValueError, match="page 0"):
        a.deallocate([0])
    assert a.num_free == 3  # the rejected free changed nothing


def test_free_of_never_allocated_raises():
    a = PageAllocator(4)
    with pytest.raises(ValueError, match="page 3"):
        a.deallocate([3])
    assert a.num_free == 4


def test_can_allocate():
    a = PageAllocator(5)
    assert a.can_allocate(1) and a.can_allocate(5)
    assert not a.can_allocate(6)
    assert not a.can_allocate(0)
    a.allocate(4)
    assert a.can_allocate(1) and not a.can_allocate(2)


def test_exhaustion_message_has_numbers():
    a = PageAllocator(7)
    a.allocate(5)
    with pytest.raises(MemoryError) as e:
        a.allocate(3)
    assert "3 pages requested" in str(e.value)
    assert "2 of 7 free" in str(e.value)
    assert a.num_free == 2  # a refused request takes nothing
    assert a.allocate(2) == [5, 6]


def test_full_cycle_returns_everything():
    a = PageAllocator(16)
    held = [a.allocate(n) for n in (1, 2, 3, 4, 5)]
    assert sorted(p for ps in held for p in ps) == list(range(15))
    for ps in held:
        a.deallocate(ps)
    assert a.num_free == 16
    assert a.allocate(16) == list(range(16))
