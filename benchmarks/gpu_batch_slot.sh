#!/usr/bin/env bash
# The trusted side of a slot on a real GPU (issue 14): the GPU lease held until the worker exits,
# what that costs in hand-over time (CUDA context teardown included) and in fresh-worker rate, and
# the lease attack on a real GPU. Run from the repository root as root:
#
#     OUT=/some/dir bash benchmarks/gpu_batch_slot.sh
#
# Installs the wheels in .whl/ (when there) and the project, non-editable, into the interpreter's
# own site-packages (a bubblewrap sandbox sees those), then runs each step with its own time limit,
# one log per step under $OUT and a summary in $OUT/summary.txt. A failing step does not stop the
# others. The limits add up to under 8 minutes.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

OUT=${OUT:-/tmp/kcoral-gpu-batch-slot}
source "$(dirname "$0")/gpu_batch_common.sh"

{ date -u; git log -1 --oneline 2>/dev/null || true; nvidia-smi -L; } >"$OUT/environment.txt" 2>&1

install_kcoral

# The lease attack with CUDA work: a program that gives its lease back and keeps computing.
step test-slot-gpu 90 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_slot_gpu.py

# Hand-over between two slots on GPU 0: the previous holder's exit (CUDA teardown) is now in it.
step handover-none 80 "$PY" benchmarks/lease_handover.py --programs 30 --rounds 1 --sandbox none \
    --json "$OUT/handover-none.json"
step handover-bubblewrap 80 "$PY" benchmarks/lease_handover.py --programs 30 --rounds 1 --sandbox bubblewrap \
    --json "$OUT/handover-bubblewrap.json"

# Fresh workers per second on the GPU (each program takes the lease), both sandboxes.
step spawn 150 "$PY" benchmarks/spawn.py --sandbox both --programs 60 --subprocess-runs 2 --replacements 4 \
    --workers 2 --json "$OUT/spawn.json"
