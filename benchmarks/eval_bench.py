"""Filtered full ranking speed: 10,000 test edges ranked on both sides against 100,000
entities at d=100 (dot comparator, one partition), 100,000 known training edges filtered.
With --partitions P and --placement disk, the same out of core: the entities in P
partitions, the edges in P x P buckets, each task reading the partitions it needs from the
checkpoint. With --relations R --operator OP, a model of R relations whose rhs goes
through OP (its parameters drawn near the operator's initial value), the edges' relations
drawn uniformly: each relation's candidates are transformed and ranked apart. --known-edges
sets the training edges filtered (default: 10 per test edge).

Prints ranked queries per second (one query = one side of one edge, so 20,000 queries),
the matmul FLOP rate they imply (2·d per candidate score) and its fraction of the
machine's measured float32 matmul rate (torch.mm, all cores). The timed run is
`python -m pbg_ray.eval`'s whole evaluation (partition loading, Ray tasks, filtering),
after one warm-up run that starts Ray's workers. Ends with one JSON line.

    python benchmarks/eval_bench.py
    python benchmarks/eval_bench.py --entities 20000 --edges 2000    # a quick run
    python benchmarks/eval_bench.py --entities 20000000 --edges 1000 --partitions 32 \
        --placement disk --relations 4 --operator complex_diagonal     # big_bench's ranking
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import ray
import torch

from pbg_ray.checkpoints.directory import CheckpointStorage
from pbg_ray.config import ConfigSchema
from pbg_ray.evaluation.distributed import evaluate_checkpoint
from pbg_ray.io.edges import write_edges
from pbg_ray.io.entities import save_entity_count
from pbg_ray.model.params import param_layout
from pbg_ray.types import Bucket, EdgeList

DIM = 100


def matmul_rate(threads: int, size: int = 2048, repeats: int = 7) -> float:
    """Median GFLOP/s of a float32 size x size matmul on `threads` threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * size ** 3 / float(np.median(times)) / 1e9


def build(root: Path, num_entities: int, num_edges: int, partitions: int, placement: str,
          relations: int = 1, operator: str = "none", known_edges: Optional[int] = None,
          seed: int = 0) -> ConfigSchema:
    rng = np.random.default_rng(seed)
    size = num_entities // partitions
    for part in range(partitions):
        save_entity_count(root / "entities", "node", part, size)
    known = 10 * num_edges if known_edges is None else known_edges
    for split, n in (("train", known), ("test", num_edges)):
        # Each edge's bucket uniform: the buckets' sizes drawn at once.
        sizes = rng.multinomial(n, np.full(partitions ** 2, partitions ** -2.0))
        for lhs in range(partitions):
            for rhs in range(partitions):
                m = int(sizes[lhs * partitions + rhs])
                write_edges(root / split, Bucket(lhs, rhs), EdgeList(
                    rng.integers(size, size=m), rng.integers(size, size=m),
                    rng.integers(relations, size=m)))
    config = ConfigSchema.from_dict(dict(
        entities={"node": {"num_partitions": partitions}},
        relations=[{"name": f"link{r}", "lhs": "node", "rhs": "node", "operator": operator}
                   for r in range(relations)],
        dimension=DIM, comparator="dot", global_emb=False, entity_path=str(root / "entities"),
        edge_paths=[str(root / "train")], eval_edge_paths=[str(root / "test")],
        checkpoint_path=str(root / "checkpoints"), ray={"placement": placement},
        eval={"sampled": False, "per_relation": False}))
    storage = CheckpointStorage(config.checkpoint_path)
    storage.prepare()
    storage.save_config(config)
    for part in range(partitions):
        embs = rng.standard_normal((size, DIM), dtype=np.float32)
        storage.save_entity_partition(1, "node", part, embs, None)
    storage.save_model(1, {k: v + rng.normal(0, 0.1, v.shape).astype(np.float32)
                           for k, v in param_layout(config, relations)}, None)
    storage.save_version(1)
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entities", type=int, default=100_000)
    parser.add_argument("--edges", type=int, default=10_000)
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--placement", choices=["memory", "disk"], default="memory")
    parser.add_argument("--relations", type=int, default=1)
    parser.add_argument("--operator", default="none", help="each relation's rhs operator")
    parser.add_argument("--known-edges", type=int, default=None,
                        help="training edges filtered (default: 10 per test edge)")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    args.entities -= args.entities % args.partitions
    cores = os.cpu_count() or 1
    peak = matmul_rate(cores)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        config = build(Path(tmp), args.entities, args.edges, args.partitions, args.placement,
                       args.relations, args.operator, args.known_edges)
        ray.init(num_cpus=cores, include_dashboard=False, logging_level="WARNING")
        load_1 = os.getloadavg()[0]
        evaluate_checkpoint(config)  # warm-up: starts the workers
        start = time.perf_counter()
        report = evaluate_checkpoint(config)
        elapsed = time.perf_counter() - start
        load_2 = os.getloadavg()[0]
        ray.shutdown()
    queries = 2 * args.edges
    qps = queries / elapsed
    gflops = qps * 2 * DIM * args.entities / 1e9
    result = {
        "edges": args.edges, "entities": args.entities, "dimension": DIM, "queries": queries,
        "partitions": args.partitions, "placement": args.placement,
        "relations": args.relations, "operator": args.operator,
        "known_edges": args.known_edges or 10 * args.edges,
        "seconds": round(elapsed, 3), "queries_per_s": round(qps), "ranking_gflops": round(gflops, 1),
        "matmul_gflops": round(peak, 1), "fraction_of_matmul": round(gflops / peak, 3),
        "cores": cores, "load_average_1min": [round(load_1, 2), round(load_2, 2)],
        "filtered_mrr": report["metrics"]["all"]["filtered"]["mrr"], "target_queries_per_s": 5000,
    }
    print(f"filtered ranking: {queries} queries ({args.edges} edges x 2 sides) against "
          f"{args.entities} entities in {args.partitions} partition(s), {args.placement} "
          f"placement, d={DIM}, {args.relations} relation(s) ({args.operator}): "
          f"{elapsed:.2f} s, {qps:,.0f} queries/s")
    print(f"matmul: {gflops:.1f} GFLOP/s of a measured {peak:.1f} GFLOP/s on {cores} cores "
          f"({100 * gflops / peak:.0f}%); load average {load_1:.2f} -> {load_2:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
