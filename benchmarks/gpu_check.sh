#!/usr/bin/env bash
# The GPU check (issue 47) in one run on a machine with a CUDA GPU and torch, from the
# repository's root: installs what pbg_ray needs that the machine lacks from a folder of
# wheels, builds the C extensions, runs the gpu-marked tests (the kernel on CUDA against the
# CPU, and the engine's train tasks on the GPU in memory and disk placement against the
# CPU's checkpoint), then kernel_bench on the GPU and on 2 CPU threads, then gpu_bench.
# The big_bench step (not run by default) is issue 45's pipeline with its training on the
# GPU, at a size a lease allows, the limit stated where the machine has no cgroup v1.
# Each step's output goes to OUT_DIR/<step>.log as well; the last line is the last step's
# JSON.
#
#   benchmarks/gpu_check.sh WHEELS_DIR OUT_DIR [GPU_BENCH_SCALE [STEP ...]]
#
# STEPs: tests, kernels and gpu_bench (the default), big_bench. WHEELS_DIR holds *.whl files
# for Python 3.12 (hydra-core, omegaconf, jsonschema and its parts, protobuf, tensorboardX), Ray
# as ray*.tar.xz (the wheel's ray/ and its dist-info, stripped of rllib, llm, jars and the
# dashboard's web client to travel), and pure-Python package folders: antlr4/ (omegaconf's
# parser runtime) and torchbiggraph/ (the kernel test's oracle).
set -uo pipefail
wheels=$1 out=$2 scale=${3:-0.3}
steps=${*:4}
steps=${steps:-tests kernels gpu_bench}
site=/tmp/pbg_ray_site
mkdir -p "$out" "$site"

step() {  # step NAME COMMAND...: run it, its output to the screen and OUT_DIR/NAME.log
    local name=$1; shift
    echo "=== $name: $*"
    "$@" 2>&1 | tee "$out/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]}"
}

python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl \
    || exit 1
tar -xJf "$wheels"/ray*.tar.xz -C "$site" && cp -r "$wheels"/*/ "$site/" || exit 1
export PYTHONPATH="$PWD:$site" PYTHONUNBUFFERED=1
# The commands find their Hydra configs as the package pbg_ray.conf, which pyproject maps to
# conf/ in an install; from a plain PYTHONPATH, a link in its place.
[ -e pbg_ray/conf ] || ln -s ../conf pbg_ray/conf
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 \
    || echo "no C compiler: the CPU runs use the kernel's torch code"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)"

for s in $steps; do
    case $s in
    tests) step tests python3 -m pytest -q -m gpu tests/model/test_kernel.py tests/training/test_gpu.py ;;
    kernels)
        step kernel_cuda python3 benchmarks/kernel_bench.py --device cuda --skip-torchbiggraph --repeats 2
        step kernel_cpu python3 benchmarks/kernel_bench.py --device cpu --workers 2 --skip-torchbiggraph \
            --repeats 1 ;;
    gpu_bench) step gpu_bench python3 benchmarks/gpu_bench.py --scale "$scale" ;;
    big_bench)
        [ -w /sys/fs/cgroup/memory ] && limit=() || limit=(--no-cgroup)
        step big_bench python3 benchmarks/big_bench.py --scale 0.05 --memory-gib 1.5 \
            --partitions 8 --gpus-per-trainer 1 --ivf-probes "${limit[@]}" ;;
    *) echo "gpu_check: unknown step '$s' (tests, kernels, gpu_bench, big_bench)"; exit 2 ;;
    esac
done
