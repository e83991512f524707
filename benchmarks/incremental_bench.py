"""Incremental training vs retraining from scratch, on a generated graph grown by 10%.

A planted-community graph (pbg_ray.importer.demo.grown_graph) is imported and trained. Then it
grows by 10% new nodes and 10% new edges, each touching a new node, and is imported
against the old entity dictionary (importer.previous_entity_path). Three ways to a model
of the grown graph:

  frozen   init_path = the old checkpoint; only the new edges; old rows and relation
           parameters frozen (incremental.known_lr_scale=0)
  low_lr   the same with what the old model knows at 0.1 x lr
  retrain  from scratch over old + new edges, as many epochs as the old model had

Prints each one's training wall time (and the part of it the train tasks spent in the
kernel: the rest is mostly starting Ray's actor and worker processes, a fixed cost of
every run), and PBG's sampled MRR (1000 batch + 1000 uniform negatives) on held-out old
edges and on held-out edges of the new nodes, side by side; ends with one JSON line.

    python benchmarks/incremental_bench.py                             # 50,000 nodes, 1M edges
    python benchmarks/incremental_bench.py --nodes 5000 --edges 100000  # a quick run
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import ray

from pbg_ray.config import ConfigSchema
from pbg_ray.importer.demo import grown_graph
from pbg_ray.importer.graph_import import import_graph
from pbg_ray.training.trainer import Trainer

NPARTS = 2
COMMUNITY_SIZE = 10  # nodes per planted community


def write_tsv(path: Path, rows) -> str:
    path.write_text("".join(f"{l}\t{r}\t{h}\n" for l, r, h in rows))
    return str(path)


def base_config(dim: int, epochs: int) -> dict:
    return dict(
        entities={"node": {"num_partitions": NPARTS}},
        relations=[{"name": "link", "lhs": "node", "rhs": "node", "operator": "diagonal"}],
        dimension=dim, comparator="dot", loss_fn="softmax", global_emb=False, lr=0.1,
        batch_size=1000, num_batch_negs=50, num_uniform_negs=100, num_epochs=epochs,
        eval_fraction=0.0, ray={"num_trainers": 2})


def train(config: dict, test_paths: dict) -> dict:
    """Train `config` from its start; wall time and sampled MRR on each test path."""
    trainer = Trainer(ConfigSchema.from_dict(config))
    start = time.perf_counter()
    result = trainer.run()
    seconds = time.perf_counter() - start
    edges = sum(s["stats"]["count"] for s in result.bucket_stats)
    kernel = sum(s["timing"]["kernel_s"] for s in result.bucket_stats)
    return {"seconds": seconds, "kernel_seconds": kernel, "trained_edges": edges,
            **{f"mrr_{name}": trainer.evaluate(path)["mrr"] for name, path in test_paths.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=50_000)
    parser.add_argument("--edges", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="incremental_bench_"))
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    splits = grown_graph(args.nodes, args.edges, growth=0.1,
                         num_communities=args.nodes // COMMUNITY_SIZE)
    files = {name: write_tsv(work / f"{name}.tsv", rows) for name, rows in splits.items()}
    print(f"graph: {args.nodes:,} nodes, {args.edges:,} edges, grown by "
          f"{len(splits['new_train']) + len(splits['new_test']):,} edges touching "
          f"{args.nodes // 10:,} new nodes; d={args.dim}, {NPARTS} partitions, {args.epochs} "
          f"epochs; machine: {os.cpu_count()} CPUs", flush=True)
    base = base_config(args.dim, args.epochs)

    old = dict(base, entity_path=str(work / "day0/entities"), edge_paths=[str(work / "day0/train")],
               eval_edge_paths=[str(work / "day0/test")], checkpoint_path=str(work / "day0/ckpt"),
               importer={"inputs": [files["old_train"], files["old_test"]]})
    import_graph(ConfigSchema.from_dict(old))
    first = train(old, {"old": old["eval_edge_paths"][0]})
    print(f"old graph: trained in {first['seconds']:.1f} s, MRR {first['mrr_old']:.4f}", flush=True)

    # One import against the old dictionary: all edges (the old ones copied first), the new
    # ones alone, and both test sets, with the known nodes at their old places.
    day1 = {name: str(work / "day1" / name) for name in ("all", "new", "new_test", "old_test")}
    grown = dict(base, entity_path=str(work / "day1/entities"),
                 edge_paths=[day1["all"], day1["new"]],
                 eval_edge_paths=[day1["new_test"], day1["old_test"]],
                 checkpoint_path=str(work / "unused"),
                 importer={"inputs": [files["new_train"], files["new_train"], files["new_test"],
                                      files["old_test"]],
                           "previous_entity_path": old["entity_path"],
                           "previous_edge_paths": [old["edge_paths"][0]]})
    start = time.perf_counter()
    import_graph(ConfigSchema.from_dict(grown))
    import_seconds = time.perf_counter() - start
    grown.pop("importer")
    tests = {"old": day1["old_test"], "new": day1["new_test"]}
    update = dict(grown, edge_paths=[day1["new"]], init_path=old["checkpoint_path"])
    runs = {
        "frozen": dict(update, checkpoint_path=str(work / "frozen"),
                       incremental={"known_lr_scale": 0.0, "new_entity_edges_only": True}),
        "low_lr": dict(update, checkpoint_path=str(work / "low_lr"),
                       incremental={"known_lr_scale": 0.1}),
        "retrain": dict(grown, edge_paths=[day1["all"]], checkpoint_path=str(work / "retrain")),
    }
    figures = {"nodes": args.nodes, "edges": args.edges, "dim": args.dim, "epochs": args.epochs,
               "old_train_seconds": first["seconds"], "import_seconds": import_seconds}
    print(f"incremental import (all + new edges, both test sets): {import_seconds:.1f} s")
    print(f"{'method':<9} {'wall s':>8} {'kernel s':>9} {'edges trained':>14} {'MRR old':>9} "
          f"{'MRR new':>9}")
    for name, config in runs.items():
        figures[name] = train(config, tests)
        f = figures[name]
        print(f"{name:<9} {f['seconds']:>8.1f} {f['kernel_seconds']:>9.1f} {f['trained_edges']:>14,} "
              f"{f['mrr_old']:>9.4f} {f['mrr_new']:>9.4f}", flush=True)
    for name in ("frozen", "low_lr"):
        figures[f"{name}_speedup"] = figures["retrain"]["seconds"] / figures[name]["seconds"]
    print(f"speed-up over retraining: frozen {figures['frozen_speedup']:.1f}x, "
          f"low_lr {figures['low_lr_speedup']:.1f}x")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
