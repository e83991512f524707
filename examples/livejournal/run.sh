#!/usr/bin/env bash
# LiveJournal end to end: download, split 75/25, import, train, evaluate the test edges.
# Extra arguments go to training, e.g. ./run.sh ray.placement=disk ray.num_trainers=4
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
"$HERE/download.sh"
python "$HERE/split.py"
python -m pbg_ray.import_edges "$HERE/config.py"
python -m pbg_ray.train "$HERE/config.py" "$@"
python -m pbg_ray.eval "$HERE/config.py" "$@"
