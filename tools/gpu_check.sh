#!/usr/bin/env bash
# The GPU acceptance run for one bare H200 (torch + CUDA preinstalled, no package registry):
# docs/gpu.md says what each check measures and how to run it through the device tool.
#
#   tools/gpu_check.sh --prepare   here, with PyPI: download the carried wheels into .gpu_wheels/
#                                  (tools/gpu_check/wheels.txt) and check the size against 64 MiB
#   tools/gpu_check.sh --dry       here, no GPU: install those wheels into a scratch folder and run
#                                  the three checks on CPU (tiny shapes) with only the H200 image's
#                                  packages and the wheels importable (tools/gpu_check/h200_sim.py)
#   tools/gpu_check.sh             on the H200: install the wheels, run
#                                    (a) SAO steps (K = 2) of a 2.5 B Qwen3-MoE-shaped model: step time,
#                                        tokens/s, MFU, peak CUDA memory vs `sao plan`
#                                    (b) HF -> mcore -> HF round trip on CUDA, bit-exact
#                                    (c) the CPU engine receiving a weight update by CUDA IPC
#                                  and print one result line per check (exit 0 when all pass).
#
# Output: $OUT (the device tool's) or gpu_check_out/: summary.txt, <check>.json (figures),
# <check>.log (everything the check printed). Environment: PYTHON (default python3),
# GPU_CHECK_WHEELS (default .gpu_wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.gpu_wheels}
export GPU_CHECK_OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$GPU_CHECK_OUT"
export PYTHONUNBUFFERED=1

install_wheels() {  # into a scratch folder that shadows the image's copies of the same packages
    "$PY" tools/gpu_check/prepare.py check "$WHEELS" || exit 2
    SITE=$(mktemp -d /tmp/sao-gpu-check-site.XXXXXX)
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl; then
        echo "gpu_check: pip install --no-index --no-deps of $WHEELS/*.whl failed (see above)" >&2
        exit 2
    fi
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

run_checks() {  # $1: "" on the GPU (time limits that keep the run under 8 minutes), --dry here
    local flag=$1 status=0 scale=1
    [ -n "$flag" ] && scale=5  # the CPU dry run has no device clock running; a busy CI VM is slow
    : >"$GPU_CHECK_OUT/summary.txt"
    for spec in "(a) sao_step 200" "(b) round_trip 120" "(c) ipc_update 90"; do
        set -- $spec
        local label=$1 name=$2 limit=$(($3 * scale)) code line
        : >"$GPU_CHECK_OUT/$name.log"
        # timeout signals the check's whole process group: the engine of (c) goes with it
        timeout --kill-after=10 "$limit" "${RUN[@]}" "tools/gpu_check/$name.py" $flag >>"$GPU_CHECK_OUT/$name.log" 2>&1
        code=$?
        line=$(grep -a "^gpu_check ([abc]) $name" "$GPU_CHECK_OUT/$name.log" | tail -1)
        if [ "$code" = 124 ] || [ "$code" = 137 ]; then
            line="gpu_check $label $name: FAIL timed out after $limit s (log: $GPU_CHECK_OUT/$name.log)"
        elif [ -z "$line" ]; then
            line="gpu_check $label $name: FAIL exited $code before its result line (log: $GPU_CHECK_OUT/$name.log): $(grep -a -v '^\s' "$GPU_CHECK_OUT/$name.log" | tail -1)"
        fi
        [ "$code" = 0 ] || status=1
        echo "$line" | tee -a "$GPU_CHECK_OUT/summary.txt"
    done
    echo "--- gpu_check summary ($(date -u +%FT%TZ), $("$PY" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")'))"
    cat "$GPU_CHECK_OUT/summary.txt"
    return $status
}

case "${1:-}" in
    --prepare)
        exec "$PY" tools/gpu_check/prepare.py download "$WHEELS" ;;
    --dry)
        install_wheels
        RUN=("$PY" tools/gpu_check/h200_sim.py "$WHEELS")
        run_checks --dry ;;
    "")
        "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device (use --dry without one)")' || exit 2
        install_wheels
        RUN=("$PY")
        run_checks "" ;;
    *)
        sed -n '2,20p' "$0" >&2
        exit 2 ;;
esac
