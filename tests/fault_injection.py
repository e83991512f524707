"""Real faults in real processes, shared by the fault tests and benchmarks/fault_bench.py:
a training driver, a train task's worker or an actor made to fail at a named fault point of
the engine (pbg_ray.runtime.faults: SIGKILL, exit or an exception, at the n-th time the point
is reached), and a file size limit that makes an actor's writes fail as on a full disk.

Importing this module arms nothing: it only sets PBG_RAY_FAULTS_DIR (unless set) to a fresh
directory, removed when the process that made it exits. pytest collects the test modules,
and fault_bench imports this one, before Ray starts, so every Ray worker and every driver
started as a subprocess inherits it."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import (
    Any, Callable, Collection, Dict, Iterator, List, Optional, Sequence, Set, Tuple)

import numpy as np
import psutil
import ray

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.io.edges import chunk_bounds, count_edges
from pbg_ray.io.entities import load_entity_counts
from pbg_ray.model.params import partition_keys
from pbg_ray.runtime.faults import FAULTS_DIR_ENV
from pbg_ray.types import Bucket
from tests.util import assert_valid_checkpoint


def _faults_dir() -> Path:
    """PBG_RAY_FAULTS_DIR as inherited, or a fresh directory (set in the environment for the
    processes started from here) removed when this process exits."""
    if FAULTS_DIR_ENV not in os.environ:
        os.environ[FAULTS_DIR_ENV] = tempfile.mkdtemp(prefix="pbg_ray-faults-")
        atexit.register(shutil.rmtree, os.environ[FAULTS_DIR_ENV], ignore_errors=True)
    return Path(os.environ[FAULTS_DIR_ENV])


FAULTS_DIR = _faults_dir()

DRIVER_POINTS = ("driver.before_apply", "driver.after_apply", "driver.before_commit",
                 "driver.version_written", "driver.after_commit")
TRAIN_TASK_POINTS = ("train_task.after_read", "train_task.before_return")
ACTOR_POINTS = ("partition_store.update", "partition_store.save", "parameter_server.update")
# The points reached once per bucket trained.
PER_BUCKET = ("driver.before_apply", "driver.after_apply", *TRAIN_TASK_POINTS,
              "parameter_server.update")

# Ray titles a worker process after what it runs: ray::<actor class> or ray::<task>.
RUN_PROCESSES = ("ray::PartitionStore", "ray::ParameterServer", "ray::BucketSchedulerActor",
                 "ray::train_bucket_task")
# Hang guards: how long a run or its processes may take to end.
TRIAL_TIMEOUT_S = 300
PROCESSES_GONE_TIMEOUT_S = 60


# What a crashed process leaves in its log: faulthandler's report (PYTHONFAULTHANDLER), a
# fatal signal named by Ray or the shell, a failed Ray check, glibc's heap checks.
CRASH_SIGNS = re.compile(
    r"Fatal Python error|Segmentation fault|SIGSEGV|SIGABRT|SIGBUS|SIGILL|SIGFPE|Check failed"
    r"|[Mm]utex.{0,40}corrupt|core dumped|terminate called|double free|corrupted size"
    r"|malloc\(\): |free\(\): ")
# Ray's hints on every unexpected exit, a SIGKILL too ("... or SIGSEGV"): no sign of a crash.
RAY_HINTS = re.compile(r"Possible reasons include|common causes include")


def ray_sessions() -> List[Path]:
    """The session directories of every Ray started on this machine (newest last)."""
    root = Path(tempfile.gettempdir()) / "ray"
    return sorted(root.glob("session_2*"), key=lambda p: p.stat().st_mtime)


def crash_reports(session_dirs: Sequence[Path], search: Sequence[Path] = ()) -> List[str]:
    """'file: line' for each log line of the Ray sessions that shows a crash (CRASH_SIGNS),
    and each core file found under the sessions and `search`."""
    found = []
    for session in session_dirs:
        for log in sorted((session / "logs").rglob("*")):
            if not log.is_file():
                continue
            with open(log, errors="replace") as f:
                found += [f"{log}: {line.strip()[:300]}" for line in f
                          if CRASH_SIGNS.search(line) and not RAY_HINTS.search(line)]
    for directory in [*session_dirs, *search]:
        found += [f"{core}: core dump" for core in Path(directory).rglob("core*")
                  if core.is_file() and re.fullmatch(r"core(\.\d+)?", core.name)]
    return found


def crashed_processes(reports: Sequence[str]) -> int:
    """How many processes the crash_reports lines are about: a worker's logs are named
    after its pid, and a core dump is one process."""
    processes = set()
    for report in reports:
        name = report.split(": ", 1)[0]
        pid = re.search(r"[-_](\d+)\.(err|out|log)$", name)
        processes.add(pid.group(1) if pid else name)
    return len(processes)


def _clear(point: str) -> None:
    """Remove `point`'s armed file and the records of its hits and firing."""
    for path in [FAULTS_DIR / point, FAULTS_DIR / f"{point}.released",
                 *FAULTS_DIR.glob(f"{point}.hit-*"), *FAULTS_DIR.glob(f"{point}.fired-*")]:
        path.unlink(missing_ok=True)


