"""The kernel's process settings (a task's free heap goes back to the system once the
process is idle), and which tensors C loops may take by address."""

import ctypes

import psutil
import pytest
import torch

from pbg_ray.model import native
from pbg_ray.model.native import IdleTrim, _malloc_trim, c_ready, release_free_heap

BLOCK = 64 << 10  # under glibc's mmap threshold: served from the heap
NUM_BLOCKS = 800


class ManualTimer:
    """A timer the test fires by hand (IdleTrim's `timer`): started ones are listed."""

    started = []

    def __init__(self, seconds, action):
        self.seconds, self.action, self.cancelled = seconds, action, False
        ManualTimer.started.append(self)

    def cancel(self):
        self.cancelled = True


@pytest.mark.skipif(_malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_an_idle_process_hands_back_the_heap_its_task_freed(monkeypatch):
    """The task frees heap blocks below one it keeps (so the heap's top cannot shrink, as
    KERNEL_ENV's trim threshold would not let it): a trim is then pending for IDLE_TRIM_S
    and the pages stay for a task that follows sooner, which cancels it; once the
    process has been idle that long (the timer fires), their pages are back."""
    ManualTimer.started = []
    monkeypatch.setattr(native, "_IDLE_TRIM", IdleTrim(native.IDLE_TRIM_S, ManualTimer))
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    tops = []

    @release_free_heap
    def task() -> None:
        blocks = [libc.malloc(BLOCK) for _ in range(NUM_BLOCKS)]
        for block in blocks:
            ctypes.memset(block, 1, BLOCK)
        tops.append(libc.malloc(BLOCK))
        for block in blocks:
            libc.free(block)

    rss = psutil.Process().memory_info
    # Free heap pages earlier tests left resident would serve the task without growing
    # the resident set: hand them back first, so the task's pages are its own.
    _malloc_trim()(0)
    before = rss().rss
    task()
    first = ManualTimer.started[-1]
    assert first.seconds == native.IDLE_TRIM_S and not first.cancelled
    kept = rss().rss  # the next task reuses these pages
    task()
    assert first.cancelled and len(ManualTimer.started) == 2
    reused = rss().rss
    ManualTimer.started[-1].action()  # idle for IDLE_TRIM_S
    after = rss().rss
    for top in tops:
        libc.free(top)
    assert kept - before > NUM_BLOCKS * BLOCK // 2
    assert reused - kept < NUM_BLOCKS * BLOCK // 4
    assert after - before < NUM_BLOCKS * BLOCK // 4


def test_c_loops_take_only_contiguous_cpu_tensors_of_their_types():
    floats, longs = torch.zeros(6, 4), torch.zeros(6, dtype=torch.int64)
    assert c_ready((floats, floats[1:3]), (longs,))
    assert c_ready((), ())
    for bad_float in (floats.t(), floats[:, 1], floats.double(), floats.half(),
                      longs.float()[None].expand(2, 6)):
        assert not c_ready((floats, bad_float), (longs,))
    for bad_long in (longs.int(), longs.to(torch.uint8), longs[::2], floats,
                     longs.to(torch.complex64)):
        assert not c_ready((floats,), (bad_long,))
