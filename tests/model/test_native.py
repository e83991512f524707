"""The kernel's process settings: a task's free heap goes back to the system once the
process is idle."""

import ctypes
import time

import psutil
import pytest

from pbg_ray.model import native
from pbg_ray.model.native import _malloc_trim, release_free_heap

BLOCK = 64 << 10  # under glibc's mmap threshold: served from the heap
NUM_BLOCKS = 800


@pytest.mark.skipif(_malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_an_idle_process_hands_back_the_heap_its_task_freed(monkeypatch):
    """The task frees heap blocks below one it keeps (so the heap's top cannot shrink, as
    KERNEL_ENV's trim threshold would not let it): once the process has been idle for
    IDLE_TRIM_S after it, their pages are back; a task that follows sooner finds them."""
    monkeypatch.setattr(native, "IDLE_TRIM_S", 0.3)
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

    rss = psutil.Process().memory_info
    before = rss().rss
    top = task()
    kept = rss().rss  # the next task would reuse these pages
    time.sleep(1.0)
    after = rss().rss
    libc.free(top)
    assert kept - before > NUM_BLOCKS * BLOCK // 2
    assert after - before < NUM_BLOCKS * BLOCK // 4
