"""The evaluation part of ``python -m eval.bench.inference`` (alone: ``python -m eval.bench.evaluator``, with
its options): wall time of ``episodes`` Hopper episodes with the vectorised stream evaluator against the
sequential one-episode-at-a-time recompute loop (the reference implementations' protocol), same
checkpoint, seeds and run.
"""

from __future__ import annotations

import time

import numpy as np

from agents.agent import Agent


def evaluation_section(model, info, bc) -> dict:
    """The vectorised stream evaluator (its shipped layout, and with ``bc.lane_layouts`` thread lanes and one
    lane) vs the sequential recompute loop, in one run; ratios printed."""
    import envs
    from agents.train_config import RolloutOptions
    from eval.episodes import run_episodes
    from eval.rollout import evaluate, vector_env

    spec = envs.get_spec(info.env)
    target = info.eval_targets[0]
    n_seq = bc.seq_episodes or bc.episodes
    layouts = {"lanes=2 process": {"lanes": 2, "lane_workers": "process"}}  # agents in their lanes' processes
    if bc.lane_layouts:
        layouts.update({"lanes=2 thread": {"lanes": 2, "lane_workers": "thread"}, "lanes=1": {"lanes": 1}})
    vec, res = {}, None
    for name, kw in layouts.items():
        d = {}
        t0 = time.perf_counter()
        options = RolloutOptions(targets=(target,), num_envs=bc.episodes, max_steps=bc.max_steps, engine="stream", **kw)
        r = evaluate(model, bc.episodes, bc.seed, options, data=info, details=d)
        vec[name] = time.perf_counter() - t0
        if res is None:
            res, env_steps = r, d["env_steps"]
        print(f"  vectorised stream, {name}: {vec[name]:.2f} s", flush=True)
    # the reference protocol: one episode at a time, a batch-1 recompute agent, the evaluators' loop
    venv = vector_env(spec.name, 1, gym_id=info.gym_id)
    try:
        t0 = time.perf_counter()
        seq = run_episodes(Agent(model, info, engine="recompute"), venv, [(target, e) for e in range(n_seq)],
                           bc.seed, bc.max_steps)
        seq_s = (time.perf_counter() - t0) * bc.episodes / n_seq
    finally:
        venv.close()
    vec_s = vec["lanes=2 process"]
    print(f"  sequential recompute: {seq_s:.2f} s ({n_seq} episodes run, scaled to {bc.episodes})", flush=True)
    return {"episodes": bc.episodes, "env_steps": env_steps, "stream_mean_length": res[target]["length_mean"],
            "stream_return_mean": res[target]["return_mean"], "vectorized_stream_s": vec_s,
            "vectorized_by_layout_s": vec, "sequential_recompute_s": seq_s, "sequential_episodes_run": n_seq,
            "sequential_return_mean_over_run": float(np.mean(seq["returns"])), "speedup": seq_s / vec_s,
            "speedup_by_layout": {k: seq_s / v for k, v in vec.items()}}


if __name__ == "__main__":  # this section alone: eval.bench.inference with its other sections off
    import sys

    from eval.bench.inference import main

    main(["latency=false", *sys.argv[1:]])
