"""The fixed footprint: the whole process tree of a local run on a tiny graph, by process.

Runs `python -m pbg_ray.train` on the built-in demo graph (built into the work
directory's cache first), as a user's first command does: its own local Ray,
the driver, the actors and the train worker. Samples the PSS of every process of the
tree five times a second while it runs (train_bench.PeakMemory) and prints, at the peak
of their sum, each process's share with its role (the driver, each of Ray's own
processes, partition store, parameter server, scheduler, train worker, idle workers),
each role's sum, the total against the target (0.9 GiB by default), the modules of
interest the driver had loaded when it finished, and the seconds from the command's
start to its first bucket's start and end. Ends with one JSON line.

    python benchmarks/footprint_bench.py
    python benchmarks/footprint_bench.py --work-dir /tmp/fb --epochs 1 -- ray.placement=disk
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from train_bench import PeakMemory, bench_env

GIB = 2 ** 30
# Loaded by the driver or not: what the footprint work takes out of it.
DRIVER_MODULES = ("torch", "h5py", "pyarrow", "pandas", "hydra", "tqdm", "scipy")
# Run as `python -c`, so that the driver reports what it loaded once the command is done.
RUN_TRAIN = f"""
import sys
from pbg_ray.train import main
try:
    main()
finally:
    print("DRIVER_MODULES", " ".join(m for m in {DRIVER_MODULES!r} if m in sys.modules))
"""

# The demo graph is built before the run (on the first run only), off the record.
BUILD_DEMO = "from pbg_ray.importer.demo import demo_graph_path; demo_graph_path()"


def first_bucket(checkpoint_path: Path, started: float) -> dict:
    """Seconds from the command's start to the first bucket's start and end, from
    training_stats.json (each bucket's worker clock)."""
    lines = [json.loads(line) for line in
             (checkpoint_path / "training_stats.json").read_text().splitlines() if line.strip()]
    worker = min((s["worker"] for s in lines if "worker" in s), key=lambda w: w["start"])
    return {"start_s": worker["start"] - started, "end_s": worker["end"] - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--target-gib", type=float, default=0.9)
    parser.add_argument("overrides", nargs="*", help="more key=value settings for the run")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="footprint_bench_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "checkpoint"
    shutil.rmtree(checkpoint, ignore_errors=True)  # trained from scratch, never resumed
    env = dict(bench_env(), PBG_RAY_CACHE=str(work / "cache"), PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1])] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    command = [sys.executable, "-c", RUN_TRAIN, f"checkpoint_path={checkpoint}",
               f"num_epochs={args.epochs}", *args.overrides]
    subprocess.run([sys.executable, "-c", BUILD_DEMO], env=env, cwd=work, check=True)
    started = time.time()
    proc = subprocess.Popen(command, env=env, cwd=work,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = PeakMemory(proc.pid)
    out, _ = proc.communicate()
    seconds = time.time() - started
    sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"run failed:\n{out[-4000:]}")
    loaded = next(line.split()[1:] for line in out.splitlines() if line.startswith("DRIVER_MODULES"))
    bucket = first_bucket(checkpoint, started)

    print(f"python -m pbg_ray.train on the demo graph, {args.epochs} epochs "
          f"{' '.join(args.overrides)}; machine: {os.cpu_count()} CPUs; {seconds:.1f} s in all, "
          f"first bucket started at {bucket['start_s']:.1f} s, done at {bucket['end_s']:.1f} s")
    print(f"at the peak, {sampler.peak / 2**20:,.0f} MiB in {len(sampler.processes)} processes:")
    for name, pid, pss in sampler.processes:
        print(f"  {pss / 2**20:8,.1f} MiB  {name} (pid {pid})")
    print("by role: " + ", ".join(f"{name} {pss / 2**20:,.0f} MiB" for name, pss in
                                  sorted(sampler.breakdown.items(), key=lambda kv: -kv[1])))
    met = sampler.peak <= args.target_gib * GIB
    print(f"total {sampler.peak / GIB:.3f} GiB: target of {args.target_gib} GiB "
          f"{'met' if met else 'NOT met'}; the driver loaded {', '.join(loaded) or 'none'} "
          f"of {', '.join(DRIVER_MODULES)}")
    print(json.dumps({"peak_pss_bytes": sampler.peak, "target_bytes": int(args.target_gib * GIB),
                      "target_met": met, "peak_pss_by_role": sampler.breakdown,
                      "processes": [{"role": n, "pid": p, "pss_bytes": b}
                                    for n, p, b in sampler.processes],
                      "driver_modules": loaded, "seconds": seconds, "first_bucket": bucket,
                      "epochs": args.epochs, "overrides": args.overrides}))


if __name__ == "__main__":
    main()