def fired(point: str) -> int:
    """How often the fault armed at `point` fired (once at most unless armed to repeat)."""
    return len(list(FAULTS_DIR.glob(f"{point}.fired-*")))


def release(point: str) -> None:
    """Let a process held at `point` (action "hold") go on."""
    (FAULTS_DIR / f"{point}.released").touch()


@contextlib.contextmanager
def armed(point: str, hits: int = 1, action: str = "kill",
          repeat: bool = False) -> Iterator[Callable[[], int]]:
    """Arm fault point `point` (pbg_ray.runtime.faults) for the block: the `hits`-th time a
    process reaches it (`repeat`: and every time after), that process fails by `action`
    ("kill", "exit" or "raise") or waits there until released ("hold"). Yields `fired`;
    after the block the fault is disarmed if it is still armed, and a held process
    released."""
    _clear(point)
    staged = FAULTS_DIR / f".{point}.tmp"
    staged.write_text(json.dumps({"action": action, "hits": hits, "repeat": repeat}))
    staged.rename(FAULTS_DIR / point)  # whole, or not there, to the processes reading it
    try:
        yield lambda: fired(point)
    finally:
        (FAULTS_DIR / point).unlink(missing_ok=True)
        if action == "hold":
            release(point)


def hits_per_pass(config: ConfigSchema, point: str) -> int:
    """How often one pass of `config` reaches `point` (one edge path, one chunk)."""
    buckets = [Bucket(lhs, rhs) for lhs in range(config.num_partitions())
               for rhs in range(config.num_partitions())
               if count_edges(config.edge_paths[0], Bucket(lhs, rhs))]
    if point in PER_BUCKET:
        return len(buckets)
    if point == "partition_store.update":
        return sum(len(partition_keys(config, bucket)) for bucket in buckets)
    if point == "partition_store.save":
        return sum(e.num_partitions for e in config.entities.values())
    return 1  # a commit or a report


def random_fault(rng: random.Random, config: ConfigSchema, points: Sequence[str],
                 passes: int) -> Tuple[str, int]:
    """(point, hits): one of `points`, and one of its hits in the first `passes` passes."""
    point = rng.choice(points)
    return point, rng.randint(1, hits_per_pass(config, point) * passes)


def _session_services() -> Set[int]:
    """The pids of the Ray this process started (none when it joined one or started
    none) that no run owns: its raylet, GCS and agents, and the workers that run no
    actor or task of a run now (ray::IDLE, Ray's own actors)."""
    node = getattr(ray._private.worker, "_global_node", None)
    started = [info.process.pid for infos in getattr(node, "all_processes", {}).values()
               for info in infos]
    services = set()
    for pid in started:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in tree:
            try:
                if not proc.cmdline()[0].startswith(RUN_PROCESSES):
                    services.add(proc.pid)
            except (psutil.Error, IndexError):
                pass
    return services


def _describe(proc: psutil.Process) -> str:
    """'pid title (parent pid, how long it has run, its raylet's state or gone)' of a
    process (a Ray worker's raylet is RAY_RAYLET_PID in its environment)."""
    try:
        with proc.oneshot():
            title = " ".join(proc.cmdline())[:120]
            about = f"parent {proc.ppid()}, up {time.time() - proc.create_time():.0f} s"
            raylet = proc.environ().get("RAY_RAYLET_PID")
    except psutil.Error:
        return f"{proc.pid} (gone)"
    if raylet is not None:
        try:
            about += f", raylet {raylet} {psutil.Process(int(raylet)).status()}"
        except psutil.Error:
            about += f", raylet {raylet} gone"
    return f"{proc.pid} {title} ({about})"


