"""Real faults injected into real runs, and bad input fed to the readers, at a larger
count than the tests (tests/training/test_faults.py, tests/io/test_bad_inputs.py) use.

On a local Ray of 2 CPUs and the tests' small graph (tests/util.py), each fault at a named
fault point of the engine (pbg_ray.runtime.faults) and a hit of it drawn from --seed:
- the driver (`python -m pbg_ray.train`) SIGKILLed at each driver point in turn (a bucket
  applied or not yet, before a version is written, between writing it and making it
  current, after), each time resumed by the same command, in memory and in disk
  placement, then run to the end;
- a train task's worker SIGKILLed (having read its partitions, or about to return) in a
  random pass, the checkpoint compared bit for bit with an undisturbed run's (one trainer
  at a time makes runs deterministic);
- a partition store or the parameter server SIGKILLed in a random pass (adopting a
  bucket's result, writing a version, adding a bucket's change; restored from the newest
  version);
- a worker node of a three-node cluster (ray.cluster_utils.Cluster) removed mid-epoch, the
  node whose train task reached a bucket drawn from --seed, with the partition store on it,
  in memory and in disk placement; epoch losses compared with an undisturbed run's;
- a store's checkpoint writes failing once version 1 is current (a file size limit, as on
  a full disk), then rerun;
- the bad-input corpus (tests/bad_inputs/) and edge and checkpoint files damaged at random;
- with --soak-minutes, a soak after them (benchmarks/soak_bench.py).

Prints faults injected, runs finished, checkpoints found corrupt (must be 0), edges lost
or doubled (must be 0), crashed processes found in the logs of the Ray sessions it
started (must be 0), processes left running (must be 0: after each part and at the end,
every process its runs started, found by PBG_RAY_FAULTS_DIR in its environment or its
Ray session directory on its command line, each printed and then killed), bad inputs
tried and bad inputs refused cleanly; then one JSON line.

    python benchmarks/fault_bench.py                      # 30 driver kills, 500 damaged files
    python benchmarks/fault_bench.py --driver-kills 2 --worker-kills 1 --store-kills 1 \
        --node-kills 2 --damaged 10 --soak-minutes 30
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.*

from pbg_ray.checkpoints.directory import CheckpointStorage  # noqa: E402
from pbg_ray.config import ConfigSchema  # noqa: E402
from pbg_ray.errors import PbgRayError  # noqa: E402
from pbg_ray.io.edges import edges_file  # noqa: E402
from pbg_ray.training.trainer import Trainer  # noqa: E402
from pbg_ray.types import Bucket  # noqa: E402
from soak_bench import soak  # noqa: E402  (beside this script)
from tests.bad_input import (  # noqa: E402
    DAMAGE, damage, good_graph, load_cases, read_checkpoint, read_edges_as_training, refusal)
from tests.fault_injection import (  # noqa: E402
    ACTOR_POINTS, TRAIN_TASK_POINTS, armed, checkpoint_arrays, crash_reports, crashed_processes,
    driver_kill_trials, edges_lost_or_doubled, epoch_losses, hits_per_pass, intact, left_behind,
    limit_file_size, lose_nodes, random_fault, ray_sessions)
from tests.util import config_dict, write_random_graph  # noqa: E402

SETTINGS = dict(eval_fraction=0.0, comparator="dot", loss_fn="softmax", lr=0.1, global_emb=True)
EPOCHS = 4


def config_at(root: Path, name: str, **overrides: Any) -> ConfigSchema:
    return ConfigSchema.from_dict(config_dict(
        root, checkpoint_path=str(root / name), **{**SETTINGS, "num_epochs": EPOCHS, **overrides}))


def driver_kills(root: Path, trials: int, seed: int, address: str, figures: Counter,
                 details: Dict[str, Any]) -> None:
    for placement in ("memory", "disk"):
        workdir = root / f"driver-{placement}"
        workdir.mkdir()
        # Each trial is killed within its run's first two passes: every one has a pass left.
        data = config_dict(workdir, num_epochs=2 * trials + 2, **SETTINGS,
                           ray={"cpus_per_trainer": 1, "placement": placement})
        write_random_graph(ConfigSchema.from_dict(data), num_edges=1000)
        out = driver_kill_trials(data, workdir, trials, seed, address)
        for problem in out["corrupt"]:
            print(f"  corrupt: {problem}")
        for process in out["left_running"]:
            print(f"  left running after a driver kill trial: {process}")
        left = details.setdefault("left_running", {})
        left["driver kills"] = left.get("driver kills", 0) + len(out["left_running"])
        second = out["second_run"]
        refused = second["rc"] == 2 and "in use by another training run" in second["log"]
        figures["faults"] += out["faults"]
        figures["finished"] += out["finished"]
        figures["corrupt"] += len(out["corrupt"]) + (not out["finished"])
        figures["lost_or_doubled"] += out.get("lost_or_doubled", 0)
        details[f"driver_{placement}"] = {
            "kills": out["faults"], "during_write": out["during_write"],
            "ended_before_kill": out["ended_before_kill"], "left_running": len(out["left_running"]),
            "second_run_refused": refused, "finished": out["finished"]}
        print(f"driver kills ({placement}): {out['faults']} ({out['during_write']} during a "
              f"checkpoint write), finished: {out['finished']}, second run refused: {refused}")


def worker_kills(root: Path, runs: int, rng: random.Random, figures: Counter,
                 details: Dict[str, Any]) -> None:
    settings = dict(ray={"num_trainers": 1})
    undisturbed = config_at(root, "worker-undisturbed", **settings)
    write_random_graph(undisturbed, num_edges=3000)
    Trainer(undisturbed).run()
    expected = checkpoint_arrays(undisturbed)
    differing = 0
    for run in range(runs):
        # Disk placement trains what memory placement trains.
        config = config_at(root, f"worker-{run}", ray={"num_trainers": 1,
                                                       "placement": ("memory", "disk")[run % 2]})
        with armed(*random_fault(rng, config, TRAIN_TASK_POINTS, EPOCHS)) as fired:
            result = Trainer(config).run()
        figures["faults"] += fired()
        figures["finished"] += result.version == EPOCHS
        got = checkpoint_arrays(config)
        same = all(np.array_equal(got[k], expected[k]) for k in expected)
        differing += not same
        figures["corrupt"] += (not intact(config, EPOCHS)) + (not same)
        figures["lost_or_doubled"] += edges_lost_or_doubled(config)
    details["worker"] = {"kills": runs, "differing_from_undisturbed": differing}
    print(f"train task kills: {runs}, checkpoints differing from the undisturbed run: {differing}")


def store_kills(root: Path, runs: int, rng: random.Random, figures: Counter,
                details: Dict[str, Any]) -> None:
    settings = dict(ray={"num_partition_stores": 2})
    reference = config_at(root, "store-reference", **settings)
    write_random_graph(reference, num_edges=2000)
    losses = epoch_losses(Trainer(reference).run().bucket_stats, EPOCHS)
    worst = 0.0
    for run in range(runs):
        placement = ("memory", "disk")[run % 2]
        config = config_at(root, f"store-{run}",
                           ray={"num_partition_stores": 2, "placement": placement})
        with armed(*random_fault(rng, config, ACTOR_POINTS, EPOCHS)) as fired:
            result = Trainer(config).run()
        figures["faults"] += fired()
        figures["finished"] += result.version == EPOCHS
        figures["corrupt"] += not intact(config, EPOCHS)
        figures["lost_or_doubled"] += edges_lost_or_doubled(config)
        worst = max(worst, *(abs(got - want) / want for got, want
                             in zip(epoch_losses(result.bucket_stats, EPOCHS), losses)))
    details["store"] = {"kills": runs, "worst_loss_deviation": worst}
    print(f"partition store and parameter server kills: {runs}, worst epoch loss deviation "
          f"from an undisturbed run: {worst:.2%}")


def node_kills(root: Path, runs: int, rng: random.Random, figures: Counter,
               details: Dict[str, Any], sessions: List[Path]) -> None:
    entities = {"user": {"num_partitions": 4}, "item": {"num_partitions": 4},
                "tag": {"num_partitions": 1}}
    reference = config_at(root, "node-reference", entities=entities, ray={"num_trainers": 2})
    write_random_graph(reference, num_edges=1000)
    losses = epoch_losses(Trainer(reference).run().bucket_stats, EPOCHS)
    worst, restarts = 0.0, 0
    configs = [config_at(root, f"node-{run}", entities=entities,
                         ray={"num_trainers": 2, "placement": ("memory", "disk")[run % 2]})
               for run in range(runs)]
    hits = [rng.randint(1, hits_per_pass(config, "train_task.after_read") * EPOCHS - 2)
            for config in configs]
    results = lose_nodes([(config.to_dict(), hit) for config, hit in zip(configs, hits)])
    sessions += {Path(result["session_dir"]) for result in results}
    for config, result in zip(configs, results):
        figures["faults"] += result["node_removed"]
        figures["finished"] += result["version"] == EPOCHS
        figures["corrupt"] += not intact(config, EPOCHS)
        figures["lost_or_doubled"] += edges_lost_or_doubled(config)
        restarts += result["actor_restarts"]
        worst = max(worst, *(abs(got - want) / want for got, want
                             in zip(result["epoch_losses"], losses)))
    details["node"] = {"kills": runs, "actor_restarts": restarts, "worst_loss_deviation": worst}
    print(f"worker nodes removed: {runs}, passes trained again: {restarts}, worst epoch loss "
          f"deviation from an undisturbed run: {worst:.2%}")


def failing_writes(root: Path, figures: Counter, details: Dict[str, Any]) -> None:
    clean = 0
    for placement in ("memory", "disk"):
        config = config_at(root, f"write-{placement}", num_epochs=2, ray={"placement": placement})
        write_random_graph(config)
        storage = CheckpointStorage(config.checkpoint_path)
        trainer = Trainer(config)
        limited = []
        try:  # once version 1 is current (epoch 1 ended), no store writes past 1 KiB
            trainer.run(on_epoch_end=lambda _: limited.extend(
                limit_file_size(trainer.stores, 1024)))
            message = ""
        except PbgRayError as err:
            message = str(err)
        figures["faults"] += bool(limited)
        ok = ".v2.h5' failed: File too large" in message and storage.load_version() == 1
        figures["corrupt"] += not ok
        clean += ok
        figures["finished"] += Trainer(config).run().version == 2
        figures["corrupt"] += not intact(config, 2)
    details["failing_writes"] = {"runs": 2, "refused_cleanly": clean}
    print(f"failing checkpoint writes: 2, stopped with the file named and the last version "
          f"current: {clean}")


def bad_inputs(root: Path, damaged: int, rng: random.Random, figures: Counter,
               details: Dict[str, Any]) -> None:
    cases = load_cases()
    for i, case in enumerate(cases):
        workdir = root / f"case-{i}"
        workdir.mkdir()
        try:
            refusal(case, workdir)
            figures["refused"] += 1
        except Exception as err:  # noqa: BLE001  anything else is not a clean refusal
            print(f"  not refused cleanly: {case['file']}: {type(err).__name__}: {err}")
    graph = good_graph(root / "damage")
    storage = CheckpointStorage(graph.checkpoint_path)
    targets = ([(edges_file(graph.edge_paths[0], Bucket(l, r)), read_edges_as_training)
                for l in range(2) for r in range(2)]
               + [(storage.path / name, read_checkpoint) for name in (
                   "checkpoint_version.txt", "config.json", "model.v1.h5",
                   "embeddings_user_0.v1.h5", "embeddings_item_1.v1.h5", "embeddings_tag_0.v1.h5")])
    outcome: Counter = Counter()
    for _ in range(damaged):
        path, read = rng.choice(targets)
        good = path.read_bytes()
        path.write_bytes(damage(good, rng.choice(DAMAGE), rng.random(),
                                rng.randbytes(rng.randint(1, 64))))
        try:
            read(graph)
            outcome["still_readable"] += 1
        except PbgRayError:
            outcome["refused"] += 1
        except Exception as err:  # noqa: BLE001
            outcome["escaped"] += 1
            print(f"  escaped: {path.name}: {type(err).__name__}: {err}")
        path.write_bytes(good)
    figures["tried"] += len(cases) + damaged
    figures["refused"] += outcome["refused"]
    details["bad_inputs"] = {"corpus": len(cases), "damaged_files": damaged, **outcome}


def count_left(after: str, sessions: List[Path], details: Dict[str, Any]) -> None:
    """Count the processes that the runs of the part `after` left running (and kill
    them: tests/fault_injection.left_behind), printing each."""
    left = left_behind(sessions=sessions)
    for process in left:
        print(f"  left running after {after}: {process}")
    counts = details.setdefault("left_running", {})
    counts[after] = counts.get(after, 0) + len(left)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver-kills", type=int, default=30,
                        help="in all, half per placement (0: none)")
    parser.add_argument("--worker-kills", type=int, default=4)
    parser.add_argument("--store-kills", type=int, default=4)
    parser.add_argument("--node-kills", type=int, default=2, help="half per placement")
    parser.add_argument("--damaged", type=int, default=500, help="randomly damaged files")
    parser.add_argument("--soak-minutes", type=float, default=0.0,
                        help="then a soak this long (benchmarks/soak_bench.py; 0: none)")
    parser.add_argument("--soak-hogs", type=int, default=0,
                        help="busy processes beside the soak")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    sessions_before = set(ray_sessions())
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    sessions = [Path(ray._private.worker._global_node.get_session_dir_path())]
    figures: Counter = Counter()
    details: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="fault_bench-") as tmp:
        root = Path(tmp)
        if args.driver_kills:
            driver_kills(root, max(1, args.driver_kills // 2), args.seed,
                         ray.get_runtime_context().gcs_address, figures, details)
            count_left("driver kills", sessions, details)
        worker_kills(root, args.worker_kills, rng, figures, details)
        count_left("train task kills", sessions, details)
        store_kills(root, args.store_kills, rng, figures, details)
        count_left("store kills", sessions, details)
        node_kills(root, args.node_kills, rng, figures, details, sessions)
        count_left("node removals", sessions, details)
        failing_writes(root, figures, details)
        count_left("failing writes", sessions, details)
        bad_inputs(root, args.damaged, rng, figures, details)
    ray.shutdown(wait_for_processes=True)  # its raylet reaped: no zombie keeps workers going
    count_left("the end", sessions, details)
    reports = crash_reports(sorted(set(ray_sessions()) - sessions_before))
    for report in reports:
        print(f"  crash: {report}")
    crashes = crashed_processes(reports)
    soaked = {"soak_hours": 0.0}
    if args.soak_minutes:
        soaked = soak(args.soak_minutes, args.seed, args.soak_hogs, round_minutes=5.0)
        figures["faults"] += soaked["faults"]
        figures["finished"] += soaked["runs"] - soaked["runs_failed"]
        figures["corrupt"] += soaked["checkpoints_corrupt"]
        figures["lost_or_doubled"] += soaked["edges_lost_or_doubled"]
        crashes += soaked["crashes"]
        count_left("the soak", sessions, details)
    readable = details["bad_inputs"].get("still_readable", 0)
    print(f"faults injected: {figures['faults']}")
    print(f"runs finished: {figures['finished']}")
    print(f"checkpoints found corrupt: {figures['corrupt']}")
    print(f"edges lost or doubled: {figures['lost_or_doubled']}")
    print(f"crashed processes: {crashes} (soak: {soaked['soak_hours']:.2f} hours)")
    left = details["left_running"]
    print(f"processes left running: {sum(left.values())} ("
          + ", ".join(f"after {part}: {n}" for part, n in left.items()) + ")")
    print(f"bad inputs tried: {figures['tried']}")
    print(f"bad inputs refused cleanly: {figures['refused']} (the other {readable} damaged "
          f"files stayed readable; {details['bad_inputs'].get('escaped', 0)} errors escaped)")
    print(json.dumps({
        "faults_injected": figures["faults"], "runs_finished": figures["finished"],
        "checkpoints_corrupt": figures["corrupt"], "edges_lost_or_doubled": figures["lost_or_doubled"],
        "crashes": crashes, "processes_left_running": sum(left.values()),
        "soak_hours": soaked["soak_hours"],
        "node_kills": details["node"]["kills"],
        "bad_inputs_tried": figures["tried"], "bad_inputs_refused_cleanly": figures["refused"],
        **details, "soak": soaked}))


if __name__ == "__main__":
    main()
