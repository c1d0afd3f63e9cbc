# What every benchmarks/gpu_batch_*.sh shares: sourced by each after it has chosen its $OUT.
# Goes to the repository root, sets PY and SUMMARY, and defines `step` (run a command with a time
# limit, one log per step under $OUT, its exit status and last lines in $OUT/summary.txt) and
# `install_kcoral` (the wheels in .whl/ when there, then the project, non-editable, into the
# interpreter's own site-packages, which a bubblewrap sandbox sees; a --target folder it does not;
# nothing where KCORAL_INSTALLED=1 says an earlier batch of the same call installed them).
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

step() {  # step NAME SECONDS COMMAND...: run it, log to $OUT/NAME.log, note its exit status
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "== $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc after $((SECONDS - start))s" | tee -a "$SUMMARY"
    tail -n 30 "$OUT/$name.log" | sed 's/^/   | /' >>"$SUMMARY"
}

install_kcoral() {
    [ "${KCORAL_INSTALLED:-}" = 1 ] && return
    if compgen -G ".whl/*.whl" >/dev/null; then
        step install-wheels 50 "$PY" -m pip install -q --no-index --no-deps --no-compile --break-system-packages .whl/*.whl
    fi
    step install-kcoral 60 "$PY" -m pip install -q --no-deps --no-build-isolation --break-system-packages .
}
