#!/usr/bin/env bash
# The GPU check (issue 60) in one run on a machine with a CUDA GPU and torch, from the
# repository's root, within a budget (default 480 s, so that a lent machine's 15 minutes
# leave room to run it again): installs what pbg_ray needs that the machine lacks from the
# folder benchmarks/gpu_wheels.sh made, builds the C extensions, then these steps, each
# printed and logged to OUT_DIR/<step>.log:
#
#   tests        the gpu-marked tests: the device step on CUDA against the CPU kernel,
#                batch by batch; the engine's train tasks on the GPU in memory and disk
#                placement (the device buffer's copies, the same checkpoint both ways)
#   kernels      kernel_bench's settings A and B on the GPU (edges/s, share of the GPU's
#                matmul rate, kernel launches and host synchronisations per batch by
#                torch's profiler), the kernels launched one by one and as CUDA graphs
#                (ray.cuda_graphs), then on 2 CPU threads (the CPU kernel)
#   gpu_bench    the engine on the GPU (its kernels launched one by one, and as CUDA
#                graphs) against CPU threads: 1 partition in memory, 8 on disk; edges/s
#                per epoch, bytes to the device and back per epoch, MRR
#   cpu_trainers the 8-partition graph on 1, 2, 4 and 8 CPU trainers of 2 threads
#                (edges/s against cores), if the budget has time left
#
#   benchmarks/gpu_check.sh [WHEELS_DIR [OUT_DIR [STEP ...]]]
#
# Defaults: .whl, $OUT (the device tool's output folder) or /tmp/gpu_check, all steps.
# GPU_CHECK_BUDGET_S and GPU_CHECK_SCALE (gpu_bench's graph, a fraction of 1M entities and
# 10M edges) change the budget and the size. The last line is the last step's JSON.
set -uo pipefail
wheels=${1:-.whl} out=${2:-${OUT:-/tmp/gpu_check}}
steps=${*:3}
steps=${steps:-tests kernels gpu_bench cpu_trainers}
budget=${GPU_CHECK_BUDGET_S:-480} scale=${GPU_CHECK_SCALE:-0.5}
site=/tmp/pbg_ray_site
mkdir -p "$out" "$site"
SECONDS=0

step() {  # step NAME SECONDS COMMAND...: run it within SECONDS, output to screen and log
    local name=$1 limit=$2; shift 2
    echo "=== $name ($SECONDS s into the check, at most $limit s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]} after $SECONDS s"
}
left() { echo $((budget - SECONDS)); }

python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl \
    || exit 1
tar -xJf "$wheels"/ray312.tar.xz -C "$site" && cp -r "$wheels"/antlr4 "$wheels"/torchbiggraph \
    "$site/" || exit 1
export PYTHONPATH="$PWD:$site" PYTHONUNBUFFERED=1
# The commands find their Hydra configs as the package pbg_ray.conf, which pyproject maps to
# conf/ in an install; from a plain PYTHONPATH, a link in its place.
[ -e pbg_ray/conf ] || ln -s ../conf pbg_ray/conf
python3 setup.py -q build_ext --inplace >/dev/null 2>&1 \
    || echo "no C compiler: the CPU runs use the kernel's torch code"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)"
nproc

for s in $steps; do
    case $s in
    tests) step tests 100 python3 -m pytest -q -m gpu tests/model/test_device_step.py \
        tests/training/test_device_training.py ;;
    kernels)
        step kernel_cuda 60 python3 benchmarks/kernel_bench.py --device cuda \
            --skip-torchbiggraph --repeats 2 --edges-a 3000000 --edges-b 600000
        step kernel_cuda_graphs 60 python3 benchmarks/kernel_bench.py --device cuda \
            --cuda-graphs --skip-torchbiggraph --repeats 2 --edges-a 3000000 --edges-b 600000 \
            --profile-batches 320
        step kernel_cpu 40 python3 benchmarks/kernel_bench.py --device cpu --workers 2 \
            --skip-torchbiggraph --repeats 1 ;;
    gpu_bench) step gpu_bench 200 python3 benchmarks/gpu_bench.py --scale "$scale" \
        --cpu-threads 8 --cuda-graphs --work-dir /tmp/gpu_bench ;;
    cpu_trainers)
        if [ "$(left)" -lt 100 ]; then
            echo "=== cpu_trainers: left out, $(left) s of the budget left"
        else
            step cpu_trainers "$(($(left) - 10))" python3 benchmarks/gpu_bench.py --settings \
                --scale "$scale" --cpu-trainers 1 2 4 8 --work-dir /tmp/gpu_bench
        fi ;;
    *) echo "gpu_check: unknown step '$s' (tests, kernels, gpu_bench, cpu_trainers)"; exit 2 ;;
    esac
done
echo "=== gpu_check: done in $SECONDS s"
