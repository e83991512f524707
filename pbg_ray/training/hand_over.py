"""A partition held by a train task's worker for the trainer's next task, unwritten, and
written only if no task takes it (disk placement): the write-behind's hand-over."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable, Optional

# How long a partition held for a later task of the trainer (HandOver) waits for a task
# of this worker to take it before it is written anyway, and how often it looks whether
# a reader elsewhere asks for it (each look takes the GIL from the kernel's threads: see
# docs/benchmarks-log.md, disk placement).
HAND_OVER_WAIT_S = 2.0
HAND_OVER_POLL_S = 0.05


class HandOver:
    """The write of a partition held for a later task of the trainer, which trains it on
    from this worker's buffer: that task's lease names this one's swap file as its
    source, and its own result replaces it, so the file is written only if no task takes
    the partition here: when a reader elsewhere asks for it (Ray ran that task on another
    worker, see partitions.asked_marker), when the buffer drops it, when the trainer's
    pass ends, or after HAND_OVER_WAIT_S (no task came). Until then the file's marker
    says "pending" (see SwapFile.begin_write): a reader elsewhere asks and waits, and
    learns of this worker's death (WriterDied: the pass is trained again).

    Stands where PartitionBuffer keeps a write's Future: `done` and `result` (which
    begins the write if it has not begun). `begin` begins the write, returning its
    Future; `asked` says whether a reader asks for it; `clock` measures the wait;
    `on_late` runs when the wait runs out and begins the write (no task came in time:
    the partition is written here and again when the buffer drops it)."""

    def __init__(self, begin: Callable[[], Future], asked: Callable[[], bool],
                 clock: Callable[[], float], on_late: Callable[[], None]) -> None:
        self.lock = threading.Lock()
        self.begin = begin
        self.on_late = on_late
        self.pending: Optional[Future] = None  # the write, once begun
        self.taken = False
        self.settled = threading.Event()  # taken, or the write begun
        deadline = clock() + HAND_OVER_WAIT_S
        threading.Thread(target=self._watch, args=(asked, clock, deadline), daemon=True,
                         name="hand-over").start()

    def _watch(self, asked: Callable[[], bool], clock: Callable[[], float],
               deadline: float) -> None:
        while not self.settled.wait(HAND_OVER_POLL_S):
            if clock() > deadline:
                self.write(late=True)
            elif asked():
                self.write()

    def take(self) -> bool:
        """The next task takes the partition: True unless its write has begun (then wait
        for it with `result`)."""
        with self.lock:
            if self.pending is None:
                self.taken = True
                self.settled.set()
            return self.taken

    def write(self, late: bool = False) -> None:
        """Begin the write, unless it has begun or the partition was taken (`late`: the
        wait ran out)."""
        with self.lock:
            if not self.taken and self.pending is None:
                self.settled.set()
                if late:
                    self.on_late()
                self.pending = self.begin()

    def done(self) -> bool:
        return self.taken or (self.pending is not None and self.pending.done())

    def result(self) -> None:
        self.write()
        if self.pending is not None:
            self.pending.result()
