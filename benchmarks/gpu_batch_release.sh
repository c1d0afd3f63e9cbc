#!/usr/bin/env bash
# The check of a whole tree on a one-GPU H200 host, as root, from the root of the tree:
#
#     OUT=/some/dir [REMOTE_CHEATS=/path/to/integrity/remote] bash benchmarks/gpu_batch_release.sh
#
# Installs the wheels in .whl/ and this tree (non-editable, into the interpreter's site-packages);
# then, each step bounded in time and logged under $OUT: the attacks on `kcoral remote` of
# REMOTE_CHEATS (a folder with run_remote_cheats.sh, attacks/ and workloads/) against a default
# broker; the trusted snapshot's gaps, fresh contexts and client sessions, the README's seed example
# unchanged (first); compare()'s table; the attacks of tests/gpu/remote_attacks/ with the honest
# candidates. A failing step does not stop the others; $OUT/summary.txt has each
# step's status and last lines. pytest runs without the project's addopts (the GPU host has
# pytest, not pytest-xdist).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/kcoral-gpu-batch-release}
source "$(dirname "$0")/gpu_batch_common.sh"
{ date -u; git log -1 --oneline 2>/dev/null || true; nvidia-smi -L; nproc; } >"$OUT/environment.txt" 2>&1
install_kcoral
PYTEST=("$PY" -m pytest -q -m gpu -p no:cacheprovider -o addopts= -rA)

step gaps-fresh-seed "${GAPS_S:-70}" "${PYTEST[@]}" tests/gpu/test_snapshot_gaps_gpu.py tests/gpu/test_fresh_gpu.py \
    tests/test_readme.py
if [ -n "${REMOTE_CHEATS:-}" ]; then
    step remote-cheats "${REMOTE_CHEATS_S:-110}" env OUT="$OUT/remote" bash "$REMOTE_CHEATS/run_remote_cheats.sh"
fi
# compare()'s table (tests/gpu/test_compare_gpu.py asserts the same cases at 10 runs: 5 to 8 minutes).
step compare "${COMPARE_S:-90}" "$PY" benchmarks/compare_gpu.py --runs "${COMPARE_RUNS:-5}" --matmul-runs 2 \
    --busy-seconds 10 --json "$OUT/compare.json"
step remote-attacks "${REMOTE_ATTACKS_S:-150}" "${PYTEST[@]}" tests/gpu/test_remote_attacks_gpu.py
