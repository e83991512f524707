#!/usr/bin/env bash
# Makes the folder of wheels benchmarks/gpu_check.sh installs on a GPU machine that has no
# network (the lent ones here: Python 3.12, torch with CUDA, numpy, h5py, pyarrow, pandas,
# psutil, pytest, but no Ray, Hydra or torchbiggraph). Run it on a machine with PyPI and
# pbg_ray's dev install (for the pure-Python folders it copies), from the repository's root:
#
#   benchmarks/gpu_wheels.sh [WHEELS_DIR]      # default .whl, ignored by git
#
# Then the device tool carries WHEELS_DIR (`carry: [".whl"]`), and gpu_check.sh takes it.
# The versions are constraints.txt's (what CI tests). Ray's wheel (about 80 MB) travels
# stripped: no rllib, llm, jars or dashboard web client, binaries without symbols,
# xz-compressed (about 20 MB): the call carries at most 64 MiB with the repository.
set -euo pipefail
out=${1:-.whl}
cd "$(dirname "$0")/.."
pin() { grep -E "^$1==" constraints.txt | head -n 1; }
rm -rf "$out" && mkdir -p "$out"
grep -qxF "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$out" \
    "$(pin ray)" "$(pin hydra-core)" "$(pin omegaconf)" "$(pin jsonschema)" \
    "$(pin jsonschema-specifications)" "$(pin referencing)" "$(pin rpds-py)" \
    "$(pin tensorboardX)" "$(pin protobuf)" "$(pin setuptools)"
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
(cd "$build" && unzip -q "$OLDPWD/$out"/ray-*.whl)
rm "$out"/ray-*.whl
rm -rf "$build"/ray/rllib "$build"/ray/llm "$build"/ray/jars "$build"/ray/dashboard/client/build
strip --strip-unneeded "$build"/ray/_raylet.so "$build"/ray/core/src/ray/gcs/gcs_server \
    "$build"/ray/core/src/ray/raylet/raylet
tar -C "$build" -cf - ray "$(cd "$build" && ls -d ray-*.dist-info)" | xz -T2 -9 > "$out/ray312.tar.xz"
# Pure-Python packages without a wheel on PyPI: omegaconf's parser runtime, and the
# tests' oracle.
site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cp -r "$site/antlr4" "$site/torchbiggraph" "$out/"
find "$out" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$out"
