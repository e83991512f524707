"""Real faults in real processes, shared by the reliability tests and
benchmarks/fault_bench.py: SIGKILL of a training driver, of a train task's
worker or of an actor, and a file size limit that makes an actor's writes fail
as on a full disk."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import psutil
import ray

from pbg_ray.checkpoints.storage import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.io.edges import chunk_bounds, count_edges
from pbg_ray.io.entities import load_entity_counts
from pbg_ray.types import Bucket
from tests.util import assert_valid_checkpoint

# Ray titles a worker process after what it runs: ray::<actor class> or ray::<task>.
RUN_PROCESSES = ("ray::PartitionStore", "ray::ParameterServer", "ray::BucketSchedulerActor",
                 "ray::train_bucket_task")
TRIAL_TIMEOUT_S = 300


def session_processes(title: str, since: float = 0.0) -> List[psutil.Process]:
    """The processes of the Ray this process started (children of its raylet, so never
    another session's) whose title begins with `title`, started at time.time() `since`
    or later (so not an earlier run's actors, which live until their handles go)."""
    node = ray._private.worker._global_node
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    found = []
    for proc in raylet.children(recursive=True):
        try:
            if (proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() >= since
                    and proc.cmdline()[0].startswith(title)):
                found.append(proc)
        except (psutil.Error, IndexError):
            pass  # gone meanwhile, or not started yet
    return found


def wait_gone(titles, since: float, timeout_s: float = 60.0) -> bool:
    """Whether every process titled one of `titles` started since `since` is gone
    within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(session_processes(t, since) for t in titles):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Fault(threading.Thread):
    """Calls `inject()` once `when()` holds, polling, until it returns what it did (a
    non-empty list); a context manager around the run it strikes."""

    def __init__(self, inject: Callable[[], List[int]], when: Callable[[], bool] = lambda: True
                 ) -> None:
        super().__init__(daemon=True)
        self.inject, self.when = inject, when
        self.done: List[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.when():
                self.done = self.inject()
                if self.done:
                    return
            time.sleep(0.01)

    def __enter__(self) -> "Fault":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.join()


def kill_first(title: str) -> List[int]:
    """SIGKILL the first process of this Ray session titled `title`; [its pid] or []."""
    for proc in session_processes(title):
        os.kill(proc.pid, signal.SIGKILL)
        return [proc.pid]
    return []


def actor_pid(actor: ray.actor.ActorHandle) -> int:
    """The pid of an actor's process (an earlier run's actors share its title)."""
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


def kill_actor(actor: ray.actor.ActorHandle) -> List[int]:
    """SIGKILL an actor's process; [its pid]."""
    pid = actor_pid(actor)
    os.kill(pid, signal.SIGKILL)
    return [pid]


def limit_file_size(actors: List[ray.actor.ActorHandle], limit_bytes: int) -> List[int]:
    """Lower the soft RLIMIT_FSIZE of the actors' processes: their writes past
    `limit_bytes` then fail with EFBIG, as on a full disk (Python ignores SIGXFSZ).
    Returns their pids."""
    pids = [actor_pid(a) for a in actors]
    for pid in pids:
        hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit_bytes, hard))
    return pids


def edges_lost_or_doubled(config: ConfigSchema) -> int:
    """How far training_stats.json is from every bucket of every pass training each of
    its chunk's training edges exactly once: the sum over (pass, bucket) of
    |edges counted - edges in the chunk|. Single-chunk passes."""
    counted: Counter = Counter()
    for s in CheckpointStorage(config.checkpoint_path).load_stats():
        key = (s["epoch_idx"], s["edge_path_idx"], s["edge_chunk_idx"],
               s["lhs_partition"], s["rhs_partition"])
        counted[key] += s["stats"]["count"]
    nparts = config.num_partitions()
    expected = {}
    for epoch in range(config.num_epochs):
        for path_idx, path in enumerate(config.edge_paths):
            for lhs in range(nparts):
                for rhs in range(nparts):
                    begin, end = chunk_bounds(count_edges(path, Bucket(lhs, rhs)), 0, 1)
                    n = end - begin
                    expected[epoch, path_idx, 0, lhs, rhs] = n - int(n * config.eval_fraction)
    return (sum(abs(counted.get(k, 0) - n) for k, n in expected.items())
            + sum(n for k, n in counted.items() if k not in expected))


def checkpoint_arrays(config: ConfigSchema) -> Dict[str, np.ndarray]:
    """Every array of the current checkpoint version: embeddings, optimizer sums, model."""
    storage = CheckpointStorage(config.checkpoint_path)
    version = storage.load_version()
    arrays = {}
    for entity, counts in load_entity_counts(config).items():
        for part in range(len(counts)):
            embs, state = storage.load_entity_partition(version, entity, part)
            arrays[f"{entity}_{part}"] = embs
            arrays[f"{entity}_{part} sums"] = state["state"][0]["sum"].numpy()
    arrays.update(storage.load_model(version)[0])
    return arrays


