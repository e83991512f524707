"""int8 model bundles against fp32 on the demo graph: size and filtered MRR.

Trains the built-in demo graph with `python -m pbg_ray.train` (a rerun finds the
checkpoint complete and trains nothing), writes one bundle with the newest version at
fp32 and int8 (`python -m pbg_ray.export export.format=bundle`, which prints both
sizes), then runs the filtered evaluation of `python -m pbg_ray.eval` (both sides ranked
against every entity of the type, training and test edges filtered) on the test edges
for each tag, and PBG's sampled metrics (1,000 negatives per side), which resolve ranks
within the planted communities that filtered ranking can't (the demo's targets are drawn
at random inside a community of ~400 users or ~200 items, so an ideal model's filtered
MRR is only ~0.017). Prints sizes, ratio and MRRs; ends with one JSON line.

    python benchmarks/bundle_bench.py
    python benchmarks/bundle_bench.py --work-dir /tmp/bench --epochs 2   # a quicker model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from pbg_ray.checkpoints import bundle
from pbg_ray.checkpoints.storage import CheckpointStorage
from pbg_ray.config.eval import EvalConfig
from pbg_ray.engine.evaluator import evaluate_checkpoint
from pbg_ray.importer.demo import cache_dir

TAGS = ("fp32", "int8")


def pbg_ray(command: str, *overrides: str) -> str:
    """Run `python -m pbg_ray.<command> overrides...`; its stdout (stderr passes through)."""
    done = subprocess.run([sys.executable, "-m", f"pbg_ray.{command}", *overrides],
                          stdout=subprocess.PIPE, text=True, check=True)
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=str(cache_dir() / "bundle-bench"),
                        help="where the demo checkpoint is trained (and found again)")
    parser.add_argument("--epochs", type=int, default=None, help="num_epochs (default: the demo's)")
    args = parser.parse_args()
    work = Path(args.work_dir).absolute()
    checkpoint = work / "checkpoints"
    common = [f"checkpoint_path={checkpoint}", f"hydra.run.dir={work / 'hydra'}"]
    if args.epochs is not None:
        common.append(f"num_epochs={args.epochs}")

    start = time.perf_counter()
    pbg_ray("train", *common)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    printed = pbg_ray("export", *common, "export.format=bundle", "export.variants=[fp32,int8]",
                      f"export.output={work / 'export'}").splitlines()
    export_s = time.perf_counter() - start
    print("\n".join(printed[:-1]))  # the export's own size lines
    exported = json.loads(printed[-1])
    sizes = {t["precision"]: t["bytes"] for t in exported["tags"]}
    tags = {t["precision"]: t["tag"] for t in exported["tags"]}

    config = CheckpointStorage(checkpoint).load_config()
    config = dataclasses.replace(config, eval=EvalConfig(per_relation=False))
    mrr, hits10, sampled, eval_s = {}, {}, {}, {}
    for precision in TAGS:
        with bundle.load(exported["file"], tags[precision]) as model:
            storage = model.to_checkpoint(work / "tags" / tags[precision])
        start = time.perf_counter()
        report = evaluate_checkpoint(dataclasses.replace(config, checkpoint_path=str(storage.path)))
        eval_s[precision] = round(time.perf_counter() - start, 1)
        mrr[precision] = report["metrics"]["all"]["filtered"]["mrr"]
        hits10[precision] = report["metrics"]["all"]["filtered"]["hits@10"]
        sampled[precision] = report["metrics"]["all"]["sampled"]["mrr"]
        edges = report["metrics"]["all"]["count"]

    ratio = sizes["fp32"] / sizes["int8"]
    diff = abs(mrr["fp32"] - mrr["int8"])
    print(f"bundle {exported['file']}: {exported['file_bytes']:,} bytes in all")
    print(f"parameters: fp32 {sizes['fp32']:,} bytes, int8 {sizes['int8']:,} bytes "
          f"({ratio:.2f}x smaller)")
    print(f"filtered MRR on {edges:,} test edges (both sides): fp32 {mrr['fp32']:.4f}, "
          f"int8 {mrr['int8']:.4f} (difference {diff:.4f}, target < 0.01); hits@10 "
          f"{hits10['fp32']:.4f} / {hits10['int8']:.4f}")
    print(f"sampled MRR (PBG's): fp32 {sampled['fp32']:.4f}, int8 {sampled['int8']:.4f}")
    print(json.dumps({
        "checkpoint_version": exported["versions"][-1], "dimension": config.dimension,
        "test_edges": edges, "fp32_bytes": sizes["fp32"], "int8_bytes": sizes["int8"],
        "size_ratio": round(ratio, 3), "bundle_bytes": exported["file_bytes"],
        "fp32_filtered_mrr": round(mrr["fp32"], 5), "int8_filtered_mrr": round(mrr["int8"], 5),
        "mrr_difference": round(diff, 5), "target_mrr_difference": 0.01,
        "fp32_hits10": round(hits10["fp32"], 5), "int8_hits10": round(hits10["int8"], 5),
        "fp32_sampled_mrr": round(sampled["fp32"], 5), "int8_sampled_mrr": round(sampled["int8"], 5),
        "train_s": round(train_s, 1), "export_s": round(export_s, 1), "eval_s": eval_s}))


if __name__ == "__main__":
    main()
