"""The kernel's process settings, without torch (Ray's workers start with them):
the environment a kernel process starts with, handing its free heap back when idle,
and the optional C extensions (the kernel's _rows.c, _loss.c, _operators.c, the import's
importer/_key_table.c), each used where it is built, unless the environment variable
PBG_RAY_C_KERNELS is 0, which makes the kernel use its torch code everywhere and the
import pandas' hash table (the same results, slower): to tell whether a crash or a
wrong result comes from the C code. Set it where the train tasks' workers start (before a
local Ray starts, or in the cluster's environment)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib
import os
import threading
import warnings
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:
    from torch import Tensor

C_KERNELS_ENV = "PBG_RAY_C_KERNELS"
# The environment a process running the kernel should start with: large score
# temporaries otherwise go through mmap/munmap every batch and pay page faults
# each time, which with large negative blocks costs as much as the arithmetic. glibc reads
# these at start-up, so they must be set before the process starts.
KERNEL_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 25), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def extension(name: str, package: str = "pbg_ray.model") -> Optional[ModuleType]:
    """The C extension <package>.<name>, or None: turned off, or not built (then one
    warning per process says so, whichever extensions are missing)."""
    if os.environ.get(C_KERNELS_ENV, "1") == "0":
        return None
    try:
        return importlib.import_module(f"{package}.{name}")
    except ImportError:  # the optional extension was not built
        _warn_not_built()
        return None


@functools.lru_cache(maxsize=None)
def _warn_not_built() -> None:
    warnings.warn(
        "pbg_ray's C loops (pbg_ray/*/_*.c) are not built, as where pbg_ray was installed "
        "without a C compiler: the CPU kernel runs torch ops instead, and the import pandas' "
        "hash table (the same results, slower). Install a C compiler (gcc) and reinstall "
        "pbg_ray to build them.",
        RuntimeWarning, stacklevel=3)


def c_ready(floats: Sequence["Tensor"], longs: Sequence["Tensor"] = ()) -> bool:
    """Whether C loops can take these tensors by address: all of them contiguous on the
    CPU, `floats` float32 and `longs` int64 (told by their attributes: no torch import).
    Plain loops over cheap attributes: the kernel asks this of some twenty tensors a
    batch, holding the GIL that its other Hogwild threads wait for."""
    for t in floats:
        d = t.dtype
        if not (t.is_cpu and d.is_floating_point and d.itemsize == 4 and t.is_contiguous()):
            return False
    for t in longs:
        d = t.dtype
        if not (t.is_cpu and d.itemsize == 8 and d.is_signed
                and not (d.is_floating_point or d.is_complex) and t.is_contiguous()):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return getattr(libc, "malloc_trim", None)


# How long a worker stays idle after a kernel task before it hands its free heap back: a
# task that follows at once (a trainer's next bucket) reuses the pages instead, which it
# would otherwise fault in again.
IDLE_TRIM_S = 1.0


def _daemon_timer(seconds: float, action: Callable[[], Any]) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()
    return timer


class IdleTrim:
    """This process's pending hand-back of its free heap (glibc's malloc_trim), one at a
    time: `schedule` starts it, to run once the process has been idle for `idle_s`;
    `cancel` drops it (a task came sooner). `timer(seconds, action)` starts what runs
    `action` after that long and has cancel(): a daemon threading.Timer (tests pass
    one they fire themselves)."""

    def __init__(self, idle_s: float,
                 timer: Callable[[float, Callable[[], Any]], Any] = _daemon_timer) -> None:
        self.idle_s = idle_s
        self.timer = timer
        self._lock = threading.Lock()
        self._pending: Optional[Any] = None

    def __reduce__(self) -> Any:
        """Ray ships a task's function by value with the globals it names: a worker gets
        its own process's IdleTrim, not a copy (timers and locks don't pickle)."""
        return _process_idle_trim, ()

    def cancel(self) -> None:
        with self._lock:
            if self._pending is not None:
                self._pending.cancel()
                self._pending = None

    def schedule(self) -> None:
        trim = _malloc_trim()
        if trim is None:
            return
        with self._lock:
            if self._pending is not None:
                self._pending.cancel()
            self._pending = self.timer(self.idle_s, lambda: trim(0))


_IDLE_TRIM = IdleTrim(IDLE_TRIM_S)


def _process_idle_trim() -> IdleTrim:
    return _IDLE_TRIM


def release_free_heap(task: Callable[..., Any]) -> Callable[..., Any]:
    """`task`; then, once the process has run no such task for IDLE_TRIM_S, its free heap
    pages handed back to the system (glibc's malloc_trim): KERNEL_ENV keeps what a
    bucket's batches free for the next batch, which is what a bucket needs, and an idle
    worker would hold its tasks' high-water mark for good."""

    @functools.wraps(task)
    def run(*args: Any, **kwargs: Any) -> Any:
        _IDLE_TRIM.cancel()
        try:
            return task(*args, **kwargs)
        finally:
            _IDLE_TRIM.schedule()
    return run
