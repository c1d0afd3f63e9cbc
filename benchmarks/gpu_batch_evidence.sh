#!/usr/bin/env bash
# The GPU evidence still missing for issues 20, 21 and 22, in one device call of about 9 minutes on a
# one-GPU H200 host, as root, from the root of the tree:
#
#     OUT=/some/dir bash benchmarks/gpu_batch_evidence.sh
#
# Installs the wheels in .whl/ and this tree, starts one broker on its defaults (bubblewrap, CUDA
# contexts made ahead, 4 workers per GPU) and then, each part bounded in time and all of them within
# BUDGET_S (540 s, after which a part is skipped and says so):
#   suspect-rate    issue 21: the honest workloads of benchmarks/timing.py as separate programs beside
#                   contexts made ahead (TIMING_RUNS x 4 = 12 programs): how many read `ok`, the
#                   reasons of the others, and each report's gpu_processes (busy, excused, own);
#   busy-service    issue 22: compare() programs on the broker while a process outside KCoral keeps
#                   the GPU busy: never `faster`;
#   compare         issue 22: benchmarks/compare_gpu.py in this process: 10 runs each of the add
#                   against itself, against 1.03x, the matmul against its 1.5x variant (with the
#                   medians apart), the adaptive stop, a busy GPU;
#   remote-honest   issue 20: 10 honest `kcoral remote` runs of add, matmul, small_mlp, beside the
#                   same candidate's benchmark() in a program on the same broker;
#   snapshot-gaps   tests/gpu/test_snapshot_gaps_gpu.py;
#   remote-attacks  tests/gpu/test_remote_attacks_gpu.py against that broker.
# Expected on the H200 (from the runs of 2026-12-01): broker ready 15-25 s, suspect-rate 30 s,
# busy-service 20 s, compare 100 s, remote-honest 200 s (30 evaluations of 6-9 s, the workloads in
# turn: cut at its limit, its counts differ by one at most), snapshot-gaps 20 s, remote-attacks what
# is left (it needs about 2 minutes). What a budget cut leaves out runs in a second call:
# PARTS="remote-honest remote-attacks".
# PARTS (default: the six above, in that order; also compare-tests, gpu-programs, session-programs,
# cpu-path, cpu-phases, cpu-session, router-hop, federation, broker-profile and gpu-tests, at the end, and with
# BASE (a tree of an older commit, say a worktree carried beside this one) cpu-against, cpu-against-warm,
# cpu-session-against and session-against, this tree against BASE alternated in one run; fork-cost) picks
# some; tools carried in .devtools/bin (`ip` of iproute2 for federation, `py-spy` for
# broker-profile) go on PATH; BROKER_FLAGS adds flags to the broker's
# (a dry run on a machine whose venv has the tree installed editable: BROKER_FLAGS="--sandbox none",
# SKIP_INSTALL=1). Logs and JSON go to a work folder; after
# every part it is packed again as $OUT/evidence.tar.gz, beside $OUT/summary.txt and
# $OUT/environment.txt: three files under $OUT, whatever is cut short. On a host without a GPU every
# part runs and fails or skips at once (a dry run of the script itself).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEST=${OUT:-/tmp/kcoral-gpu-batch-evidence}
mkdir -p "$DEST"
WORK=$(mktemp -d /tmp/kcoral-evidence.XXXXXX)
OUT="$WORK/evidence"
# shellcheck source=gpu_batch_common.sh source-path=SCRIPTDIR
source "$(dirname "$0")/gpu_batch_common.sh"
[ -d .devtools/bin ] && export PATH="$PWD/.devtools/bin:$PATH"
BASE=${BASE:-}
BUDGET_S=${BUDGET_S:-540}
PARTS=${PARTS:-suspect-rate busy-service compare remote-honest snapshot-gaps remote-attacks}
PORT=${EVIDENCE_PORT:-5611}
URL="tcp://127.0.0.1:$PORT"
BROKER_PID=""
BROKER_READY=0

