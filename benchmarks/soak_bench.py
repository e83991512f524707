"""A soak: training runs one after another for --minutes, each disturbed by a random fault,
on a machine loaded by --hogs busy processes, with every process able to leave a crash
report; at the end, the crashes found and the runs' checkpoints judged.

Each run trains its own random graph (tests/util.py) for two epochs, with settings drawn
from --seed: memory or disk placement, 4 or 8 partitions per partitioned type (16 or 64
buckets a pass), two trainers. Its fault, drawn too: none; the driver (`python -m
pbg_ray.train`) SIGKILLed at a driver point and the command run again; a train task's
worker, a partition store or the parameter server SIGKILLed at a named point; or a worker
node of a three-node cluster (ray.cluster_utils.Cluster) removed with a train task on it.
The runs share a local Ray of 2 CPUs, started again every --round-minutes, with the
kernel's C code on and off in turn (PBG_RAY_C_KERNELS).

Crash reports: PYTHONFAULTHANDLER is set and core dumps are allowed (RLIMIT_CORE) for every
process the soak starts (Ray's, the drivers', the clusters'); the logs of every Ray session
started meanwhile are then searched for a fatal signal, a failed Ray check or a heap error,
and the soak's directories for core files (tests/fault_injection.crash_reports).

Prints a line per run (what was drawn, and whether it finished with its checkpoint intact
and every edge trained once a pass), then runs, faults, hours, crashes, corrupt
checkpoints, edges lost or doubled; then one JSON line.

    python benchmarks/soak_bench.py --minutes 30 --hogs 6
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import random
import resource
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Dict

import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.*

from pbg_ray.config import ConfigSchema  # noqa: E402
from pbg_ray.model.native import C_KERNELS_ENV  # noqa: E402
from pbg_ray.training.trainer import Trainer  # noqa: E402
from tests.fault_injection import (  # noqa: E402
    ACTOR_POINTS, TRAIN_TASK_POINTS, armed, crash_reports, crashed_processes, driver_kill_trials,
    edges_lost_or_doubled, hits_per_pass, intact, lose_nodes, random_fault, ray_sessions)
from tests.util import config_dict, write_random_graph  # noqa: E402

EPOCHS = 2
FAULTS = ("none", "driver", "train_task", "actor", "node")
SETTINGS = dict(num_epochs=EPOCHS, eval_fraction=0.0, comparator="dot", loss_fn="softmax",
                lr=0.1, dimension=32, batch_size=200)
COUNTS = {"user": 3000, "item": 2000, "tag": 7}  # entities per partition
EDGES_PER_BUCKET = 1000


def hog() -> None:
    """A busy process, as the other jobs of a shared machine."""
    while True:
        pass


def draw_run(rng: random.Random, root: Path, index: int) -> Dict[str, Any]:
    """The config dict of run `index`, its graph written under root/run-<index>."""
    parts = rng.choice([4, 8])
    placement = rng.choice(["memory", "disk"])
    workdir = root / f"run-{index}"
    workdir.mkdir()
    data = config_dict(workdir, **SETTINGS, entities={
        "user": {"num_partitions": parts}, "item": {"num_partitions": parts},
        "tag": {"num_partitions": 1}}, ray={"num_trainers": 2, "placement": placement})
    write_random_graph(ConfigSchema.from_dict(data), num_edges=EDGES_PER_BUCKET, seed=index,
                       counts=COUNTS)
    return data


def one_run(data: Dict[str, Any], fault: str, rng: random.Random, seed: int) -> Dict[str, Any]:
    """Train `data` disturbed by `fault`: what happened, and what its checkpoint holds."""
    config = ConfigSchema.from_dict(data)
    out: Dict[str, Any] = {"fault": fault, "fired": False, "finished": False}
    if fault == "driver":
        trials = driver_kill_trials(data, Path(config.checkpoint_path).parent, 1, seed,
                                    ray.get_runtime_context().gcs_address)
        out.update(fired=trials["faults"] == 1, finished=trials["finished"],
                   point=trials["points"][0], problems=trials["corrupt"])
    elif fault == "node":
        hit = rng.randint(1, hits_per_pass(config, "train_task.after_read") * EPOCHS - 2)
        summary, = lose_nodes([(data, hit)])
        out.update(fired=summary["node_removed"], finished=summary["version"] == EPOCHS,
                   point=("train_task.after_read", hit))
    else:
        points = {"none": (), "train_task": TRAIN_TASK_POINTS, "actor": ACTOR_POINTS}[fault]
        if points:
            point, hits = random_fault(rng, config, points, EPOCHS)
            with armed(point, hits) as fired:
                result = Trainer(config).run()
            out.update(fired=fired(), point=(point, hits))
        else:
            result = Trainer(config).run()
        out["finished"] = result.version == EPOCHS
    if out["finished"]:
        out["intact"] = intact(config, EPOCHS)
        out["lost_or_doubled"] = edges_lost_or_doubled(config)
    return out


def start_ray(c_kernels: bool) -> Path:
    """A local Ray whose processes inherit the soak's crash-report settings and the C
    kernels' switch; its session directory."""
    os.environ[C_KERNELS_ENV] = "1" if c_kernels else "0"
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    return Path(ray._private.worker._global_node.get_session_dir_path())


