"""The evaluation part of ``python -m eval.bench.inference`` (alone: ``python -m eval.bench.evaluator``, with
its options): wall time of ``episodes`` Hopper episodes with the vectorised stream evaluator against the
sequential one-episode-at-a-time recompute loop (the reference implementations' protocol), same
checkpoint, seeds and run, and where each one's time goes, measured: the agent's time is every ``act``
call's, and a simulator step is timed through Gymnasium's wrappers, unwrapped, and as MuJoCo physics alone,
so the report says how much a bypass of Gymnasium's per-step Python could ever save.
"""

from __future__ import annotations

import time

import numpy as np

from agents.agent import Agent

from . import timing


def simulator_costs(spec, gym_id=None, steps: int = 200, seed: int = 0) -> dict:
    """Milliseconds per environment step of one simulator, three ways: ``env.step`` through Gymnasium's
    wrappers (what the evaluators call), ``env.unwrapped.step`` (the MuJoCo env's own Python:
    observation, reward, health), and ``mujoco.mj_step`` for ``frame_skip`` substeps (the physics)."""
    import mujoco

    from envs import make_env

    env = make_env(spec.name, seed, gym_id=gym_id)
    u = env.unwrapped
    rng = np.random.default_rng(seed)
    acts = rng.uniform(-1, 1, size=(steps, env.action_space.shape[0])).astype(np.float32)

    def run(step) -> float:
        env.reset(seed=seed)
        t = 0.0
        for a in acts:
            t0 = time.perf_counter()
            out = step(a)
            t += time.perf_counter() - t0
            if out is not None and (out[2] or out[3]):
                env.reset()
        return 1e3 * t / steps

    ways = {"wrapped": env.step, "unwrapped": u.step,
            "physics": lambda a: mujoco.mj_step(u.model, u.data, nstep=u.frame_skip)}
    times = {k: [] for k in ways}
    for _ in range(5):  # interleaved rounds, medians: one noisy moment does not decide a share
        for k, step in ways.items():
            times[k].append(run(step))
    wrapped, unwrapped, physics = (float(np.median(times[k])) for k in ways)
    env.close()
    return {"env_step_ms": wrapped, "unwrapped_step_ms": unwrapped, "physics_ms": physics,
            "wrappers_share": max(0.0, wrapped - unwrapped) / wrapped,
            "env_python_share": max(0.0, unwrapped - physics) / wrapped, "physics_share": physics / wrapped}


def act_costs(model, info, batch: int, calls: int = 20) -> dict:
    """ms per ``agent.act`` for ``batch`` rows vs the stream engine's step alone: the difference is the
    agent's bookkeeping and numpy <-> torch conversion."""
    import torch

    ag = Agent(model, info, engine="stream")
    ag.reset(batch)
    obs, rew = np.random.default_rng(0).normal(size=(batch, model.cfg.state_dim)), np.ones(batch)
    ag.act(obs)
    s, r = torch.as_tensor(obs, dtype=torch.float32), torch.ones(batch)
    reset = torch.zeros(batch, dtype=torch.bool)

    def step():
        with torch.inference_mode():
            return ag.step_fn(s, r, reset, ag.target, *ag.state.flat())

    out = timing.median_ms({"act_ms": lambda: ag.act(obs, rew), "engine_step_ms": step}, calls, rounds=3)
    return {"batch": batch, **out, "bookkeeping_share": max(0.0, out["act_ms"] - out["engine_step_ms"]) / out["act_ms"]}


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
    vec, lat, res = {}, {}, None
    for name, kw in layouts.items():
        d = {}
        t0 = time.perf_counter()
        options = RolloutOptions(targets=(target,), num_envs=bc.episodes, max_steps=bc.max_steps, engine="stream", **kw)
        r = evaluate(model, bc.episodes, bc.seed, options, data=info, details=d)
        vec[name], lat[name] = time.perf_counter() - t0, d["latency"]
        if res is None:
            res, env_steps = r, d["env_steps"]
        print(f"  vectorised stream, {name}: {vec[name]:.2f} s (agent acting {d['latency']['total_act_s']:.2f} s "
              f"in all)", flush=True)
    # the reference protocol: one episode at a time, a batch-1 recompute agent, the evaluators' loop
    venv = vector_env(spec.name, 1, gym_id=info.gym_id)
    try:
        t0 = time.perf_counter()
        seq = run_episodes(Agent(model, info, engine="recompute"), venv, [(target, e) for e in range(n_seq)],
                           bc.seed, bc.max_steps)
        seq["wall_s"] = time.perf_counter() - t0
    finally:
        venv.close()
    seq["act_s"] = sum(seq["act_s"])
    seq["env_s"] = seq["wall_s"] - seq["act_s"]  # stepping the simulator and the loop's own bookkeeping
    scale = bc.episodes / n_seq
    seq_s = seq["wall_s"] * scale
    sims = simulator_costs(spec, info.gym_id, seed=bc.seed)
    acts = act_costs(model, info, max(1, bc.episodes // 2))
    vec_s, act_s = vec["lanes=2 process"], lat["lanes=2 process"]["total_act_s"]
    sim_s = env_steps * sims["env_step_ms"] / 1e3
    out = {"episodes": bc.episodes, "env_steps": env_steps, "stream_mean_length": res[target]["length_mean"],
           "stream_return_mean": res[target]["return_mean"], "vectorized_stream_s": vec_s,
           "vectorized_by_layout_s": vec, "sequential_recompute_s": seq_s, "sequential_episodes_run": n_seq,
           "sequential_return_mean_over_run": float(np.mean(seq["returns"])), "speedup": seq_s / vec_s,
           "speedup_by_layout": {k: seq_s / v for k, v in vec.items()}, "vectorized_agent_latency": lat["lanes=2 process"],
           "where_time_goes": {
               "vectorized": {"wall_s": vec_s, "agent_act_s": act_s, "simulators_s_estimated": sim_s,
                              "cpu_s": act_s + sim_s, "agent_share_of_cpu": act_s / max(act_s + sim_s, 1e-9)},
               "sequential": {"wall_s": seq_s, "agent_act_s": seq["act_s"] * scale, "env_step_s": seq["env_s"] * scale,
                              "agent_share": seq["act_s"] / max(seq["wall_s"], 1e-9)},
               "simulator_step": sims, "agent_act": acts}}
    print(f"  where the time goes: vectorised: agent {act_s:.2f} s + simulators ~{sim_s:.2f} s of CPU in "
          f"{vec_s:.2f} s wall; sequential: agent {seq['act_s'] * scale:.1f} s + env {seq['env_s'] * scale:.1f} s. "
          f"One env step {sims['env_step_ms']:.3f} ms = physics {100 * sims['physics_share']:.0f}% + MuJoCo env "
          f"Python {100 * sims['env_python_share']:.0f}% + Gymnasium wrappers {100 * sims['wrappers_share']:.0f}%; "
          f"agent.act at batch {acts['batch']}: {acts['act_ms']:.2f} ms, of which bookkeeping and numpy/torch "
          f"conversion {100 * acts['bookkeeping_share']:.0f}%", flush=True)
    return out


if __name__ == "__main__":  # this section alone: eval.bench.inference with its other sections off
    import sys

    from eval.bench.inference import main

    main(["latency=false", *sys.argv[1:]])