pack() {  # the work folder as $DEST/evidence.tar.gz, the summary beside it
    tar -czf "$DEST/evidence.tar.gz.part" -C "$WORK" evidence 2>/dev/null &&
        mv "$DEST/evidence.tar.gz.part" "$DEST/evidence.tar.gz"
    cp "$SUMMARY" "$DEST/summary.txt"
}

stop_broker() {
    if [ -n "$BROKER_PID" ] && kill -0 "$BROKER_PID" 2>/dev/null; then
        kill -TERM "$BROKER_PID" 2>/dev/null
        for _ in $(seq 1 50); do kill -0 "$BROKER_PID" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$BROKER_PID" 2>/dev/null
    fi
    BROKER_PID=""
BROKER_READY=0
}

finish() {
    stop_broker
    echo "== digest" >>"$SUMMARY"
    timeout 30 "$PY" benchmarks/gpu_evidence.py digest "$OUT" >>"$SUMMARY" 2>&1
    echo "== done after ${SECONDS}s" | tee -a "$SUMMARY"
    pack
    rm -rf "$WORK"
}
trap finish EXIT

wanted() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

part() {  # part NAME SECONDS COMMAND...: a step bounded by its own limit and by what is left of BUDGET_S
    local name=$1 limit=$2
    shift 2
    wanted "$name" || return 0
    case "$name" in
    suspect-rate | busy-service | remote-honest | remote-attacks)
        if [ "$BROKER_READY" != 1 ]; then
            echo "== $name: skipped, the broker is not ready" | tee -a "$SUMMARY"
            return 0
        fi
        ;;
    esac
    local left=$((BUDGET_S - SECONDS - 10))
    if [ "$left" -lt 15 ]; then
        echo "== $name: skipped, ${left}s of the budget left" | tee -a "$SUMMARY"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    step "$name" "$limit" "$@"
    pack
}

start_broker() {  # the broker's defaults on this host's GPUs (BROKER_FLAGS: more flags); ready, or its parts skip
    # shellcheck disable=SC2086  # BROKER_FLAGS: words
    setsid "$PY" -m kcoral broker --listen "$URL" ${BROKER_FLAGS:-} >"$OUT/broker.log" 2>&1 &
    BROKER_PID=$!
    local start=$SECONDS
    until "$PY" -m kcoral status "$URL" --ready >/dev/null 2>&1; do
        if ! kill -0 "$BROKER_PID" 2>/dev/null || [ $((SECONDS - start)) -ge "${BROKER_START_S:-90}" ]; then
            echo "== broker: not ready after $((SECONDS - start))s (see broker.log)" | tee -a "$SUMMARY"
            return 1
        fi
        sleep 1
    done
    BROKER_READY=1
    echo "== broker: ready on $URL after $((SECONDS - start))s" | tee -a "$SUMMARY"
    "$PY" -m kcoral status "$URL" --json >"$OUT/broker-status.json" 2>&1
}

{
    date -u
    git log -1 --oneline 2>/dev/null || true
    nvidia-smi -L 2>&1
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,power.limit --format=csv 2>&1
    nproc
} >"$DEST/environment.txt" 2>&1
[ -n "${SKIP_INSTALL:-}" ] || install_kcoral  # SKIP_INSTALL=1: a dry run with the interpreter as it is
pack
PYTEST=("$PY" -m pytest -q -m gpu -p no:cacheprovider -o addopts= -rA)
if wanted suspect-rate || wanted busy-service || wanted remote-honest || wanted remote-attacks; then
    start_broker
fi

# Issue 21: honest benchmark() beside contexts made ahead (12 programs; 2-3 of 12 read suspect before).
part suspect-rate "${SUSPECT_S:-80}" "$PY" benchmarks/timing.py --via-service "$URL" --runs "${TIMING_RUNS:-3}" \
    --no-ncu --json "$OUT/suspect-rate.json"
