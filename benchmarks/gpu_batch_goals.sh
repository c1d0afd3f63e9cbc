#!/usr/bin/env bash
# Issue 21's goals in one run on a one-GPU host, as root, from the root of the tree to measure:
#
#     OUT=/some/dir BASE=/path/to/reference-tree bash benchmarks/gpu_batch_goals.sh
#
# The GPU program of benchmarks/gpu_programs.py through this tree's broker on its defaults (fresh,
# then in a client session) with the driver's floor and benchmark()'s honest workloads beside it;
# the CPU path against the BASE tree's broker (--against), this tree's phases and the router's hop;
# three brokers against one behind the router on simulated hosts (`ip` of iproute2 needed: carried
# in .devtools/bin where the host lacks it); the GPU tests of fresh workers and sessions. STEPS picks
# some (default: all, in this order: gpu-programs cpu-against cpu-phases router federation
# test-fresh-gpu), to spread them over two device calls. One log per step under $OUT, a summary
# in $OUT/summary.txt; a failing step does not stop the others. About 10 minutes in all.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

OUT=${OUT:-/tmp/kcoral-gpu-batch-goals}
BASE=${BASE:-}
source "$(dirname "$0")/gpu_batch_common.sh"
export OUT

{ date -u; git log -1 --oneline 2>/dev/null || true; nvidia-smi -L; nproc; uptime; } >"$OUT/environment.txt" 2>&1
[ -d .devtools/bin ] && export PATH="$PWD/.devtools/bin:$PATH"
STEPS=${STEPS:-gpu-programs cpu-against cpu-phases router federation test-fresh-gpu}
wanted() { [[ " $STEPS " == *" $1 "* ]]; }
install_kcoral

CPU_FLAGS="--device cpu --workers 16"
wanted gpu-programs && step gpu-programs 190 "$PY" benchmarks/gpu_programs.py --sequential 40 --concurrent 32 --in-flight 8 \
    --config defaults . "" --session defaults --timing defaults --timing-runs 3 --floor-rounds 1 \
    --json "$OUT/gpu_programs.json"
if [ -n "$BASE" ] && wanted cpu-against; then
    step cpu-against 120 "$PY" benchmarks/overhead.py --against "$BASE" --rounds 3 --warmup 400 --requests 300 \
        --in-flight 16 --broker-flags "$CPU_FLAGS" --json "$OUT/cpu_against.json"
fi
wanted cpu-phases && step cpu-phases 60 "$PY" benchmarks/overhead.py --phases --warmup 400 --requests 500 --broker-flags "$CPU_FLAGS" \
    --json "$OUT/cpu_phases.json"
wanted router && step router 80 "$PY" benchmarks/overhead.py --router --wire-only --requests 300 --rounds 3 \
    --broker-flags "--workers 4 --sandbox none"
wanted federation && step federation 130 "$PY" benchmarks/federation.py --duration 15 --clients 16 \
    --mix "constant=4,sleep:0.05=3,lease:0.02=3,tensor:256K=2,crash=1,raise=1,timeout:1=1" \
    --broker "--fake-gpus 2 --workers-per-gpu 2" --json "$OUT/federation.json"
wanted test-fresh-gpu && step test-fresh-gpu 100 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_fresh_gpu.py