def next_version_in_progress(storage: CheckpointStorage, version: int, since: float) -> bool:
    """Whether files of version+1 (whole or temporary) written since `since` exist: the
    run started then is writing the next version (a commit; in disk placement it renames
    the partitions' swap files to their files of that version). An earlier run's
    leftovers are older."""
    try:
        entries = list(os.scandir(storage.path))
    except FileNotFoundError:
        return False
    for entry in entries:
        if entry.name.endswith(f".v{version + 1}.h5") or f".v{version + 1}.h5.tmp-" in entry.name:
            try:
                if entry.stat().st_mtime >= since:
                    return True
            except FileNotFoundError:
                pass  # renamed or removed meanwhile
    return False


KILL_MOMENTS = ("random", "write", "committed")


def driver_kill_trials(data: Dict[str, Any], workdir: Path, trials: int, seed: int,
                       address: str, max_delay_s: float = 12.0) -> Dict[str, Any]:
    """`python -m pbg_ray.train` on the config `data`, joined to the Ray at `address`,
    killed with SIGKILL `trials` times (each time the same command again, resuming the
    last), then run to the end. Kill moments cycle through KILL_MOMENTS: a random time
    in [0.3, max_delay_s] s, while files of the next version are being written, just
    after a version became current. During the first run a second run on the same
    checkpoint_path is started and must be refused. After each kill every process of
    the run must be gone and checkpoint_path must load at a version no older than before.
    """
    config = ConfigSchema.from_dict(data)
    storage = CheckpointStorage(config.checkpoint_path)
    module = workdir / "pbg_config.py"
    module.write_text(f"def get_torchbiggraph_config():\n    return {data!r}\n")
    command = [sys.executable, "-m", "pbg_ray.train", str(module), f"ray.address={address}"]
    rng = random.Random(seed)
    out: Dict[str, Any] = {"faults": 0, "during_write": 0, "ended_before_kill": 0,
                           "orphans": 0, "corrupt": [], "second_run": None}

    def start(name: str) -> subprocess.Popen:
        """The command, its stdout in {name}.out and its stderr in {name}.log."""
        with open(workdir / f"{name}.out", "w") as stdout, \
                open(workdir / f"{name}.log", "w") as stderr:
            return subprocess.Popen(command, cwd=workdir, stdout=stdout, stderr=stderr)

    def wait_for(proc: subprocess.Popen, condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + TRIAL_TIMEOUT_S
        while proc.poll() is None and not condition() and time.monotonic() < deadline:
            time.sleep(0.002)

    for trial in range(trials):
        moment = KILL_MOMENTS[trial % len(KILL_MOMENTS)]
        before = storage.load_version()
        t0, started = time.monotonic(), time.time()
        proc = start(f"trial{trial}")
        if trial == 0:
            lock = storage.path / ".pbg_ray.lock"
            wait_for(proc, lambda: lock.is_file() and f"pid {proc.pid} " in lock.read_text())
            second = start("second")
            second.wait(TRIAL_TIMEOUT_S)
            out["second_run"] = {"first_alive": proc.poll() is None, "rc": second.returncode,
                                 "log": (workdir / "second.log").read_text()}
        if moment == "random":
            delay = rng.uniform(0.3, max_delay_s)
            wait_for(proc, lambda: time.monotonic() - t0 >= delay)
        elif moment == "write":
            wait_for(proc, lambda: next_version_in_progress(storage, before, started))
        else:
            wait_for(proc, lambda: storage.load_version() > before)
        if proc.poll() is not None:
            out["ended_before_kill"] += 1
            if proc.returncode != 0:
                out["corrupt"].append(f"trial {trial}: the run failed by itself:\n"
                                      + (workdir / f"trial{trial}.log").read_text()[-3000:])
            continue
        in_write = next_version_in_progress(storage, storage.load_version(), started)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        out["faults"] += 1
        out["during_write"] += in_write
        if not wait_gone(RUN_PROCESSES, started):
            out["orphans"] += 1
        try:
            after = storage.load_version()
            if after < before:
                raise AssertionError(f"version went back from {before} to {after}")
            if after > 0:
                assert_valid_checkpoint(config, after, clean=False)
        except Exception as err:  # noqa: BLE001  any way of failing counts as corrupt
            out["corrupt"].append(f"trial {trial} ({moment}): {type(err).__name__}: {err}")
    final = start("final")
    try:
        final.wait(TRIAL_TIMEOUT_S * 2)
    except subprocess.TimeoutExpired:
        final.kill()
        final.wait()
    log = (workdir / "final.log").read_text()
    out["final_rc"] = final.returncode
    out["final_log"] = log[-3000:]
    total = config.num_epochs * len(config.edge_paths)
    out["finished"] = final.returncode == 0 and storage.load_version() == total
    if out["finished"]:
        try:
            assert_valid_checkpoint(config, total)
        except AssertionError as err:
            out["corrupt"].append(f"after the final run: {err}")
        out["lost_or_doubled"] = edges_lost_or_doubled(config)
        out["summary"] = json.loads((workdir / "final.out").read_text().strip().splitlines()[-1])
    return out
