#!/usr/bin/env bash
# FB15k end to end: download, import, train, filtered evaluation of the test edges.
# Extra arguments go to training, e.g. ./run.sh num_epochs=10 ray.num_trainers=4
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
"$HERE/download.sh"
python -m pbg_ray.import_edges "$HERE/config.py"
python -m pbg_ray.train "$HERE/config.py" "$@"
python -m pbg_ray.eval "$HERE/config.py" "$@"