def own_processes(sessions: Sequence[Path] = ()) -> List[psutil.Process]:
    """The processes alive now that this process's runs started, itself, its ancestors
    and the services of its own Ray (see _session_services) left out: those whose
    environment holds FAULTS_DIR (every driver, Ray process and Ray worker started after
    this module was imported inherits it) or whose command line names one of `sessions`
    (Ray session directories)."""
    mine = {os.getpid(), *(proc.pid for proc in psutil.Process().parents()),
            *_session_services()}
    names = [str(session) for session in sessions]
    found = []
    for proc in psutil.process_iter():
        if proc.pid in mine:
            continue
        try:
            if proc.environ().get(FAULTS_DIR_ENV) == str(FAULTS_DIR) or any(
                    name in arg for arg in proc.cmdline() for name in names):
                found.append(proc)
        except psutil.Error:
            pass  # gone meanwhile, or a zombie
    return found


def left_behind(before: Collection[int] = (), sessions: Sequence[Path] = ()) -> List[str]:
    """The own_processes (not in `before`, a set of pids taken before a run) still alive
    once they had PROCESSES_GONE_TIMEOUT_S to end, described: a run that ended, or whose
    driver or node was killed, leaves none. They are killed, so none outlives the caller."""
    procs = [proc for proc in own_processes(sessions) if proc.pid not in before]
    _, alive = psutil.wait_procs(procs, timeout=PROCESSES_GONE_TIMEOUT_S)
    described = [_describe(proc) for proc in alive]
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=PROCESSES_GONE_TIMEOUT_S)
    return described


def actor_pid(actor: ray.actor.ActorHandle) -> int:
    """The pid of an actor's process."""
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


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


def intact(config: ConfigSchema, version: int) -> bool:
    """Whether the checkpoint of `config` is complete and valid at `version`; prints why
    not (a benchmark counts, rather than stops at, a corrupt checkpoint)."""
    try:
        assert_valid_checkpoint(config, version)
        return True
    except Exception as err:  # noqa: BLE001  any way of failing counts
        print(f"  corrupt: {config.checkpoint_path}: {type(err).__name__}: {err}")
        return False


def checkpoint_arrays(config: ConfigSchema) -> Dict[str, np.ndarray]:
    """Every array of the current checkpoint version: embeddings, optimizer sums, model."""
    storage = CheckpointStorage(config.checkpoint_path)
    version = storage.load_version()
    arrays = {}
    for entity, counts in load_entity_counts(config).items():
        for part in range(len(counts)):
            embs, state = storage.load_entity_partition(version, entity, part)
            arrays[f"{entity}_{part}"] = embs
            arrays[f"{entity}_{part} sums"] = state["state"][0]["sum"]
    arrays.update(storage.load_model(version)[0])
    return arrays


def next_version_written(storage: CheckpointStorage, version: int) -> bool:
    """Whether files of version+1 (whole or temporary) exist: a run was writing it."""
    return any(f".v{version + 1}.h5" in path.name for path in storage.path.iterdir())