def soak(minutes: float, seed: int, hogs: int, round_minutes: float,
         runs_file: Path = None) -> Dict[str, Any]:
    """Run the soak (see the module's doc); returns its figures."""
    os.environ["PYTHONFAULTHANDLER"] = "1"
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    rng = random.Random(seed)
    sessions_before = set(ray_sessions())
    busy = [multiprocessing.Process(target=hog, daemon=True) for _ in range(hogs)]
    for proc in busy:
        proc.start()
    figures: Counter = Counter()
    start = time.monotonic()
    deadline = start + minutes * 60
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="soak_bench-") as tmp:
        root = Path(tmp)
        os.chdir(root)  # where Ray's processes start, and so dump core
        index = 0
        try:
            for round_index in itertools.count():
                if time.monotonic() >= deadline:
                    break
                c_kernels = round_index % 2 == 0
                start_ray(c_kernels)
                round_end = min(deadline, time.monotonic() + round_minutes * 60)
                while time.monotonic() < round_end:
                    data = draw_run(rng, root, index)
                    fault = rng.choice(FAULTS)
                    t0 = time.monotonic()
                    try:
                        out = one_run(data, fault, rng, seed + index)
                    except Exception as err:  # noqa: BLE001  a run that fails is counted
                        out = {"fault": fault, "fired": False, "finished": False,
                               "error": "".join(traceback.format_exception_only(err)).strip()}
                    out.update(run=index, c_kernels=c_kernels, placement=data["ray"]["placement"],
                               partitions=data["entities"]["user"]["num_partitions"],
                               seconds=round(time.monotonic() - t0, 1))
                    figures["runs"] += 1
                    figures["faults"] += bool(out["fired"])
                    figures["failed"] += not out["finished"]
                    figures["corrupt"] += ((out["finished"] and not out["intact"])
                                           + len(out.get("problems", [])))
                    for problem in out.get("problems", []):
                        print(f"  {problem}")
                    figures["lost_or_doubled"] += out.get("lost_or_doubled", 0)
                    print(f"[{(time.monotonic() - start) / 60:5.1f} min] run {index}: "
                          f"{out['placement']}, {out['partitions']} partitions, C kernels "
                          f"{'on' if c_kernels else 'off'}, fault {fault} "
                          f"{out.get('point', '')}{' (fired)' if out['fired'] else ''}: "
                          f"{'finished' if out['finished'] else 'FAILED'}"
                          f"{'' if not out['finished'] or out['intact'] else ', CORRUPT'}, "
                          f"{out.get('lost_or_doubled', '-')} edges lost or doubled, "
                          f"{out['seconds']} s{' ' + out['error'] if 'error' in out else ''}",
                          flush=True)
                    if runs_file is not None:
                        with open(runs_file, "a") as f:
                            f.write(json.dumps(out) + "\n")
                    shutil.rmtree(root / f"run-{index}", ignore_errors=True)
                    index += 1
                ray.shutdown()
        finally:
            ray.shutdown()
            for proc in busy:
                proc.terminate()
            os.chdir(cwd)
            hours = (time.monotonic() - start) / 3600
            sessions = sorted(set(ray_sessions()) - sessions_before)
            reports = crash_reports(sessions, [root])
    for report in reports:
        print(f"  crash: {report}")
    return {"soak_hours": round(hours, 3), "runs": figures["runs"], "faults": figures["faults"],
            "runs_failed": figures["failed"], "crashes": crashed_processes(reports),
            "checkpoints_corrupt": figures["corrupt"],
            "edges_lost_or_doubled": figures["lost_or_doubled"],
            "ray_sessions_searched": len(sessions)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--hogs", type=int, default=0, help="busy processes loading the machine")
    parser.add_argument("--round-minutes", type=float, default=5.0,
                        help="how long one Ray (and one C-kernels setting) serves")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs-file", type=Path, default=None,
                        help="append one JSON line per run here")
    args = parser.parse_args()
    figures = soak(args.minutes, args.seed, args.hogs, args.round_minutes, args.runs_file)
    print(f"soak: {figures['soak_hours']:.2f} hours, {args.hogs} busy processes beside it")
    print(f"runs: {figures['runs']} ({figures['runs_failed']} failed), "
          f"faults injected: {figures['faults']}")
    print(f"crashes (processes): {figures['crashes']} in {figures['ray_sessions_searched']} "
          f"Ray sessions")
    print(f"checkpoints found corrupt: {figures['checkpoints_corrupt']}")
    print(f"edges lost or doubled: {figures['edges_lost_or_doubled']}")
    print(json.dumps({"hogs": args.hogs, "seed": args.seed, **figures}))


if __name__ == "__main__":
    main()
