#!/usr/bin/env bash
# Downloads SNAP's soc-LiveJournal1 edge list (the file PyTorch-BigGraph's example
# uses) into $PBG_RAY_DATA (default: this directory's data/). Does nothing if it is there.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
"$HERE/../fetch.sh" https://snap.stanford.edu/data/soc-LiveJournal1.txt.gz \
    "${PBG_RAY_DATA:-$HERE/data}/soc-LiveJournal1.txt.gz"
