#!/usr/bin/env bash
# The training-step diagnosis on one GPU (docs/gpu.md#the-diagnosis): what a session lent a GPU runs first.
#
#   eval/gpu_diagnosis.sh WHEELS_DIR OUT_DIR
#
# 1. installs what the machine lacks (gymnasium, mujoco, tyro, minari) from the wheels in WHEELS_DIR, without a
#    network (eval/gpu_setup.sh, as eval/gpu_comparison.sh does);
# 2. runs python -m eval.bench.diagnose on the GPU: primal+dt at the paper's size on the bundled hopper-medium
#    replica, one initialisation, 1000 batches drawn up front, dropout 0, in each arm (eager, compile, cudagraphs;
#    fp32, bf16; cudagraphs bf16 without cuBLAS's reduced-precision reductions; aot_eager bf16), each against
#    eager fp32 and the arm it adds one thing to; the arm that departs first names the part.
#
# It ends within GPU_DIAGNOSIS_BUDGET_S seconds (default 240: 4 minutes of a GPU): the arms
# share what is left after the start, 40 s less (diagnose's --budget_s), and one that runs out of its share stops
# early and says so. OUT_DIR receives diagnosis.txt (the console: the table and the verdict last), diagnosis.json
# and diagnosis.md. GPU_DIAGNOSIS_REHEARSAL=1 runs it on the CPU at the tiny size in a minute (the tests run it).
set -uo pipefail

. "$(dirname "$0")/gpu_setup.sh"
command_args "$@" || exit 2
BUDGET_S=${GPU_DIAGNOSIS_BUDGET_S:-240}
mkdir -p "$OUT" || exit 2
install_missing "$WHEELS" || exit $?
[ -n "$INSTALLED" ] && echo "$INSTALLED"
export PYTHONUNBUFFERED=1

if [ "${GPU_DIAGNOSIS_REHEARSAL:-0}" = 1 ]; then
    ARGS=(--device cpu --size tiny --steps 12 --warmup 4 --backend eager)
else
    ARGS=(--device cuda --size paper --steps 1000 --warmup 100)
fi
ARMS_S=$(( BUDGET_S - 40 ))
if [ "$ARMS_S" -lt 20 ]; then
    echo "error: GPU_DIAGNOSIS_BUDGET_S=$BUDGET_S leaves the arms no time (give 60 or more)" >&2
    exit 2
fi
cd "$ROOT" || exit 2
timeout --signal=TERM --kill-after=10 "$BUDGET_S" "$PY" -m eval.bench.diagnose "${ARGS[@]}" --budget_s "$ARMS_S" \
    --json "$OUT/diagnosis.json" --markdown "$OUT/diagnosis.md" > "$OUT/diagnosis.txt" 2>&1
status=$?
[ $status -eq 124 ] && echo "the diagnosis ran out of its ${BUDGET_S}s (GPU_DIAGNOSIS_BUDGET_S): diagnosis.txt has what it printed"
sed -n '/^== Training-step diagnosis/,$p' "$OUT/diagnosis.txt"
[ $status -ne 0 ] && tail -20 "$OUT/diagnosis.txt"
exit $status
