"""The soak's crash detector (tests/fault_injection.crash_reports) on a real crash: a Ray
worker that segfaults in the session's Ray is found in its logs, and SIGKILLed workers
(the faults the benchmarks inject, which Ray's hints call "SIGSEGV or another error") are
not counted as crashes."""

import ctypes
import os
import signal
from pathlib import Path

import pytest
import ray
from ray.exceptions import WorkerCrashedError

from tests.fault_injection import crash_reports, crashed_processes


@ray.remote(max_retries=0)
def dies(how: str) -> None:
    if how == "segfault":
        ctypes.string_at(0)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_segfault_is_reported_and_a_sigkill_is_not(ray_session):
    session = [Path(ray._private.worker._global_node.get_session_dir_path())]
    before = crash_reports(session)
    with pytest.raises(WorkerCrashedError):
        ray.get(dies.remote("sigkill"))
    assert crash_reports(session) == before
    with pytest.raises(WorkerCrashedError):
        ray.get(dies.remote("segfault"))
    new = [r for r in crash_reports(session) if r not in before]
    assert any("Fatal Python error: Segmentation fault" in r or "SIGSEGV received" in r
               for r in new), new
    assert crashed_processes(new) == 1