# Issue 22: a GPU held busy by a process outside KCoral, through the service.
part busy-service "${BUSY_S:-60}" "$PY" benchmarks/gpu_evidence.py busy-service --url "$URL" --runs "${BUSY_RUNS:-3}" \
    --busy-seconds 45 --json "$OUT/busy-service.json"
# Issue 22: compare() in this process (its rows are printed as they come: a part cut short keeps them).
part compare "${COMPARE_S:-170}" "$PY" benchmarks/compare_gpu.py --runs "${COMPARE_RUNS:-10}" \
    --matmul-runs "${MATMUL_RUNS:-10}" --busy-seconds 40 --json "$OUT/compare.json"
# Issue 20: the honest candidates through kcoral remote (about 6-9 s each), beside benchmark().
part remote-honest "${REMOTE_HONEST_S:-200}" "$PY" benchmarks/gpu_evidence.py remote-honest --url "$URL" \
    --runs "${REMOTE_RUNS:-10}" --in-process 3 --json "$OUT/remote-honest.json"
# Issue 20: the trusted snapshot's gaps (class 8; in this process, about 20 s), then the attacks of
# tests/gpu/remote_attacks/ against the broker (16 evaluations, about 2 minutes) with what is left.
part snapshot-gaps "${GAPS_S:-45}" "${PYTEST[@]}" tests/gpu/test_snapshot_gaps_gpu.py
part remote-attacks "${REMOTE_ATTACKS_S:-150}" env KCORAL_ATTACK_URL="$URL" "${PYTEST[@]}" \
    tests/gpu/test_remote_attacks_gpu.py

# Parts that start brokers of their own: never in the default PARTS (2026-12-02's second call ran
# PARTS="suspect-rate compare-tests session-programs cpu-path cpu-session router-hop federation
# gpu-tests" in 272 s). The evidence broker goes first, so that its idle workers and spares are not
# on the GPU beside them. federation needs `ip` (iproute2), which the H200 host lacks.
if wanted compare-tests || wanted gpu-programs || wanted gpu-tests || wanted session-programs || wanted cpu-path || wanted cpu-phases ||
    wanted cpu-session || wanted router-hop || wanted federation || wanted broker-profile ||
    wanted cpu-against || wanted cpu-against-warm || wanted cpu-session-against || wanted session-against || wanted fork-cost; then
    stop_broker
fi
# Issue 22: the self-compare under the verdict rule of 5dc442d (same in 10 of 10) and the provenance
# of a real result, direct and through a router (tests/gpu/test_compare_gpu.py, never run on the GPU).
part compare-tests "${COMPARE_TESTS_S:-120}" "${PYTEST[@]}" tests/gpu/test_compare_gpu.py \
    -k "itself or provenance"
# Issue 21: the fresh GPU program on the broker's defaults (sequential p50, 8 in flight) beside the
# driver's floor, and benchmark() beside contexts made ahead, in one run.
part gpu-programs "${GPU_PROGRAMS_S:-120}" "$PY" benchmarks/gpu_programs.py --sequential 60 --concurrent 40 \
    --in-flight 8 --config defaults . "" --timing defaults --timing-runs 3 --floor-rounds 1 \
    --json "$OUT/gpu-programs.json"
# Issue 21's speed goals beside their references, each in one run: the GPU program fresh and in a
# client session (AsyncClient(session=True)) on the defaults; the CPU path (a constant program,
# --device cpu, 16 workers: fresh workers with 16 in flight, then one session's phases); the
# router's hop over a direct broker; one, two and three simulated broker hosts behind a router.
part session-programs "${SESSION_S:-120}" "$PY" benchmarks/gpu_programs.py --sequential 60 --concurrent 40 \
    --in-flight 8 --config defaults . "" --session defaults --floor-rounds 1 --json "$OUT/session-programs.json"
part cpu-path "${CPU_PATH_S:-90}" "$PY" benchmarks/overhead.py --requests 400 --in-flight 16 \
    --broker-flags "--device cpu --workers 16" --json "$OUT/cpu-path.json"
