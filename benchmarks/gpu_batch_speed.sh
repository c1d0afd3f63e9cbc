#!/usr/bin/env bash
# Fresh GPU programs at the driver's floor (issue 21), on a one-GPU H200 host, as root, from the
# root of the tree to measure:
#
#     OUT=/some/dir BASE=/path/to/main-tree bash benchmarks/gpu_batch_speed.sh
#
# Installs the wheels in .whl/ (here or one folder up) and this tree, non-editable; then, in one
# run: the driver's floor, the GPU program of benchmarks/gpu_programs.py through brokers of the
# BASE tree (its defaults) and of this one (defaults, --gpu-handover quiet, more slots),
# benchmark()'s honest workloads beside contexts made ahead and torn down (and without), and the
# GPU tests of the fresh workers and of the lease. One log per step under $OUT, a summary in
# $OUT/summary.txt; a failing step does not stop the others. About 6 minutes.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

OUT=${OUT:-/tmp/kcoral-gpu-batch-speed}
BASE=${BASE:-}
source "$(dirname "$0")/gpu_batch_common.sh"
export OUT

{ date -u; git log -1 --oneline 2>/dev/null || true; nvidia-smi -L; nproc; } >"$OUT/environment.txt" 2>&1

if ! compgen -G ".whl/*.whl" >/dev/null && compgen -G "../.whl/*.whl" >/dev/null; then
    ln -s ../.whl .whl
fi
install_kcoral

if [ -n "${QUICK:-}" ]; then
    # The check after a fix: this tree's defaults with benchmark() beside them, the floor, the
    # side-stream candidate with contexts made ahead and without, the fresh-context GPU test.
    step gpu-programs 75 "$PY" benchmarks/gpu_programs.py --sequential 60 --concurrent 40 --in-flight 8 \
        --config defaults . "" --timing defaults --timing-runs 3 --floor-rounds 1 --json "$OUT/gpu_programs.json"
    step side-stream-ab 40 "$PY" benchmarks/gpu_side_stream_ab.py
    step test-fresh-gpu 30 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rA \
        "tests/gpu/test_fresh_gpu.py::test_each_program_finds_a_fresh_context_made_ahead_on_its_gpu"
    exit 0
fi

CONFIGS=()
if [ -n "$BASE" ]; then
    CONFIGS+=(--config main "$BASE" "")
fi
CONFIGS+=(--config defaults . "")
CONFIGS+=(--config quiet . "--gpu-handover quiet")
CONFIGS+=(--config slots8-quiet . "--workers-per-gpu 8 --gpu-handover quiet")

step gpu-programs 260 "$PY" benchmarks/gpu_programs.py --sequential 60 --concurrent 40 --in-flight 8 \
    "${CONFIGS[@]}" ${BASE:+--timing main} --timing defaults --timing defaults+churn --timing quiet \
    --timing-runs 3 --floor-rounds 3 --json "$OUT/gpu_programs.json"

step test-fresh-gpu 100 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rA \
    tests/gpu/test_fresh_gpu.py tests/gpu/test_slot_gpu.py tests/gpu/test_service_gpu.py
