#!/usr/bin/env bash
# Downloads and unpacks FB15k (the file PyTorch-BigGraph's example uses) into
# $PBG_RAY_DATA (default: this directory's data/). Does nothing if it is there.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DATA=${PBG_RAY_DATA:-$HERE/data}
if [ -f "$DATA/FB15k/freebase_mtr100_mte100-test.txt" ]; then
    echo "FB15k is already in $DATA/FB15k"
    exit 0
fi
"$HERE/../fetch.sh" https://dl.fbaipublicfiles.com/starspace/fb15k.tgz "$DATA/fb15k.tgz"
tar -xzf "$DATA/fb15k.tgz" -C "$DATA"
rm "$DATA/fb15k.tgz"
echo "FB15k is in $DATA/FB15k"
