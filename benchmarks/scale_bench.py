"""Disk placement's memory as the table grows: the slope over table bytes and the fixed
footprint.

Trains one generated graph per table size (entities x 128 dimensions, 16 partitions,
the same edges count for each) with `ray.placement=disk`, `bucket_order=beta` and a
buffer of `--buffer` partitions per trainer, and prints per size: the whole process
tree's peak memory (PSS, sampled five times a second; see train_bench.PeakMemory) with
each role's share at the peak, training edges/s (of that sampled run), the share of
bucket time outside the kernel from the second epoch on, and partition reads and writes
per epoch beside what inside_out would read with the same buffer (the rule the trainer
keeps partitions by, simulated: scheduler.partition_reads) and beside BETA's lower
bound. At the smallest size it also trains inside_out, to measure its reads. The largest
size's checkpoint is then evaluated (filtered ranking of --eval-edges test edges of the
diagonal buckets against every entity; out of core as in training) with its process
tree's peak memory beside training's. Across
sizes: the least-squares slope of peak memory over table bytes (embeddings and
row-Adagrad sums, 4 * (dimension + 1) bytes per entity) and the fixed footprint that
line extrapolates to an empty table. Ends with one JSON line.

    python benchmarks/scale_bench.py            # 250k, 500k, 1M entities, 1M edges
    python benchmarks/scale_bench.py --full     # the issue's sizes: 2M, 4M, 8M, 4M edges
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from pbg_ray.io.edges import read_edges, write_edges
from pbg_ray.training.scheduler import bucket_order, partition_reads, reads_lower_bound
from pbg_ray.types import Bucket
from train_bench import (RUN_PBG_RAY, as_pbg_ray, bench_env, config_dict, generate, run_script,
                         train)

DIM = 128
NPARTS = 16
RUN_EVAL = """
import json, sys
from pbg_ray.config import ConfigSchema
from pbg_ray.evaluation.distributed import evaluate_checkpoint
report = evaluate_checkpoint(ConfigSchema.from_dict(json.loads(sys.argv[1])))
print("EVAL", json.dumps(report))
"""


def size_config(work: Path, num_entities: int, epochs: int, buffer: int, order: str) -> dict:
    """The disk-placement run of the graph of `num_entities`."""
    root = work / f"graph_{num_entities}"
    return as_pbg_ray(dict(config_dict(root, NPARTS, work / f"ckpt_{num_entities}_{order}", epochs),
                           dimension=DIM, bucket_order=order,
                           ray={"placement": "disk", "partition_buffer": buffer}))


def run_size(work: Path, num_entities: int, num_edges: int, epochs: int, buffer: int,
             order: str, env: dict, keep: bool = False) -> dict:
    """Train the graph of `num_entities` on disk once, sampled: its figures. `keep`: leave
    its checkpoint for evaluate_largest."""
    root = work / f"graph_{num_entities}"
    if not (root / "entities").is_dir():
        generate(root, num_entities, num_edges, NPARTS)
    cfg = size_config(work, num_entities, epochs, buffer, order)
    out, sampler = train(RUN_PBG_RAY, cfg, env, memory=True)
    if not keep:
        shutil.rmtree(cfg["checkpoint_path"], ignore_errors=True)
    seconds = float(re.search(r"TRAIN_SECONDS (\S+)", out).group(1))
    buckets = json.loads(re.search(r"TIMING (.*)", out).group(1))
    later = [b for b in buckets if b["epoch_idx"] >= 1] or buckets
    wall = sum(b["bucket_wall_s"] for b in later)
    per_epoch = [{name: sum(b.get(name, 0) for b in buckets if b["epoch_idx"] == e)
                  for name in ("reads", "writes")} for e in range(epochs)]
    return {"entities": num_entities, "table_bytes": num_entities * 4 * (DIM + 1),
            "order": order, "peak_pss_bytes": sampler.peak, "peak_pss_by_role": sampler.breakdown,
            "edges_per_s": num_edges * 0.99 * epochs / seconds,
            "outside_kernel_share_from_epoch_2": (wall - sum(b["kernel_s"] for b in later)) / wall,
            "partition_io_per_epoch": per_epoch}


def evaluate_largest(cfg: dict, num_edges: int, env: dict) -> dict:
    """Filtered ranking of a sample of `cfg`'s test edges (about num_edges, from the
    diagonal buckets: a task per bucket and candidate partition, each reading partitions of
    the whole table's size / P, so that P buckets make P^2 tasks, not P^3) against every
    entity, in a new process with its own Ray, sampled: its peak memory, filtered MRR and
    seconds. The checkpoint is removed after."""
    test = Path(cfg["edge_paths"][0]).with_name("test")
    sample = Path(cfg["checkpoint_path"]).with_name(f"{test.name}_sample")
    per_bucket = max(1, num_edges // NPARTS)
    rng = np.random.default_rng(0)
    for lhs in range(NPARTS):
        for rhs in range(NPARTS):
            edges = read_edges(test, Bucket(lhs, rhs))
            take = min(per_bucket, len(edges)) if lhs == rhs else 0
            write_edges(sample, Bucket(lhs, rhs),
                        edges[np.sort(rng.choice(len(edges), take, replace=False))])
    eval_cfg = dict(cfg, eval={"edge_paths": [str(sample)], "sampled": False,
                               "filtered": True, "per_relation": False})
    out, sampler = run_script(RUN_EVAL, eval_cfg, env, memory=True)
    shutil.rmtree(cfg["checkpoint_path"], ignore_errors=True)
    shutil.rmtree(sample, ignore_errors=True)
    report = json.loads(re.search(r"EVAL (.*)", out).group(1))
    overall = next(iter(report["metrics"].values()))
    return {"edges": overall["count"], "filtered_mrr": overall["filtered"]["mrr"],
            "seconds": report["time_s"], "peak_pss_bytes": sampler.peak,
            "peak_pss_by_role": sampler.breakdown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true",
                        help="the issue's sizes: 2M, 4M and 8M entities, 4M edges")
    parser.add_argument("--entities", type=int, nargs="+", default=None)
    parser.add_argument("--edges", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--buffer", type=int, default=4, help="ray.partition_buffer")
    parser.add_argument("--eval-edges", type=int, default=1000,
                        help="test edges ranked against every entity at the largest size")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    sizes = args.entities or ([2_000_000, 4_000_000, 8_000_000] if args.full
                              else [250_000, 500_000, 1_000_000])
    num_edges = args.edges or (4_000_000 if args.full else 1_000_000)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="scale_bench_"))
    env = bench_env()
    # Each pass's order as the scheduler draws it (the run's seed is 0).
    inside_out = [partition_reads(bucket_order("inside_out", NPARTS, NPARTS,
                                               random.Random(f"0/{epoch}")), args.buffer)
                  for epoch in range(args.epochs)]
    bound = reads_lower_bound(NPARTS, args.buffer)
    print(f"disk placement, {NPARTS} partitions, d={DIM}, {num_edges:,} edges, {args.epochs} "
          f"epochs, bucket_order=beta, ray.partition_buffer={args.buffer}; machine: "
          f"{os.cpu_count()} CPUs; a pass reads at least {bound} partitions with this buffer "
          f"(BETA's bound), inside_out's order {inside_out} (simulated)", flush=True)
    figures: dict = {"partitions": NPARTS, "dimension": DIM, "edges": num_edges,
                     "buffer": args.buffer, "reads_lower_bound": bound,
                     "inside_out_reads_simulated": inside_out, "sizes": []}
    for i, num_entities in enumerate(sizes):
        orders = ["beta", "inside_out"] if i == 0 else ["beta"]
        for order in orders:
            keep = i == len(sizes) - 1 and order == "beta"
            run = run_size(work, num_entities, num_edges, args.epochs, args.buffer, order, env,
                           keep)
            io = run["partition_io_per_epoch"]
            print(f"[{num_entities:,} x {DIM}, table {run['table_bytes'] / 2**20:,.0f} MiB, {order}] "
                  f"peak {run['peak_pss_bytes'] / 2**20:,.0f} MiB, {run['edges_per_s']:,.0f} edges/s, "
                  f"{100 * run['outside_kernel_share_from_epoch_2']:.1f}% of bucket time outside the "
                  f"kernel from epoch 2, partition reads per epoch {[e['reads'] for e in io]} "
                  f"(bound {bound}), writes {[e['writes'] for e in io]}", flush=True)
            print("    at the peak: " + ", ".join(
                f"{role} {b / 2**20:,.0f} MiB" for role, b in
                sorted(run["peak_pss_by_role"].items(), key=lambda kv: -kv[1])), flush=True)
            (figures["sizes"] if order == "beta" else figures.setdefault("inside_out", [])).append(run)
            if keep:
                ev = figures["eval_largest"] = evaluate_largest(
                    size_config(work, num_entities, args.epochs, args.buffer, order),
                    args.eval_edges, env)
                print(f"[{num_entities:,} x {DIM}, evaluation] filtered ranking of {ev['edges']:,} "
                      f"test edges against every entity: peak {ev['peak_pss_bytes'] / 2**20:,.0f} MiB "
                      f"(training's {run['peak_pss_bytes'] / 2**20:,.0f} MiB), filtered MRR "
                      f"{ev['filtered_mrr']:.4f}, {ev['seconds']:.1f} s", flush=True)
    table = np.array([r["table_bytes"] for r in figures["sizes"]], float)
    peak = np.array([r["peak_pss_bytes"] for r in figures["sizes"]], float)
    rates = [r["edges_per_s"] for r in figures["sizes"]]
    if len(table) < 2:
        print("one table size: no slope (--entities with two sizes or more)", flush=True)
    else:
        slope, fixed = np.polyfit(table, peak, 1)
        figures.update(slope=slope, fixed_footprint_bytes=fixed, slope_target=5 / NPARTS,
                       throughput_largest_vs_smallest=rates[-1] / rates[0])
        print(f"peak memory = {slope:.3f} x table bytes + {fixed / 2**20:,.0f} MiB (target slope "
              f"at most 5/P = {5 / NPARTS:.3f}); edges/s at the largest size "
              f"{100 * rates[-1] / rates[0]:.0f}% of the smallest's", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
