"""Named fault points: the moments of a run where the fault-injection tests
(tests/fault_injection.py) and benchmarks/fault_bench.py make a process fail, so that a
test says where a fault strikes instead of waiting for a timer.

pbg_ray calls `fault_point(name)` at these points (in the process that reaches them):

    driver.before_apply          a bucket's results are back; its updates are not sent yet
    driver.after_apply           a bucket's updates are sent to the actors
    driver.before_commit         a pass is trained; no file of its version is written yet
    driver.version_written       every file of the new version is written;
                                 checkpoint_version.txt still names the previous one
    driver.after_commit          the new version is current, the superseded one dropped
    importer.read_shard          a read task of the Ray engine is about to read a shard
    importer.batch_named         a read task's batch has its names' ids, counted by the
                                 dictionary shards
    importer.shard_add           a dictionary shard is about to add a read call's names
    train_task.after_read        a train task read its edges and partitions
    train_task.before_return     a train task trained its bucket (in disk placement began
                                 writing its swap files) and is about to return
    train_task.write_behind      a train task's worker is about to write a swap file
                                 behind the task (disk placement)
    partition_store.update       a partition store is about to adopt a bucket's result
    partition_store.save         a partition store wrote one partition of a new version
    parameter_server.update      the parameter server is about to add a bucket's change
    tune.report                  a Tune trial is about to report an epoch
    serve.shard_search           a shard replica of the HTTP service searched and is
                                 about to answer

Nothing is armed unless the environment variable PBG_RAY_FAULTS_DIR names a directory
(read once per process: set it before Ray starts, so that every Ray worker inherits it).
A point is armed by a file in that directory named after the point, holding JSON
{"action": "kill" | "exit" | "raise" | "hold", "hits": n[, "repeat": true]}. Every hit of
an armed point, in any process, takes the next number by creating `<point>.hit-<k>`
(O_EXCL: one process per k); the process whose hit is the n-th renames the armed file to
`<point>.fired-<pid>`, which disarms it, and then SIGKILLs itself, exits with EXIT_STATUS,
raises FaultInjected, or ("hold") waits there until `<point>.released` exists: the fired
file tells a test that the moment has come for a fault it makes itself (the node of the
held process removed), and the hold keeps the run at that moment until the test has made
it. So each armed fault fires exactly once, unless "repeat": then the armed file stays,
and every hit from the n-th on fires (the k-th leaving `<point>.fired-<pid>-<k>`): a fault
that meets every retry of the work, as a task that always outgrows its memory does.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import signal
import time
from typing import Optional

FAULTS_DIR_ENV = "PBG_RAY_FAULTS_DIR"
EXIT_STATUS = 3


class FaultInjected(RuntimeError):
    """Raised at an armed fault point whose action is "raise"."""


@functools.lru_cache(maxsize=None)
def faults_dir() -> Optional[str]:
    """The directory of armed faults, or None: every point is inert."""
    return os.environ.get(FAULTS_DIR_ENV) or None


def fault_point(name: str) -> None:
    """Fail here if the point `name` is armed and this is the hit it fires at."""
    directory = faults_dir()
    if directory is not None:
        _hit(os.path.join(directory, name), name)


def _hit(path: str, name: str) -> None:
    try:
        with open(path) as f:
            fault = json.load(f)
    except FileNotFoundError:  # not armed, or fired meanwhile
        return
    for hit in itertools.count(1):
        try:
            os.close(os.open(f"{path}.hit-{hit}", os.O_CREAT | os.O_EXCL))
            break
        except FileExistsError:
            continue
    if hit < fault["hits"] or (hit > fault["hits"] and not fault.get("repeat")):
        return
    try:
        if fault.get("repeat"):
            os.close(os.open(f"{path}.fired-{os.getpid()}-{hit}", os.O_CREAT))
        else:
            os.rename(path, f"{path}.fired-{os.getpid()}")
    except FileNotFoundError:  # disarmed meanwhile
        return
    if fault["action"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault["action"] == "exit":
        os._exit(EXIT_STATUS)
    if fault["action"] == "hold":
        while not os.path.exists(f"{path}.released"):
            time.sleep(0.01)
        return
    raise FaultInjected(f"fault injected at {name}")
