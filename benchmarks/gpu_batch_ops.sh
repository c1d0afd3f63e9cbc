#!/usr/bin/env bash
# Operating KCoral on a GPU host (issue 13): the load generator with benchmark() in the mix on the
# host's real GPUs, the metrics endpoint under that load, the watchdog test under the CUDA build of
# torch, and the client tests (Ctrl-C cancellation, errors, progress). Run from the repository root:
#
#     OUT=/some/dir bash benchmarks/gpu_batch_ops.sh
#
# Installs the wheels in .whl/ (when there) and the project, non-editable, into the interpreter's
# own site-packages (a bubblewrap sandbox sees those), then runs each step with its own time limit,
# one log per step under $OUT and a summary in $OUT/summary.txt. A failing step does not stop the
# others. The limits add up to 440 s (7.3 minutes); the whole usually takes about 5.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

OUT=${OUT:-/tmp/kcoral-gpu-batch-ops}
source "$(dirname "$0")/gpu_batch_common.sh"

{
    date -u
    git log -1 --oneline 2>/dev/null || true
    nproc
    nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>/dev/null || true
} >"$OUT/environment.txt"

install_kcoral
# prometheus-client (new in this issue) comes among the wheels: the host has no package index.

MIX="constant=3,sleep:0.05=2,lease:0.02=3,tensor:1M=2,crash=1,raise=1,timeout:1=1,benchmark=3"
MPORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")

# 60 s, 16 clients, a broker on every GPU of the host with its default sandbox; its metrics
# endpoint is scraped before and after, and the counts compared with the loadgen's own.
step loadgen-gpu 140 "$PY" benchmarks/loadgen.py --broker "--metrics-listen 127.0.0.1:$MPORT" \
    --metrics "http://127.0.0.1:$MPORT/metrics" --clients 16 --duration 60 --mix "$MIX" \
    --json "$OUT/loadgen-gpu.json" --plot "$OUT/loadgen-gpu.png"

# The same load with the sandbox off, for comparison (and in case the sandbox cannot reach GPU 1).
step loadgen-gpu-nosandbox 75 "$PY" benchmarks/loadgen.py --broker "--sandbox none" --clients 16 --duration 30 \
    --mix "$MIX" --json "$OUT/loadgen-gpu-nosandbox.json" --plot "$OUT/loadgen-gpu-nosandbox.png"

# The watchdog test under the CUDA build of torch (it maps about 767 MiB at import, CPU torch 215).
step watchdog-cuda-torch 45 "$PY" -m pytest -q -p no:cacheprovider -rA \
    "tests/test_lifecycle.py::test_memory_spread_over_processes_is_caught_by_the_watchdog"

# Ctrl-C cancellation per client kind, the CLI's errors, progress and streaming, metrics and status.
step client-tests 90 "$PY" -m pytest -q -p no:cacheprovider -rA tests/test_client_interrupt.py \
    tests/test_cli.py tests/test_client_progress.py tests/test_metrics.py

echo "done; logs in $OUT" | tee -a "$SUMMARY"
