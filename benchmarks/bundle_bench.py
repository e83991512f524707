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

With --export, instead: export speed and memory against the number of partitions. One
random table (--entities x --dimension) is written as checkpoints of 4 and of 16
partitions; each is exported as TSV, Parquet and a bundle by the library in one process
and by `python -m pbg_ray.export`'s Ray tasks (a local Ray of --cpus CPUs, after a warm-up
export), and as TSV by torchbiggraph_export_to_tsv (its make_tsv), each in a fresh
process. Prints entities/s, the process's peak RSS (with Ray: the driver's and the whole
tree's, sampled) and the ratios to torchbiggraph's; ends with one JSON line.

    python benchmarks/bundle_bench.py --export --entities 200000 --dimension 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.*

from pbg_ray.checkpoints import bundle  # noqa: E402
from pbg_ray.checkpoints.directory import CheckpointStorage  # noqa: E402
from pbg_ray.config.eval import EvalConfig  # noqa: E402
from pbg_ray.evaluation.distributed import evaluate_checkpoint  # noqa: E402
from pbg_ray.importer.demo import cache_dir  # noqa: E402
from tests.util import partitioned_checkpoint  # noqa: E402

TAGS = ("fp32", "int8")


def pbg_ray(command: str, *overrides: str) -> str:
    """Run `python -m pbg_ray.<command> overrides...`; its stdout (stderr passes through)."""
    done = subprocess.run([sys.executable, "-m", f"pbg_ray.{command}", *overrides],
                          stdout=subprocess.PIPE, text=True, check=True)
    return done.stdout


# One export in a fresh process: RESULT {seconds, peak_rss_mb, tree_peak_rss_mb}.
EXPORT_RUN = """
import json, os, re, sys, threading, time
import psutil
from pbg_ray.checkpoints.directory import CheckpointStorage
how, path, fmt, output, warm, cpus = sys.argv[1:7]
peak = [0]
def sample():  # the whole tree: this process and, under it, Ray and its workers
    me = psutil.Process()
    while True:
        total = 0
        for p in [me] + me.children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        peak[0] = max(peak[0], total)
        time.sleep(0.1)
def export(checkpoint_path, out):
    config = CheckpointStorage(checkpoint_path).load_config()
    if how == "torchbiggraph":
        from torchbiggraph.converters.export_to_tsv import make_tsv
        from tests.oracle import pbg_config
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out + ".entities.tsv", "w") as e, open(out + ".relations.tsv", "w") as r:
            make_tsv(pbg_config(config), e, r)
        return
    config.export.format, config.export.output = fmt, out
    if fmt == "bundle":
        config.export.variants = ["fp32", "int8"]
    from pbg_ray.checkpoints.exporter import export_checkpoint
    if how == "ray":
        import ray
        from pbg_ray.runtime.partition_jobs import RayPartitionMap
        if not ray.is_initialized():
            ray.init(address="local", num_cpus=int(cpus), include_dashboard=False,
                     log_to_driver=False)
        export_checkpoint(config, RayPartitionMap({"num_cpus": 1}, 2 * int(cpus)))
    else:
        export_checkpoint(config)
export(warm, output + "-warm")  # imports, Ray and its workers started
threading.Thread(target=sample, daemon=True).start()
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) from here
t = time.perf_counter()
export(path, output)
seconds = time.perf_counter() - t
hwm = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
print("RESULT", json.dumps({"seconds": seconds, "peak_rss_mb": hwm / 1024,
                            "tree_peak_rss_mb": max(peak[0], hwm * 1024) / 2**20}), flush=True)
"""


def export_run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", EXPORT_RUN, *args], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode:
        raise SystemExit(f"export subprocess failed:\n{proc.stderr[-3000:]}")
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def export_bench(args: argparse.Namespace) -> None:
    """The --export measurement (module docstring)."""
    root = Path(tempfile.mkdtemp(prefix="pbg_ray-export-bench-"))
    try:
        warm = partitioned_checkpoint(root / "warm", 2, 2000, args.dimension).checkpoint_path
        table_mb = args.entities * args.dimension * 4 / 2**20
        print(f"table: {args.entities:,} entities x {args.dimension} floats = {table_mb:.0f} MiB; "
              f"Ray with {args.cpus} CPUs")
        results = {}
        for nparts in (4, 16):
            path = partitioned_checkpoint(root / f"p{nparts}", nparts, args.entities,
                                          args.dimension, num_edges=1).checkpoint_path
            runs = [("torchbiggraph", "tsv")] + [(how, fmt) for fmt in ("tsv", "parquet", "bundle")
                                                  for how in ("library", "ray")]
            for how, fmt in runs:
                out = str(root / "out" / f"{how}-{fmt}-{nparts}")
                got = export_run(how, path, fmt, out, warm, str(args.cpus))
                rate = args.entities / got["seconds"]
                key = f"{how}_{fmt}_p{nparts}"
                results[key] = {"entities_per_s": round(rate), "seconds": round(got["seconds"], 2),
                                "peak_rss_mb": round(got["peak_rss_mb"]),
                                "tree_peak_rss_mb": round(got["tree_peak_rss_mb"])}
                tree = f", tree {got['tree_peak_rss_mb']:6.0f} MiB" if how == "ray" else ""
                print(f"{nparts:2d} partitions  {how:13s} {fmt:7s} {rate:10,.0f} entities/s  "
                      f"{got['seconds']:6.2f} s  peak RSS {got['peak_rss_mb']:6.0f} MiB{tree}",
                      flush=True)
                shutil.rmtree(out, ignore_errors=True)
            peer = results[f"torchbiggraph_tsv_p{nparts}"]
            for how in ("library", "ray"):
                ours = results[f"{how}_tsv_p{nparts}"]
                results[f"ratio_{how}_tsv_vs_torchbiggraph_p{nparts}"] = round(
                    ours["entities_per_s"] / peer["entities_per_s"], 2)
                print(f"{nparts:2d} partitions  TSV {how} / torchbiggraph: "
                      f"{ours['entities_per_s'] / peer['entities_per_s']:.2f}x entities/s, "
                      f"peak RSS {ours['peak_rss_mb']} vs {peer['peak_rss_mb']} MiB")
        for how, fmt in [("library", f) for f in ("tsv", "parquet", "bundle")] + [("torchbiggraph", "tsv")]:
            growth = (results[f"{how}_{fmt}_p4"]["peak_rss_mb"]
                      - results[f"{how}_{fmt}_p16"]["peak_rss_mb"])
            results[f"peak_drop_4_to_16_{how}_{fmt}_mb"] = growth
            print(f"peak RSS, 4 -> 16 partitions of the same table, {how} {fmt}: "
                  f"{results[f'{how}_{fmt}_p4']['peak_rss_mb']} -> "
                  f"{results[f'{how}_{fmt}_p16']['peak_rss_mb']} MiB")
        print(json.dumps({"entities": args.entities, "dimension": args.dimension,
                          "table_mb": round(table_mb), "cpus": args.cpus, **results}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=str(cache_dir() / "bundle-bench"),
                        help="where the demo checkpoint is trained (and found again)")
    parser.add_argument("--epochs", type=int, default=None, help="num_epochs (default: the demo's)")
    parser.add_argument("--export", action="store_true",
                        help="measure export speed and memory instead (module docstring)")
    parser.add_argument("--entities", type=int, default=200_000, help="--export: table rows")
    parser.add_argument("--dimension", type=int, default=64, help="--export: table columns")
    parser.add_argument("--cpus", type=int, default=2, help="--export: the local Ray's CPUs")
    args = parser.parse_args()
    if args.export:
        export_bench(args)
        return
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
