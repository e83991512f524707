"""The kernel's process settings: a task's free heap goes back to the system when it ends."""

import ctypes

import psutil
import pytest

from pbg_ray.model.native import _malloc_trim, release_free_heap

BLOCK = 64 << 10  # under glibc's mmap threshold: served from the heap
NUM_BLOCKS = 800


@pytest.mark.skipif(_malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_a_task_hands_back_the_heap_it_freed():
    """The task frees heap blocks below one it keeps (so the heap's top cannot shrink, as
    KERNEL_ENV's trim threshold would not let it): once it returns, their pages are back."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    @release_free_heap
    def task() -> int:
        blocks = [libc.malloc(BLOCK) for _ in range(NUM_BLOCKS)]
        for block in blocks:
            ctypes.memset(block, 1, BLOCK)
        top = libc.malloc(BLOCK)
        for block in blocks:
            libc.free(block)
        return top

    before = psutil.Process().memory_info().rss
    top = task()
    after = psutil.Process().memory_info().rss
    libc.free(top)
    assert after - before < NUM_BLOCKS * BLOCK // 4
