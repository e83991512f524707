"""Quality on WN18RR: PBG's recipe against pbg_ray's quality recipe (+training=quality).

WN18RR (Dettmers et al. 2018, the official split: ../shared/data/wn18rr/, with the published
figures in ../shared/data/README.md) run through the commands as a user runs them: a PBG
config file, `python -m pbg_ray.import_edges` (train, valid, test), `python -m pbg_ray.train`
with validation.edge_paths=[valid] (the best version kept in best/), then
`python -m pbg_ray.eval` of that best version on test, filtered (train, valid and test edges
filtered, both sides ranked). Entities first seen in valid or test are not in the training
graph (210 test edges name one); they count here as missed queries (reciprocal rank 0), as
they are for the published models, whose embeddings of them never trained.

Arms: `pbg` (PBG's recipe: the demo's model and training options, d=100, 10 epochs, 50
batch + 100 uniform negatives, a fixed number of epochs) and `quality` (+training=quality),
each on every partition count of --partitions (1 4: on 1 and on 4 partitions), in each
placement of --placement (memory, disk), with --beyond-bucket-negs N setting that key (0:
off; unset: the recipe's own, 0 for pbg, 2048 for quality) and --set KEY=VALUE ... adding
keys to every run; `tune` (not run by default): `python
-m pbg_ray.tune` of +training=quality with its default search (tune=asha: lr, dimension;
ASHA on the best validation MRR), --tune-samples trials one at a time on both CPUs, the
first of them the recipe itself (tune.config_first), then the best trial's best version
evaluated on test as the others are, on 1 partition. Prints a line per run (filtered MRR,
Hits@1/3/10, the epoch of the best version, training seconds; for tune, the best trial's
keys), then the partitions against MRR and training time as a table, and ends with one
JSON line.

    python benchmarks/wn18rr_bench.py
    python benchmarks/wn18rr_bench.py --arms quality --partitions 1 4
    python benchmarks/wn18rr_bench.py --arms quality --partitions 4 --placement disk
    python benchmarks/wn18rr_bench.py --arms pbg --partitions 1 4 --beyond-bucket-negs 100
    python benchmarks/wn18rr_bench.py --arms quality --partitions 4 --beyond-bucket-negs 16384 \
        --set beyond_batch_negs=2048 num_edge_chunks=4
    python benchmarks/wn18rr_bench.py --arms quality tune --tune-samples 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wn18rr"
SPLITS = ("train", "valid", "test")
# What each arm adds to the PBG config file on the command line (Hydra options and keys).
ARMS: Dict[str, List[str]] = {
    "pbg": ["+model=complex", "+training=default"],
    "quality": ["+training=quality"],
    "tune": ["+training=quality"],
}


def config_file(root: Path, relations: Sequence[str], partitions: int, quality: bool) -> Path:
    """A PBG config file of the graph under root: one entity type, complex_diagonal
    operators; for the quality recipe, the graph's part of it: reciprocal relations (PBG's
    dynamic relations, one relation schema for every relation type, each type with its own
    operator for each side) and every entity of the partition a negative (all_negs)."""
    schemas = ([{"name": "all", "lhs": "entity", "rhs": "entity", "all_negs": True,
                 "operator": "complex_diagonal"}] if quality else
               [{"name": r, "lhs": "entity", "rhs": "entity", "operator": "complex_diagonal"}
                for r in relations])
    config = {
        "entity_path": str(root / "data"),
        "edge_paths": [str(root / "data" / "train")],
        "checkpoint_path": str(root / "model"),
        "entities": {"entity": {"num_partitions": partitions}},
        "relations": schemas,
        "dynamic_relations": quality,
        "global_emb": False,
        "eval_fraction": 0.0,
    }
    path = root / "config.py"
    path.write_text(f"def get_torchbiggraph_config():\n    return {config!r}\n")
    return path


def command(name: str, args: Sequence[Any], root: Path) -> Dict[str, Any]:
    """`python -m pbg_ray.<name> ARGS`: its last line, as JSON (its whole output is kept in
    root/<name>.log); stops the benchmark with the command's error output when it fails."""
    proc = subprocess.run([sys.executable, "-m", f"pbg_ray.{name}", *map(str, args)],
                          capture_output=True, text=True)
    (root / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        sys.exit(f"python -m pbg_ray.{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_arm(name: str, partitions: int, placement: str, beyond: Optional[int],
            keys: Sequence[str], work: Path, data: Path, tune_samples: int) -> Dict[str, Any]:
    root = work / (f"{name}-{partitions}p-{placement}"
                   + ("" if beyond is None else f"-beyond{beyond}"))
    root.mkdir(parents=True)
    # One partition: one trainer, with both CPUs' Hogwild threads.
    options = ARMS[name] + ["ray.cpus_per_trainer=2"] * (partitions == 1) + [
        f"ray.placement={placement}"] + [f"beyond_bucket_negs={beyond}"] * (beyond is not None)
    options += keys
    relations = sorted({line.split("\t")[1] for line in (data / "train.txt").read_text().splitlines()})
    config = config_file(root, relations, partitions, quality=name != "pbg")
    inputs = ",".join(str(data / f"{split}.txt") for split in SPLITS)
    imported = command("import_edges", [
        config, *options, f"importer.inputs=[{inputs}]",
        f"eval_edge_paths=[{root}/data/valid,{root}/data/test]"], root)
    test = imported["inputs"][2]
    start = time.perf_counter()
    validation = f"validation.edge_paths=[{root}/data/valid]"
    searched: Dict[str, Any] = {}
    first_trial: Dict[str, Any] = {}
    if name == "tune":
        best = command("tune", [config, *options, validation, f"tune.num_samples={tune_samples}",
                                "tune.max_concurrent=1"], root)
        seconds = time.perf_counter() - start
        searched = best["config"]
        trained = {"best": {"epoch": best["metrics"].get("best_version")},
                   "version": best["version"], "checkpoint_path": best["checkpoint_path"]}
        # The first trial trained the recipe as it is (tune.config_first): on test too.
        recipe = f"{root}/model-{best['trial_id'].rsplit('_', 1)[0]}_00000"
        first_trial = scored_on_test(config, options + [f"checkpoint_path={recipe}"], root, test)
        # The best trial's run: its checkpoint and its sampled keys.
        options = options + [f"checkpoint_path={best['checkpoint_path']}"] + [
            f"{key}={value}" for key, value in searched.items()]
    else:
        trained = command("train", [config, *options, validation], root)
        seconds = time.perf_counter() - start
    best = trained.get("best", {})
    return {"arm": name, "partitions": partitions, "placement": placement,
            "beyond_bucket_negs": beyond, "options": options,
            **scored_on_test(config, options, root, test), "best_epoch": best.get("epoch"),
            "epochs_trained": epochs_of(Path(trained["checkpoint_path"])),
            "train_seconds": round(seconds, 1),
            "searched": searched, "tune_samples": tune_samples if name == "tune" else None,
            "first_trial": first_trial}


def epochs_of(checkpoint: Path) -> int:
    """The epochs a checkpoint trained, from its training_stats.json lines (a version is a
    pass over one edge chunk of one edge path, so versions count epochs only with one of
    each)."""
    with open(checkpoint / "training_stats.json") as lines:
        return 1 + max(json.loads(line)["epoch_idx"] for line in lines)


def scored_on_test(config: Path, options: Sequence[str], root: Path, test: Dict[str, Any]
                 ) -> Dict[str, Any]:
    """Filtered ranking of the test split by the best version `options` name, the test
    edges naming an entity training never saw counted as misses."""
    report = command("eval", [config, *options, "eval.sampled=false", "eval.per_relation=false",
                              f"eval.edge_paths=[{root}/data/test]",
                              f"eval.filter_paths=[{root}/data/train,{root}/data/valid,"
                              f"{root}/data/test]"], root)
    kept = test["edges"] / (test["edges"] + test["dropped_unseen"])
    filtered = report["metrics"]["all"]["filtered"]
    return {"mrr": filtered["mrr"] * kept, "hits@1": filtered["hits@1"] * kept,
            "hits@3": filtered["hits@3"] * kept, "hits@10": filtered["hits@10"] * kept,
            "mrr_of_ranked_edges": filtered["mrr"], "test_edges_ranked": test["edges"],
            "test_edges_unseen": test["dropped_unseen"], "version_evaluated": report["version"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the WN18RR directory")
    parser.add_argument("--arms", nargs="+", default=["pbg", "quality"], choices=list(ARMS))
    parser.add_argument("--partitions", type=int, nargs="+", default=[1],
                        help="partition counts of the pbg and quality arms (tune runs on 1)")
    parser.add_argument("--placement", nargs="+", default=["memory"], choices=["memory", "disk"],
                        help="ray.placement of each run (tune runs in memory)")
    parser.add_argument("--beyond-bucket-negs", type=int, default=None,
                        help="beyond_bucket_negs of every run (unset: the recipe's own)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="more config keys of every run (Hydra overrides)")
    parser.add_argument("--tune-samples", type=int, default=4,
                        help="trials of the tune arm (the first is the recipe itself)")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    missing = [s for s in SPLITS if not (args.data / f"{s}.txt").is_file()]
    if missing:
        sys.exit(f"{args.data} lacks {', '.join(f'{s}.txt' for s in missing)}: give the WN18RR "
                 "directory with --data")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="wn18rr-"))
    results = []
    runs = [(name, partitions, placement) for name in args.arms
            for partitions in (args.partitions if name != "tune" else [1])
            for placement in (args.placement if name != "tune" else ["memory"])]
    for name, partitions, placement in runs:
        result = run_arm(name, partitions, placement, args.beyond_bucket_negs, args.set, work,
                         args.data, args.tune_samples)
        results.append(result)
        print(f"{name:8s} {partitions}p {placement:6s}  MRR {result['mrr']:.4f}  Hits@1 {result['hits@1']:.4f}  "
              f"Hits@3 {result['hits@3']:.4f}  Hits@10 {result['hits@10']:.4f}  best epoch "
              f"{result['best_epoch']} of {result['epochs_trained']}  train "
              f"{result['train_seconds']:.0f} s"
              + "".join(f"  {k}={v:.4g}" if isinstance(v, float) else f"  {k}={v}"
                        for k, v in result["searched"].items()), flush=True)
        if result["first_trial"]:
            print(f"{'':8s}    its first trial, the recipe as it is: MRR "
                  f"{result['first_trial']['mrr']:.4f}  Hits@10 "
                  f"{result['first_trial']['hits@10']:.4f}", flush=True)
    print(f"\n{'arm':8s} {'partitions':>10s}  {'placement':9s}  {'beyond':>6s}  {'MRR':>6s}  "
          f"{'Hits@10':>7s}  {'train s':>7s}")
    for r in results:
        beyond = "recipe" if r["beyond_bucket_negs"] is None else str(r["beyond_bucket_negs"])
        print(f"{r['arm']:8s} {r['partitions']:10d}  {r['placement']:9s}  {beyond:>6s}  "
              f"{r['mrr']:6.4f}  {r['hits@10']:7.4f}  {r['train_seconds']:7.0f}")
    print(json.dumps({"benchmark": "wn18rr", "data": str(args.data), "results": results}))


if __name__ == "__main__":
    main()