def finish(proc: subprocess.Popen, timeout_s: float) -> Optional[int]:
    """The return code of `proc` once it ends, or None (killed) if it hangs `timeout_s`."""
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def driver_kill_trials(data: Dict[str, Any], workdir: Path, trials: int, seed: int,
                       address: str) -> Dict[str, Any]:
    """`python -m pbg_ray.train` on the config `data`, joined to the Ray at `address`,
    SIGKILLed `trials` times at a driver fault point (each time the same command again,
    resuming the last), then run to the end. The points cycle through DRIVER_POINTS, each
    armed at a hit drawn from `seed` within the run's first two passes; num_epochs above
    2 x trials leaves every trial a pass to be killed in. First, a run started while
    this process holds checkpoint_path's lock must be refused. After each kill
    checkpoint_path must load at a version no older than before; after each run no
    process of it may be left running ("left_running": left_behind's, of all runs)."""
    config = ConfigSchema.from_dict(data)
    storage = CheckpointStorage(config.checkpoint_path)
    module = workdir / "pbg_config.py"
    module.write_text(f"def get_torchbiggraph_config():\n    return {data!r}\n")
    command = [sys.executable, "-m", "pbg_ray.train", str(module), f"ray.address={address}"]
    rng = random.Random(seed)
    out: Dict[str, Any] = {"faults": 0, "during_write": 0, "ended_before_kill": 0,
                           "left_running": [], "corrupt": [], "points": []}
    before = {proc.pid for proc in own_processes()}

    def start(name: str) -> subprocess.Popen:
        """The command, its stdout in {name}.out and its stderr in {name}.log."""
        with open(workdir / f"{name}.out", "w") as stdout, \
                open(workdir / f"{name}.log", "w") as stderr:
            return subprocess.Popen(command, cwd=workdir, stdout=stdout, stderr=stderr)

    with storage.lock():
        second = start("second")
        out["second_run"] = {"rc": finish(second, TRIAL_TIMEOUT_S),
                             "log": (workdir / "second.log").read_text()}
    for trial in range(trials):
        point = DRIVER_POINTS[trial % len(DRIVER_POINTS)]
        hits = rng.randint(1, 2 * hits_per_pass(config, point))
        out["points"].append((point, hits))
        version_before = storage.load_version()
        with armed(point, hits) as did_fire:
            rc = finish(start(f"trial{trial}"), TRIAL_TIMEOUT_S)
            killed = did_fire()
        out["left_running"] += left_behind(before)
        if not killed:
            if rc == 0:
                out["ended_before_kill"] += 1
            else:
                out["corrupt"].append(f"trial {trial}: the run failed by itself (rc {rc}):\n"
                                      + (workdir / f"trial{trial}.log").read_text()[-3000:])
            continue
        out["faults"] += 1
        out["during_write"] += next_version_written(storage, storage.load_version())
        try:
            after = storage.load_version()
            if after < version_before:
                raise AssertionError(f"version went back from {version_before} to {after}")
            if after > 0:
                assert_valid_checkpoint(config, after, clean=False)
        except Exception as err:  # noqa: BLE001  any way of failing counts as corrupt
            out["corrupt"].append(f"trial {trial} ({point} hit {hits}): "
                                  f"{type(err).__name__}: {err}")
    final = start("final")
    out["final_rc"] = finish(final, TRIAL_TIMEOUT_S * 2)
    out["left_running"] += left_behind(before)
    out["final_log"] = (workdir / "final.log").read_text()[-3000:]
    total = config.num_epochs * len(config.edge_paths)
    out["finished"] = out["final_rc"] == 0 and storage.load_version() == total
    if out["finished"]:
        try:
            assert_valid_checkpoint(config, total)
        except AssertionError as err:
            out["corrupt"].append(f"after the final run: {err}")
        out["lost_or_doubled"] = edges_lost_or_doubled(config)
        out["summary"] = json.loads((workdir / "final.out").read_text().strip().splitlines()[-1])
    return out


def epoch_losses(bucket_stats: List[Dict[str, Any]], num_epochs: int) -> List[float]:
    """Each epoch's loss, the mean over its buckets' edges (a run's TrainResult.bucket_stats)."""
    return [float(np.average(
        [s["stats"]["metrics"]["loss"] for s in bucket_stats if s["epoch_idx"] == e],
        weights=[s["stats"]["count"] for s in bucket_stats if s["epoch_idx"] == e]))
        for e in range(num_epochs)]


def lose_nodes(runs: List[Tuple[Dict[str, Any], int]]) -> List[Dict[str, Any]]:
    """Train each (config dict, hit) of `runs` in turn on one three-node cluster of its
    own (tests/training/node_loss_run.py), losing a worker node that holds a partition store
    at the `hit`-th bucket read (0: none; a new node joins before the next run); the
    runs' summaries."""
    script = Path(__file__).with_name("training") / "node_loss_run.py"
    with tempfile.TemporaryDirectory(prefix="node_loss-") as scratch:
        summary = Path(scratch) / "summary.json"
        proc = subprocess.run([sys.executable, str(script), json.dumps(runs), str(summary)],
                              capture_output=True, text=True,
                              timeout=TRIAL_TIMEOUT_S * 2 * len(runs))
        if proc.returncode != 0 or not summary.exists():
            raise RuntimeError(f"the node-loss run failed (exit {proc.returncode}):\n"
                               f"{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
        return json.loads(summary.read_text())
