#!/usr/bin/env bash
# The paper's comparison on one GPU, as one command (docs/gpu.md):
#
#   eval/gpu_comparison.sh WHEELS_DIR OUT_DIR
#
# 1. installs what the machine lacks (gymnasium, mujoco, tyro, minari and their own needs) from the
#    wheels in WHEELS_DIR, without a network, into a folder put on PYTHONPATH;
# 2. runs tests/test_cuda.py: every path (training, evaluation, both engines, export, sweep jobs) on CUDA
#    against the CPU (with pytest from WHEELS_DIR where the machine lacks it; skipped on a CPU);
# 3. runs the training-step benchmark on the device in every form (python -m eval.bench.train);
# 4. trains the paper recipe (env=hopper-medium, 100k steps, its evaluations) on the bundled replica for
#    dt and primal+dt, 3 seeds each, as 6 concurrent jobs of eval.sweep on the one GPU, then eval.report.
#
# Everything must end within GPU_COMPARISON_BUDGET_S seconds (default 540): the sweep gets what the
# benchmark left, and when time runs out its runs are stopped (each keeps a checkpoint to resume
# from) and the output says how far they got. OUT_DIR receives at most 8 files: cuda-tests.txt, bench.txt,
# bench.json, sweep.log, run-logs.tgz (every run's own log), comparison.txt, scores.md, curves.png.
# The budget's shares: the tests at most GPU_COMPARISON_TESTS_S (120; 0 leaves them out), the benchmark at most
# GPU_COMPARISON_BENCH_S (180; 0 leaves it out), the report 45, the recipe the rest (at least 195 of the default 540).
# GPU_COMPARISON_WORK=DIR keeps the runs in DIR: a second call on the same machine with the first's DIR continues
# the runs its budget stopped.
#
# GPU_COMPARISON_AMP=bf16 trains in bf16 autocast (default off: float32). On a GPU the runs share it through
# an MPS daemon of the command's own where the driver offers one (GPU_COMPARISON_MPS=off: never).
#
# GPU_COMPARISON_REHEARSAL=1 rehearses every step on a CPU in a minute or two: the benchmark at its tiny
# size, and the same sweep with the steps, evaluations and model shrunk (the tests run it).
set -uo pipefail

. "$(dirname "$0")/gpu_setup.sh"
command_args "$@" || exit 2
BUDGET_S=${GPU_COMPARISON_BUDGET_S:-540}
REHEARSAL=${GPU_COMPARISON_REHEARSAL:-0}
WORK=${GPU_COMPARISON_WORK:-$(mktemp -d)}
START=$(date +%s)
mkdir -p "$OUT" "$WORK" || exit 2
SUMMARY="$OUT/comparison.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# -- 1. packages ---------------------------------------------------------------------------------------
install_missing "$WHEELS" || exit $?
[ -n "$INSTALLED" ] && say "$INSTALLED"
export PYTHONUNBUFFERED=1

if [ "$REHEARSAL" = 1 ]; then
    DEVICE=cpu
    BENCH=(--sizes tiny --batch 8 --K 5 --steps 1 --rounds 2 --warmup 1 --compile eager compile --backend eager
           --act_calls 10 --threads 1)
    RECIPE=(steps=20 warmup_steps=5 eval.every=10 eval.episodes=1 eval.final_episodes=1 eval.max_steps=15
            eval.num_envs=2 checkpoint_every=10 K=5 batch_size=8 model.d_model=32 model.n_heads=2 model.s=8)
    THREADS=1
    BENCH_S=${GPU_COMPARISON_BENCH_S:-$(( BUDGET_S / 2 ))}
else
    DEVICE=cuda
    BENCH=(--sizes paper --compile eager compile cudagraphs --amp off bf16 --steps 25 --rounds 2 --warmup 5
           --act_calls 200)
    RECIPE=()
    THREADS=2
    BENCH_S=${GPU_COMPARISON_BENCH_S:-180}
fi
AMP=${GPU_COMPARISON_AMP:-off}
case "$AMP" in off|bf16) ;; *) echo "error: GPU_COMPARISON_AMP=$AMP: give off or bf16" >&2; exit 2;; esac
say "device $DEVICE; budget ${BUDGET_S}s; amp=$AMP; runs in $WORK"

# -- 2. every path on CUDA, against the CPU (before MPS: one process) -----------------------------------
TESTS_S=${GPU_COMPARISON_TESTS_S:-120}
if [ "$TESTS_S" -le 0 ]; then
    say "CUDA paths: not tested (GPU_COMPARISON_TESTS_S=$TESTS_S)"
elif "$PY" -c "import pytest, hypothesis" 2> /dev/null; then
    t0=$(date +%s)
    # the project's own options only: no plugin of the machine's (a pytest from WHEELS_DIR may not suit them)
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout --signal=TERM "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
        --basetemp "$WORK/pytest" "$ROOT/tests/test_cuda.py" > "$OUT/cuda-tests.txt" 2>&1
    status=$?
    say "CUDA paths (tests/test_cuda.py): exit $status after $(( $(date +%s) - t0 ))s: $(tail -1 "$OUT/cuda-tests.txt")"
    [ $status -eq 124 ] && say "  the tests ran out of their ${TESTS_S}s (GPU_COMPARISON_TESTS_S)"
    grep -E '^(FAILED|ERROR) ' "$OUT/cuda-tests.txt" | cut -c1-200 | tee -a "$SUMMARY" > /dev/null
