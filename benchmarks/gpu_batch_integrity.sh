#!/usr/bin/env bash
# Numbers an agent cannot fake (issue 10), on the GPU host: the attack catalogue as GPU tests (its
# table written beside them), benchmark() against Nsight Compute in-process, the four honest
# workloads as 10 separate programs each through a bubblewrap broker on its defaults, and the
# defences' cost. Run from the repository root:
#
#     OUT=/some/dir bash benchmarks/gpu_batch_integrity.sh
#
# Installs the wheels in .whl/ (when there) and the project, non-editable, into the interpreter's
# own site-packages (a bubblewrap sandbox sees those), then runs each step with its own time limit,
# one log per step under $OUT and a summary in $OUT/summary.txt. A failing step does not stop the
# others. The limits add up to under 10 minutes; the first run on the H200 took 4.
#
# What to read afterwards:
#   $OUT/attacks.txt         one line per attack: honest ms, reported ms, ratio, verdict, how
#   $OUT/pytest-attacks.log  the GPU tests (each attack CAUGHT; honest remote workloads correct, ok)
#   $OUT/timing-ncu.log      benchmark() vs Nsight Compute per workload, in one process
#   $OUT/timing-service.log  10 programs per workload: medians, spread, verdicts, worst vs ncu, pass
#   $OUT/defences-cost.log   what the defences cost benchmark(): timed inside, and on against off
#   $OUT/wall-clock-step.log benchmark() while the wall clock is stepped: each step read, never integrity
set -u

OUT=${OUT:-/tmp/kcoral-gpu-batch-integrity}
source "$(dirname "$0")/gpu_batch_common.sh"
PORT=${KCORAL_BATCH_PORT:-5555}
URL="tcp://127.0.0.1:$PORT"

{
    date -u
    git log -1 --oneline 2>/dev/null || true
    nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv 2>&1
    command -v ncu || echo "ncu: not on PATH"
} >"$OUT/environment.txt"

install_kcoral
"$PY" -c 'import time, kcoral, kcoral.builtins, torch; from kcoral.timing import trust; t = time.perf_counter(); s = trust.arm(); print("kcoral", kcoral.__file__, "torch", torch.__version__, "cupti_error", s.cupti_error, "arm_ms", round((time.perf_counter() - t) * 1e3, 1))' \
    >>"$OUT/environment.txt" 2>&1

# benchmark() against Nsight Compute, in this process (ncu profiles a subprocess per workload).
step timing-ncu 90 "$PY" benchmarks/timing.py --ncu-iters 10 --json "$OUT/timing-ncu.json"

# A broker on its defaults (bubblewrap where bwrap runs), for the service runs and the attacks.
if command -v kcoral >/dev/null 2>&1; then KC=(kcoral); else KC=("$PY" -m kcoral.cli); fi
"${KC[@]}" broker --listen "$URL" >"$OUT/broker.log" 2>&1 &
BROKER=$!
stop_broker() {
    if kill -0 "$BROKER" 2>/dev/null; then
        kill -TERM "$BROKER"
        for _ in $(seq 1 30); do kill -0 "$BROKER" 2>/dev/null || break; sleep 1; done
        kill -KILL "$BROKER" 2>/dev/null
    fi
    wait "$BROKER" 2>/dev/null
}
trap stop_broker EXIT
ready=no
for _ in $(seq 1 40); do
    kill -0 "$BROKER" 2>/dev/null || break
    if "${KC[@]}" status "$URL" --json >"$OUT/status.json" 2>/dev/null &&
        "$PY" -c 'import json,sys; h=json.load(open(sys.argv[1])); w=h.get("workers") or {}; sys.exit(0 if w.get("idle",0)>=max(1,w.get("slots",1)) else 1)' "$OUT/status.json"; then
        ready=yes
        break
    fi
    sleep 1
done
echo "broker pid $BROKER ready=$ready sandbox=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("sandbox"))' "$OUT/status.json" 2>/dev/null)" | tee -a "$SUMMARY"

# The four honest workloads as 10 separate programs each, compared with the ncu medians above.
step timing-service 90 "$PY" benchmarks/timing.py --via-service "$URL" --runs 10 \
    --ncu-json "$OUT/timing-ncu.json" --json "$OUT/timing-service.json"

# Every attack of the catalogue as a GPU test against the same broker; the table goes to attacks.txt.
step pytest-attacks 190 env KCORAL_ATTACK_URL="$URL" KCORAL_ATTACK_TABLE="$OUT/attacks.txt" \
    "$PY" -m pytest -q -m gpu -p no:cacheprovider -rA tests/gpu/test_integrity_gpu.py
stop_broker
trap - EXIT

# The defences' cost on the honest workloads' benchmark() time: timed inside each call, and on
# against off in turns (6 rounds after 2 thrown away, default and fixed-count configs).
step defences-cost 150 "$PY" benchmarks/timing.py --defences-cost 6 --json "$OUT/defences-cost.json"

# A step of the host's wall clock (which CUPTI's timestamps follow) inside a measurement reads
# suspect, never integrity or ok: benchmark() in a loop while a helper steps the clock +-500 us.
step wall-clock-step 60 "$PY" benchmarks/wall_clock_step.py --step-the-clock --runs 16

echo "done; logs in $OUT" | tee -a "$SUMMARY"
