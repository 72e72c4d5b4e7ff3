#!/usr/bin/env bash
# What streams is what was trained: the measurement behind the default training (docs/evaluation.md).
#
#   eval/fidelity_comparison.sh OUT_DIR
#
# For each dataset and seed, in that order (so an early stop leaves whole seeds, not half a grid):
#   (a) standard training (K-step segments, the papers' protocol), its final evaluation by recompute;
#   (b) the same checkpoint evaluated by the stream engine (eval.rollout), a policy training never optimised;
#   (c) stream-exact training (stream_window=W: every layer windowed, the loss on the steps the standard run
#       counts, each seen exactly: stream_counts), its final evaluation by the stream engine, which is then exact;
#       a window written W:K trains on K-step segments (a wide window reaches past K = 20: the state token of 3
#       layers of W tokens sees 3 (W - 1) back, so W = 21 needs K >= 21 and K = 40 counts the standard 20 steps
#       per segment);
#   (d) for FIDELITY_PREFIX_MODELS, training on episode prefixes (from_start=true, K = max_timestep), by the
#       stream engine, which is then exact with no window;
#   (f) for FIDELITY_WHOLE_MODELS, training on whole episodes in K-step chunks carrying the stream's state
#       (whole_episodes=true), by the stream engine, which is then exact with no window, at a segment's cost;
#   (e) each run of (a), (c), (d) and (f) also by its weights' moving average (eval.rollout weights=ema, the run's own
#       engine), where the run kept one (ema_decay);
# then one eval.report over all of it, whose engine column keeps (a) to (d) apart.
#
# Every step is eval.sweep or eval.rollout, which skip what is finished and resume what was stopped, so
# calling the script again continues where it stopped. Settings (environment variables, defaults in
# brackets): FIDELITY_ENVS [hopper-medium hopper-medium-replay], FIDELITY_MODELS [dt,primal+dt],
# FIDELITY_SEEDS [0 1 2], FIDELITY_WINDOWS [10; W or W:K each; empty: no (c)], FIDELITY_EPISODES [50, per target], FIDELITY_RECIPE
# [cpu], FIDELITY_THREADS [1], FIDELITY_PREFIX_MODELS [primalformer-dt; empty: no (d)], FIDELITY_PREFIX_K
# [1000, Hopper's episode limit], FIDELITY_PREFIX_BATCH [16: each segment is K steps], FIDELITY_WHOLE_MODELS
# [the models of (a); empty: no (f)], FIDELITY_OPTIONS [none; training options for every run, e.g.
# "lr_schedule=cosine": give such a sweep an OUT_DIR of its own, and the report names the option]. FIDELITY_REHEARSAL=1 shrinks steps, model and episodes so the whole
# path runs in a minute or two (the tests run it).
set -uo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
OUT=$1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
ENVS=${FIDELITY_ENVS:-hopper-medium hopper-medium-replay}
MODELS=${FIDELITY_MODELS:-dt,primal+dt}
SEEDS=${FIDELITY_SEEDS:-0 1 2}
WINDOWS=${FIDELITY_WINDOWS-10}
EPISODES=${FIDELITY_EPISODES:-50}
THREADS=${FIDELITY_THREADS:-1}
PREFIX_MODELS=${FIDELITY_PREFIX_MODELS-primalformer-dt}
PREFIX_K=${FIDELITY_PREFIX_K:-1000}
PREFIX_BATCH=${FIDELITY_PREFIX_BATCH:-16}
WHOLE_MODELS=${FIDELITY_WHOLE_MODELS-$MODELS}
read -ra OPTIONS <<< "${FIDELITY_OPTIONS:-}"
RECIPE=(recipe=${FIDELITY_RECIPE:-cpu} "${OPTIONS[@]}")
SEGMENTS=()
# the papers' protocol for (a) and (f) and K = 20 for (c), whatever a recipe's models section trains a model as
PROTOCOL=(K=20 stream_window=0)
WINDOW_K=(K=20)
if [ "${FIDELITY_REHEARSAL:-0}" = 1 ]; then
    RECIPE=("${OPTIONS[@]}" steps=12 warmup_steps=2 eval.every=6 eval.episodes=1 eval.max_steps=15 eval.num_envs=2
            checkpoint_every=6 model.d_model=32 model.n_heads=2 model.s=8 model.n_layers=2)
    SEGMENTS=(K=5 batch_size=8)
    PROTOCOL=(stream_window=0)
    WINDOW_K=()
    PREFIX_K=15
    PREFIX_BATCH=4
    ROLLOUT=(max_steps=15 num_envs=2)
