import pytest

from jspec.kvcache.allocator import OutOfPagesError, PageAllocator
from jspec.kvcache.pool import check_page_size


def test_alloc_free_roundtrip_and_leak_check():
    a = PageAllocator(10)
    assert a.num_usable == 9 and a.num_free == 9
    p1 = a.alloc(4)
    p2 = a.alloc(5)
    assert PageAllocator.SCRATCH_PAGE not in p1 + p2
    assert len(set(p1 + p2)) == 9
    with pytest.raises(AssertionError, match="leak"):
        a.check_no_leaks()
    a.free(p1)
    a.free(p2)
    a.check_no_leaks()


def test_full_pool_raises_and_allocates_nothing():
    a = PageAllocator(5)
    held = a.alloc(3)
    with pytest.raises(OutOfPagesError, match="asked for 2 pages, 1 of 4 free"):
        a.alloc(2)
    assert a.num_free == 1  # the failed call took nothing
    a.free(held)
    a.check_no_leaks()


def test_refcount_and_double_free():
    a = PageAllocator(4)
    (p,) = a.alloc(1)
    a.retain([p])
    a.free([p])
    assert a.num_free == 2  # still held once
    a.free([p])
    assert a.num_free == 3
    with pytest.raises(ValueError, match="double free"):
        a.free([p])
    with pytest.raises(ValueError):
        a.free([PageAllocator.SCRATCH_PAGE])


@pytest.mark.parametrize("bad", [0, 3, 12, -4])
def test_page_size_must_be_power_of_two(bad):
    with pytest.raises(ValueError, match="power of two"):
        check_page_size(bad)