else
    say "CUDA paths: not tested (pytest and hypothesis are not installed; put their wheels in $WHEELS)"
fi

# -- MPS: without it, processes take turns on a GPU; with it their small kernels run side by side ----------
# A daemon of this command's own (its pipe and log folders under WORK), stopped when the command ends; the
# device's settings are not changed. GPU_COMPARISON_MPS=off leaves it out.
if [ "$DEVICE" = cuda ] && [ "${GPU_COMPARISON_MPS:-auto}" != off ]; then
    if command -v nvidia-cuda-mps-control > /dev/null; then
        export CUDA_MPS_PIPE_DIRECTORY="$WORK/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$WORK/mps-log"
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        if nvidia-cuda-mps-control -d && timeout 120 "$PY" -c \
            "import torch; torch.ones(1, device='cuda').add_(1); torch.cuda.synchronize()" > /dev/null 2>&1; then
            trap 'echo quit | nvidia-cuda-mps-control' EXIT
            say "MPS: on (this command's own daemon)"
        else
            echo quit | nvidia-cuda-mps-control > /dev/null 2>&1
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
            say "MPS: could not start (its log: $WORK/mps-log); the runs take turns on the GPU"
        fi
    else
        say "MPS: nvidia-cuda-mps-control not found; the runs take turns on the GPU"
    fi
fi

# -- 3. the benchmark ----------------------------------------------------------------------------------
t0=$(date +%s)
if [ "$BENCH_S" -le 0 ]; then
    say "benchmark: not run (GPU_COMPARISON_BENCH_S=$BENCH_S)"
else
    # HuggingFace's DT where transformers is installed (the benchmark's only extra)
    "$PY" -c "import transformers" 2> /dev/null || { BENCH+=(--no-hf); say "benchmark: without HuggingFace's DT (no transformers)"; }
    timeout --signal=TERM "$BENCH_S" "$PY" -m eval.bench.train --device "$DEVICE" --json "$OUT/bench.json" "${BENCH[@]}" \
        --budget_s $(( BENCH_S * 4 / 5 )) \
        > "$OUT/bench.txt" 2>&1
    status=$?
    say "benchmark: exit $status after $(( $(date +%s) - t0 ))s (bench.txt)"
    [ $status -eq 124 ] && say "  the benchmark ran out of its ${BENCH_S}s: bench.txt has the parts it finished"
    sed -n '/^== Training step on /,$p' "$OUT/bench.txt" | tee -a "$SUMMARY"
fi

# -- 4. the paper recipe, 6 runs at once on the one device ---------------------------------------------
REPORT_S=45
SWEEP_S=$(( $(left) - REPORT_S ))
if [ "$SWEEP_S" -lt 30 ]; then
    say "no time left for the recipe (${SWEEP_S}s); raise GPU_COMPARISON_BUDGET_S"
    exit 1
fi
t0=$(date +%s)
timeout --signal=TERM --kill-after=30 "$SWEEP_S" "$PY" -m eval.sweep env=hopper-medium model=dt,primal+dt seeds=0,1,2 \
    jobs=6 threads=$THREADS out="$WORK/runs" device=$DEVICE data_source=replica amp=$AMP "${RECIPE[@]}" \
    > "$OUT/sweep.log" 2>&1
status=$?
wall=$(( $(date +%s) - t0 ))
finished=$(find "$WORK/runs" -name summary.json 2>/dev/null | wc -l)
say "paper recipe (hopper-medium replica, dt and primal+dt x 3 seeds, 6 at once): exit $status, ${wall}s wall, $finished of 6 runs finished"
if [ $status -eq 124 ] || [ $status -eq 137 ]; then
    say "  NOT FINISHED within the budget: the sweep was stopped after ${SWEEP_S}s; each run kept a checkpoint, so the same"
    say "  eval.sweep command (out=$WORK/runs) continues them."
fi
for log in "$WORK"/runs/sweep-logs/*.log; do  # each run's last progress line (one a minute) or stop, and evaluation
    [ -e "$log" ] || continue
    line=$(grep -h -e '^step [0-9,]*/' -e '^interrupted by' "$log" | tail -1 | cut -c1-100)
    say "  $(basename "$log" .log): ${line:-no progress line yet (one a minute)}"
    grep -h '^step [0-9]*: eval' "$log" | tail -1 | cut -c1-120 | sed 's/^/    /' | tee -a "$SUMMARY"
done
# each finished run's own training time (summary.json), evaluations excluded
"$PY" - "$WORK/runs" <<'EOF' | tee -a "$SUMMARY"
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*/*/*/summary.json")):
    s = json.loads(p.read_text())
    print(f"  {s['model']} seed {s['seed']}: {s['steps']} steps, training {s['train_s']:.0f}s "
          f"({s['s_per_1k_steps']:.2f} s per 1k steps)")
EOF

tar -czf "$OUT/run-logs.tgz" -C "$WORK/runs" sweep-logs 2>/dev/null

# -- 5. the report -------------------------------------------------------------------------------------
if [ "$finished" -gt 0 ]; then
    "$PY" -m eval.report "$WORK/runs" --out "$WORK/report" >> "$OUT/sweep.log" 2>&1
    cp "$WORK/report/scores.md" "$WORK/report/curves.png" "$OUT/" 2>/dev/null
    say "report: scores.md (replica data, not D4RL's)"
    cat "$OUT/scores.md" 2>/dev/null | tee -a "$SUMMARY" > /dev/null
fi
say "total $(( $(date +%s) - START ))s of the ${BUDGET_S}s budget"