else
    ROLLOUT=(num_envs=25)
fi
mkdir -p "$OUT" || exit 2

failed=0
ema() {  # ema ROOT ENV SEED ENGINE: the moving average of each finished run's weights, by the run's own engine
    local run
    for run in "$1/$2"/*/*-seed"$3"; do
        [ -e "$run/summary.json" ] && [ ! -e "$run/rollout-$4-ema.json" ] || continue
        echo "== $(date +%T) (e) $run, weights=ema, by $4"
        "$PY" -m eval.rollout checkpoint="$run" weights=ema engine="$4" episodes="$EPISODES" "${ROLLOUT[@]}" \
            threads="$THREADS" progress=false || { echo "error: eval.rollout weights=ema of $run failed (above)" >&2; failed=1; }
    done
}

sweep() {  # sweep ROOT ENV SEED MODELS OPTIONS...
    local root=$1 env=$2 seed=$3 models=$4
    shift 4
    "$PY" -m eval.sweep env="$env" model="$models" seeds="$seed" "${RECIPE[@]}" eval.final_episodes="$EPISODES" \
        "$@" jobs=1 threads="$THREADS" out="$root" || { echo "error: the sweep into $root failed (above)" >&2; failed=1; }
}

for env in $ENVS; do
    for seed in $SEEDS; do
        echo "== $(date +%T) $env seed $seed: (a) standard training, by recompute"
        sweep "$OUT/standard" "$env" "$seed" "$MODELS" "${SEGMENTS[@]}" "${PROTOCOL[@]}" eval.engine=recompute
        ema "$OUT/standard" "$env" "$seed" recompute
        for run in "$OUT/standard/$env"/*/*-seed"$seed"; do
            [ -e "$run/summary.json" ] && [ ! -e "$run/rollout-stream.json" ] || continue
            echo "== $(date +%T) (b) $run by stream"
            "$PY" -m eval.rollout checkpoint="$run" engine=stream episodes="$EPISODES" "${ROLLOUT[@]}" \
                threads="$THREADS" progress=false || { echo "error: eval.rollout of $run failed (above)" >&2; failed=1; }
        done
        for spec in $WINDOWS; do
            w=${spec%%:*} k=("${WINDOW_K[@]}")
            [ "$spec" != "$w" ] && [ "${FIDELITY_REHEARSAL:-0}" != 1 ] && k=(K="${spec#*:}")
            echo "== $(date +%T) $env seed $seed: (c) stream-exact training, window $w ${k[*]}, by stream"
            sweep "$OUT/window$w" "$env" "$seed" "$MODELS" "${SEGMENTS[@]}" "${k[@]}" stream_window="$w" eval.engine=stream
            ema "$OUT/window$w" "$env" "$seed" stream
        done
        if [ -n "$PREFIX_MODELS" ]; then
            echo "== $(date +%T) $env seed $seed: (d) episode prefixes ($PREFIX_MODELS), by stream"
            sweep "$OUT/prefix" "$env" "$seed" "$PREFIX_MODELS" from_start=true K="$PREFIX_K" max_timestep="$PREFIX_K" \
                batch_size="$PREFIX_BATCH" eval.engine=stream
            ema "$OUT/prefix" "$env" "$seed" stream
        fi
        if [ -n "$WHOLE_MODELS" ]; then
            echo "== $(date +%T) $env seed $seed: (f) whole episodes in chunks ($WHOLE_MODELS), by stream"
            sweep "$OUT/whole" "$env" "$seed" "$WHOLE_MODELS" "${SEGMENTS[@]}" "${PROTOCOL[@]}" whole_episodes=true eval.engine=stream
            ema "$OUT/whole" "$env" "$seed" stream
        fi
    done
done

windows=()
for spec in $WINDOWS; do windows+=("$OUT/window${spec%%:*}"); done
[ -n "$PREFIX_MODELS" ] && windows+=("$OUT/prefix")
[ -n "$WHOLE_MODELS" ] && windows+=("$OUT/whole")
"$PY" -m eval.report "$OUT/standard" "${windows[@]}" out="$OUT/report" || failed=1
exit $failed