# Where a warmed broker's fresh constant program goes, phase by phase, one at a time.
part cpu-phases "${CPU_PHASES_S:-90}" "$PY" benchmarks/overhead.py --phases --warmup "${WARMUP:-400}" --in-flight 16 \
    --requests 800 --broker-flags "--device cpu --workers 16" --json "$OUT/cpu-phases.json"
part cpu-session "${CPU_SESSION_S:-60}" "$PY" benchmarks/overhead.py --phases --session --requests 300 \
    --broker-flags "--device cpu --workers 16" --json "$OUT/cpu-session.json"
# With BASE, the hop of this tree and of BASE's, alternated in one run.
part router-hop "${ROUTER_S:-90}" "$PY" benchmarks/overhead.py --router --requests 300 --rounds 3 \
    ${BASE:+--against "$BASE"} --json "$OUT/router-hop.json"
# The federation's mix: FEDERATION_MIX (default: the load generator's own, mostly programs of a
# fixed length, so that its rate is the slots' and not one process's CPU).
FEDERATION_MIX=${FEDERATION_MIX:-constant=4,sleep:0.05=3,lease:0.02=3,tensor:256K=2,crash=1,raise=1,timeout:1=1}
part federation "${FEDERATION_S:-120}" "$PY" benchmarks/federation.py --duration "${FEDERATION_DURATION:-15}" \
    --clients 16 --mix "$FEDERATION_MIX" --broker "${FEDERATION_BROKER:---fake-gpus 2 --workers-per-gpu 2}" \
    --json "$OUT/federation.json"
# The same goals against BASE, alternated round by round in one run: the CPU path fresh and in one
# session (16 workers, 16 in flight; the broker's and the client's CPU per program beside each), and
# the GPU program in a session (and fresh) on the defaults. Then where a busy broker's CPU goes.
if [ -n "$BASE" ]; then
    part cpu-against "${CPU_AGAINST_S:-150}" "$PY" benchmarks/overhead.py --against "$BASE" --rounds 4 \
        --requests 400 --in-flight 16 --broker-flags "--device cpu --workers 16" --json "$OUT/cpu-against.json"
    # The same once each broker has served WARMUP programs (its slots' one-time work done).
    part cpu-against-warm "${CPU_AGAINST_S:-150}" "$PY" benchmarks/overhead.py --against "$BASE" --rounds 4 \
        --warmup "${WARMUP:-400}" --requests 400 --in-flight 16 --broker-flags "--device cpu --workers 16" \
        --json "$OUT/cpu-against-warm.json"
    part cpu-session-against "${CPU_SESSION_AGAINST_S:-90}" "$PY" benchmarks/overhead.py --against "$BASE" \
        --session --rounds 4 --requests 800 --in-flight 16 --broker-flags "--device cpu --workers 16" \
        --json "$OUT/cpu-session-against.json"
    part session-against "${SESSION_AGAINST_S:-150}" "$PY" benchmarks/gpu_programs.py --sequential 60 \
        --concurrent 40 --in-flight 8 --config before "$BASE" "" --config after . "" --session before \
        --session after --floor-rounds 1 --json "$OUT/session-against.json"
fi
# What a fresh worker's fork and exit cost the zygote, its memory in 4 KiB pages and collapsed.
part fork-cost "${FORK_COST_S:-90}" "$PY" benchmarks/fork_cost.py --forks 300 --rounds 3
part broker-profile "${PROFILE_S:-60}" "$PY" benchmarks/broker_profile.py --broker-flags "--device cpu --workers 16" \
    --in-flight 16 --seconds 10 --raw "$OUT/broker-profile.txt"
# The GPU tests of the code moved since they last ran there (fresh contexts and sessions, the lease,
# the timer through the service).
part gpu-tests "${GPU_TESTS_S:-150}" "${PYTEST[@]}" tests/gpu/test_fresh_gpu.py tests/gpu/test_slot_gpu.py \
    tests/gpu/test_timing_gpu.py tests/gpu/test_service_gpu.py
