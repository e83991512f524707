#!/usr/bin/env bash
# The built-in demo graph, offline (pbg_ray generates it on first use): train with
# TensorBoard logging, evaluate, plot, export. Extra arguments go to every pbg_ray
# step, e.g. ./run.sh num_epochs=3 ray.num_trainers=2
set -euo pipefail
OUT=${OUT:-$PWD/demo-output}
python -m pbg_ray.train checkpoint_path="$OUT/checkpoints" tensorboard_dir="$OUT/tensorboard" "$@"
python -m pbg_ray.eval checkpoint_path="$OUT/checkpoints" "$@"
python -m pbg_ray.plot "$OUT/checkpoints" --output "$OUT/training_stats.png"
python -m pbg_ray.export checkpoint_path="$OUT/checkpoints" export.output="$OUT/export" "$@"
echo "done: $OUT (tensorboard --logdir $OUT/tensorboard)"
