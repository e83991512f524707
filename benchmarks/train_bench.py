"""pbg_ray's engine vs torchbiggraph 1.0.0 on the same generated graph, same config.

Prints, per setting (1 and 4 partitions in memory, 8 partitions in disk mode):
training edges/s for both, their ratio, peak memory (PSS of the whole process
tree: Ray's processes for pbg_ray, the Hogwild workers for torchbiggraph), the
share of pbg_ray's bucket time spent outside the kernel, and the MRR of both
checkpoints on the same held-out edges (both scored by the same evaluator). Disk mode
trains 3 epochs (--disk-epochs) and prints that share per pass as well: its first
pass creates every partition's file and the second the next version's, while later
passes write over the files of the version they superseded.
Then the disk-vs-memory peak once more on tables that dominate the run's memory
(5M x 100 by default, 1M edges), where disk placement's bound shows (at 1M x 100 the
processes' fixed footprint outweighs the table). Ends with one JSON line holding all
the figures.

Each trainer trains each setting twice: once sampled for peak memory, then once
timed with nothing watching it, whose checkpoint is scored. (Sampling the PSS of
every process reads its page tables, which slows both trainers on a small machine, and
more the one with more processes.)

    python benchmarks/train_bench.py                 # 1M entities, 10M edges
    python benchmarks/train_bench.py --scale 0.05    # a quick run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Tuple

import numpy as np
import psutil

from pbg_ray.io.edges import write_edges
from pbg_ray.io.entities import save_entity_count, save_relation_names
from pbg_ray.types import Bucket, EdgeList

DIM = 100


def generate(root: Path, num_entities: int, num_edges: int, nparts: int, seed: int = 0,
             num_relations: int = 1, community: int = 1000) -> None:
    """One entity type, planted communities of ~`community` nodes (90% of edges end in
    the community their relation leads to), partitioned into `nparts`; 1% of edges held
    out in test/. Relation r leads from community c to community c + r * step (a knowledge
    graph's relations: each maps one group onto another; relation 0 stays inside)."""
    rng = np.random.default_rng(seed)
    num_comm = max(1, num_entities // community)
    comm = rng.integers(num_comm, size=num_entities)
    members = np.argsort(comm, kind="stable")
    starts = np.searchsorted(comm[members], np.arange(num_comm + 1))
    src = rng.integers(num_entities, size=num_edges)
    c = comm[src]
    rel = np.zeros(num_edges, np.int64)
    if num_relations > 1:
        rel = rng.integers(num_relations, size=num_edges)
        c = (c + rel * max(1, num_comm // num_relations)) % num_comm
    dst = members[starts[c] + (rng.random(num_edges) * (starts[c + 1] - starts[c])).astype(np.int64)]
    noise = rng.random(num_edges) < 0.1
    dst[noise] = rng.integers(num_entities, size=int(noise.sum()))
    # Partitioning as PBG's importer does: a seeded shuffle, then contiguous ranges.
    order = rng.permutation(num_entities)
    part = np.empty(num_entities, np.int64)
    offset = np.empty(num_entities, np.int64)
    bounds = np.linspace(0, num_entities, nparts + 1).astype(np.int64)
    for p in range(nparts):
        ids = order[bounds[p]:bounds[p + 1]]
        part[ids], offset[ids] = p, np.arange(len(ids))
        save_entity_count(root / "entities", "node", p, len(ids))
    save_relation_names(root / "entities", relation_names(num_relations))
    is_test = rng.random(num_edges) < 0.01
    for split, mask in (("train", ~is_test), ("test", is_test)):
        s, d, r = src[mask], dst[mask], rel[mask]
        key = part[s] * nparts + part[d]
        by_bucket = np.argsort(key, kind="stable")
        bucket_starts = np.searchsorted(key[by_bucket], np.arange(nparts * nparts + 1))
        for b in range(nparts * nparts):
            idx = by_bucket[bucket_starts[b]:bucket_starts[b + 1]]
            write_edges(root / split, Bucket(b // nparts, b % nparts),
                        EdgeList(offset[s[idx]], offset[d[idx]], r[idx]))


def relation_names(num_relations: int) -> list:
    return ["link"] if num_relations == 1 else [f"rel{i}" for i in range(num_relations)]


def config_dict(root: Path, nparts: int, checkpoint: Path, epochs: int,
                num_relations: int = 1) -> dict:
    """The run both programs train, in PBG's keys (setting A: PBG's CPU defaults)."""
    return dict(
        entities={"node": {"num_partitions": nparts}},
        relations=[{"name": name, "lhs": "node", "rhs": "node", "operator": "complex_diagonal"}
                   for name in relation_names(num_relations)],
        dimension=DIM, comparator="dot", loss_fn="softmax", global_emb=False,
        num_batch_negs=50, num_uniform_negs=100, batch_size=1000, lr=0.1, num_epochs=epochs,
        eval_fraction=0.0, bucket_order="inside_out", workers=2,
        entity_path=str(root / "entities"), edge_paths=[str(root / "train")],
        checkpoint_path=str(checkpoint))


# Markers in a process's command line -> its role: pbg_ray's workers and actors, then Ray's
# own processes.
ROLES = (("train_bucket_task", "train worker"), ("evaluate_bucket_task", "train worker (evaluating)"),
         ("PartitionStore", "partition store"),
         ("ParameterServer", "parameter server"), ("BucketSchedulerActor", "scheduler"),
         ("gcs_server", "Ray: gcs_server"), ("raylet/raylet", "Ray: raylet"),
         ("DashboardAgent", "Ray: dashboard agent"), ("RuntimeEnvAgent", "Ray: runtime env agent"),
         ("dashboard/dashboard.py", "Ray: dashboard (API server)"),
         ("log_monitor.py", "Ray: log monitor"), ("autoscaler/_private/monitor.py", "Ray: autoscaler monitor"))
# The variable that train and eval tasks' workers start with (model/kernel.py's KERNEL_ENV),
# which tells one of them between two tasks from a plain idle worker.
KERNEL_WORKER_VARIABLE = "MALLOC_MMAP_THRESHOLD_"


def role(proc: psutil.Process) -> str:
    """What a process of the run is, for the memory breakdown."""
    cmdline = proc.cmdline()
    name = " ".join(cmdline)
    for marker, role_name in ROLES:
        if marker in name:
            return role_name
    if "ray::IDLE" in name:
        try:
            kernel_worker = KERNEL_WORKER_VARIABLE in proc.environ()
        except psutil.Error:
            kernel_worker = False
        return "train worker (between tasks)" if kernel_worker else "idle workers"
    return "other: " + (Path(cmdline[0]).name if cmdline else proc.name())


class PeakMemory:
    """Peak of the summed PSS of a process and all its descendants, sampled five times a second;
    `breakdown` holds the PSS per role at that peak, `processes` each process's (role, pid,
    PSS) at that peak, largest first."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak = 0
        self.breakdown: dict = {}
        self.processes: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            found = []
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except psutil.Error:
                break
            for proc in procs:
                try:
                    pss = proc.memory_full_info().pss
                    key = "driver" if proc.pid == self.root.pid else role(proc)
                except psutil.Error:
                    continue
                found.append((key, proc.pid, pss))
            total = sum(pss for _, _, pss in found)
            if total > self.peak:
                self.peak = total
                self.processes = sorted(found, key=lambda p: -p[2])
                self.breakdown = {}
                for key, _, pss in found:
                    self.breakdown[key] = self.breakdown.get(key, 0) + pss
            time.sleep(0.2)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


# torchbiggraph 1.0.0 predates Python 3.9's typing: its check for Optional[X]
# compares by identity and fails, so ConfigSchema.to_dict() raises. The shim
# below answers the same question with typing.get_origin / get_args.
RUN_PBG = """
import json, sys, time, typing
import torchbiggraph.schema
def unpack_optional(type_):
    args = typing.get_args(type_)
    if typing.get_origin(type_) is typing.Union and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None))
    raise TypeError("Not an optional type")
torchbiggraph.schema.unpack_optional = unpack_optional
from torchbiggraph.config import parse_config
from torchbiggraph.train import train
from torchbiggraph.util import setup_logging
setup_logging()
config = parse_config(json.loads(sys.argv[1]))
t = time.perf_counter()
train(config)
print("TRAIN_SECONDS", time.perf_counter() - t)
"""

RUN_PBG_RAY = """
import json, sys, time
from pbg_ray.config import ConfigSchema
from pbg_ray.runtime.connect import connect_ray
from pbg_ray.training.trainer import Trainer
config = ConfigSchema.from_dict(json.loads(sys.argv[1]))
connect_ray(config.ray)  # the local Ray `python -m pbg_ray.train` starts
t = time.perf_counter()
result = Trainer(config).run()
seconds = time.perf_counter() - t
timing = [dict(s["timing"], epoch_idx=s["epoch_idx"], start=s["worker"]["start"],
               end=s["worker"]["end"], **s.get("partition_io", {}), **s.get("device_io", {}))
          for s in result.bucket_stats]
print("TRAIN_SECONDS", seconds)
print("TIMING", json.dumps(timing))
"""


def train(script: str, config: dict, env: dict, memory: bool) -> Tuple[str, Optional[PeakMemory]]:
    """Train `config` from scratch in a new process: (its output, its PeakMemory if `memory`)."""
    shutil.rmtree(config["checkpoint_path"], ignore_errors=True)
    return run_script(script, config, env, memory)


def run_script(script: str, config: dict, env: dict, memory: bool
               ) -> Tuple[str, Optional[PeakMemory]]:
    """`script` run on `config` in a new process: (its output, its PeakMemory if `memory`)."""
    proc = subprocess.Popen([sys.executable, "-c", script, json.dumps(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = PeakMemory(proc.pid) if memory else None
    out, _ = proc.communicate()
    if sampler is not None:
        sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"run failed:\n{out[-4000:]}")
    return out, sampler


def run(script: str, config: dict, env: dict) -> dict:
    """Peak memory of a sampled run, then seconds (and bucket timing) of an unobserved one."""
    _, sampler = train(script, config, env, memory=True)
    out, _ = train(script, config, env, memory=False)
    seconds = float(re.search(r"TRAIN_SECONDS (\S+)", out).group(1))
    result = {"seconds": seconds, "peak_pss_bytes": sampler.peak, "peak_pss_by_role": sampler.breakdown}
    timing = re.search(r"TIMING (.*)", out)
    if timing:
        buckets = json.loads(timing.group(1))
        result["outside_kernel_share"] = outside_kernel_share(buckets)
        result["outside_kernel_share_by_epoch"] = [
            outside_kernel_share([t for t in buckets if t["epoch_idx"] == epoch])
            for epoch in sorted({t["epoch_idx"] for t in buckets})]
    return result


def outside_kernel_share(buckets: list) -> float:
    """The share of the buckets' wall time (launch to results applied) outside the kernel."""
    wall = sum(t["bucket_wall_s"] for t in buckets)
    return (wall - sum(t["kernel_s"] for t in buckets)) / wall


def blas_kernels(env: dict) -> str:
    """The BLAS library and kernels numpy uses in a process started with `env`."""
    script = ("from threadpoolctl import threadpool_info; import numpy; print(', '.join("
              "f\"{i['internal_api']} {i.get('architecture')}\" for i in threadpool_info() "
              "if i['user_api'] == 'blas'))")
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def as_pbg_ray(config: dict) -> dict:
    """`config` as pbg_ray trains it: PBG's `workers` (which pbg_ray ignores, with a
    warning) as one train task of that many Hogwild threads, on a local Ray of that many
    CPUs (as many as torchbiggraph's workers, on a machine of any size)."""
    ours_cfg = {k: v for k, v in config.items() if k != "workers"}
    threads = config["workers"]
    return dict(ours_cfg, ray={**config.get("ray", {}), "cpus_per_trainer": float(threads),
                               "num_cpus": threads})


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """A Ray of its own (never another one running on the machine), shut down after: even
    idle, its processes take CPU from the next runs."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()


def mrr(config: dict, version: int, test_path: str) -> float:
    """Sampled MRR (PBG's, 1000 batch + 1000 uniform negatives) of a checkpoint on test/."""
    from pbg_ray.config import ConfigSchema
    from pbg_ray.training.trainer import Trainer

    config = ConfigSchema.from_dict(dict(config, num_epochs=version, num_edge_chunks=1))
    with local_ray():
        return Trainer(config).evaluate(test_path)["mrr"]


def bench_env() -> dict:
    """The environment both trainers run in. Some machines of this workplace pin OpenBLAS
    to its AVX2 (Haswell) kernels for the sake of old OpenBLAS builds; numpy's current one
    picks its kernels itself, as it does on a user's machine: both run without the pin."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of 1M entities / 10M edges")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--disk-epochs", type=int, default=3, help="epochs of the 8-partition disk run")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--settings", nargs="+", default=["1p_memory", "4p_memory", "8p_disk"],
                        help="which of 1p_memory, 4p_memory, 8p_disk to train")
    parser.add_argument("--table-entities", type=int, default=5_000_000,
                        help="entities of the large-table disk-vs-memory peak (0: skip it)")
    args = parser.parse_args()
    num_entities, num_edges = int(1_000_000 * args.scale), int(10_000_000 * args.scale)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="train_bench_"))
    env = bench_env()
    print(f"graph: {num_entities:,} entities, {num_edges:,} edges, d={DIM}, "
          f"complex_diagonal/dot/softmax, 50 batch + 100 uniform negatives, {args.epochs} epoch(s) "
          f"({args.disk_epochs} in disk mode); "
          f"machine: {os.cpu_count()} CPUs, numpy's BLAS: {blas_kernels(env)}")
    figures: dict = {}
    for nparts, placement in ((1, "memory"), (4, "memory"), (8, "disk")):
        name = f"{nparts}p_{placement}"
        if name not in args.settings:
            continue
        root = work / f"graph_{nparts}"
        if not (root / "entities").is_dir():
            generate(root, num_entities, num_edges, nparts)
        epochs = args.epochs if placement == "memory" else args.disk_epochs
        train_edges = num_edges * 0.99 * epochs
        ours_cfg = as_pbg_ray(dict(config_dict(root, nparts, work / f"ckpt_ours_{name}", epochs),
                             ray={"placement": placement}))
        ours = run(RUN_PBG_RAY, ours_cfg, env)
        ours["edges_per_s"] = train_edges / ours["seconds"]
        ours["mrr"] = mrr(ours_cfg, epochs, str(root / "test"))
        by_epoch = ours["outside_kernel_share_by_epoch"]
        per_pass = (" (per pass: " + ", ".join(f"{100 * x:.1f}%" for x in by_epoch) + ")"
                    if len(by_epoch) > 1 else "")
        line = (f"[{name}] pbg_ray: {ours['edges_per_s']:,.0f} edges/s, peak {ours['peak_pss_bytes'] / 2**20:,.0f} MiB, "
                f"{100 * ours['outside_kernel_share']:.1f}% of bucket time outside the kernel{per_pass}, "
                f"MRR {ours['mrr']:.4f} after {epochs} epoch(s)")
        figures[name] = {"pbg_ray": ours}
        if placement == "memory":
            peer_cfg = config_dict(root, nparts, work / f"ckpt_peer_{name}", args.epochs)
            peer = run(RUN_PBG, peer_cfg, env)
            peer["edges_per_s"] = train_edges / peer["seconds"]
            peer["mrr"] = mrr(peer_cfg, args.epochs, str(root / "test"))
            figures[name]["torchbiggraph"] = peer
            figures[name]["ratio"] = ours["edges_per_s"] / peer["edges_per_s"]
            line += (f"\n[{name}] torchbiggraph 1.0.0: {peer['edges_per_s']:,.0f} edges/s, peak "
                     f"{peer['peak_pss_bytes'] / 2**20:,.0f} MiB, MRR {peer['mrr']:.4f}\n"
                     f"[{name}] ratio pbg_ray / torchbiggraph: {figures[name]['ratio']:.2f}x edges/s, "
                     f"MRR difference {ours['mrr'] - peer['mrr']:+.4f}")
        print(line, flush=True)
    if {"1p_memory", "8p_disk"} <= figures.keys():
        disk_share = (figures["8p_disk"]["pbg_ray"]["peak_pss_bytes"]
                      / figures["1p_memory"]["pbg_ray"]["peak_pss_bytes"])
        figures["disk_8p_peak_vs_memory_1p"] = disk_share
        print(f"disk mode, 8 partitions: peak memory {100 * disk_share:.0f}% of the all-in-memory run")
    for name in sorted(figures.keys() & {"1p_memory", "8p_disk"}):
        roles = figures[name]["pbg_ray"]["peak_pss_by_role"]
        print(f"  pbg_ray {name} at its peak: " + ", ".join(
            f"{r} {b / 2**20:,.0f} MiB" for r, b in sorted(roles.items(), key=lambda kv: -kv[1])))
    if args.table_entities:
        figures["large_tables"] = large_tables(work, args.table_entities, env)
    print(json.dumps(figures))


def large_tables(work: Path, num_entities: int, env: dict) -> dict:
    """The disk-vs-memory peak on tables large enough to dominate the run's memory
    (num_entities x DIM, 1M edges): at 1M x 100 the processes' fixed footprint (Ray's
    own, the driver, each actor's and worker's imports) outweighs the 400 MB table."""
    figures: dict = {}
    for nparts, placement in ((1, "memory"), (8, "disk")):
        root = work / f"large_graph_{nparts}"
        if not (root / "entities").is_dir():
            generate(root, num_entities, 1_000_000, nparts)
        checkpoint = work / f"ckpt_large_{nparts}p_{placement}"
        cfg = as_pbg_ray(dict(config_dict(root, nparts, checkpoint, 1),
                              ray={"placement": placement}))
        _, sampler = train(RUN_PBG_RAY, cfg, env, memory=True)
        shutil.rmtree(cfg["checkpoint_path"])
        figures[f"{nparts}p_{placement}"] = {"peak_pss_bytes": sampler.peak,
                                             "peak_pss_by_role": sampler.breakdown}
    share = figures["8p_disk"]["peak_pss_bytes"] / figures["1p_memory"]["peak_pss_bytes"]
    figures["disk_8p_peak_vs_memory_1p"] = share
    table_mib = num_entities * DIM * 4 / 2**20
    print(f"[tables of {num_entities:,} x {DIM} ({table_mib:,.0f} MiB), 1M edges] disk mode, 8 partitions: "
          f"peak {figures['8p_disk']['peak_pss_bytes'] / 2**20:,.0f} MiB = {100 * share:.0f}% of the "
          f"all-in-memory run's {figures['1p_memory']['peak_pss_bytes'] / 2**20:,.0f} MiB", flush=True)
    return figures


if __name__ == "__main__":
    main()
