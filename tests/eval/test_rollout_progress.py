"""Evaluation progress that tells the truth: ``run_episodes`` reports episodes as they end, and the
bars of ``python -m eval.rollout`` and of training's evaluation count episodes (episodes x targets)
and end at 100 %, whatever the episodes' lengths (the bars once assumed 1000-step episodes and
stopped at a fifth). Real simulators, real processes, the bars' real output on a (pseudo-)terminal."""

import re

import numpy as np

from agents import Agent, DataInfo
from eval import rollout
from eval.episodes import run_episodes

BAR = re.compile(r"(?P<desc>[^\r\n]*?):\s+(?P<pct>\d+)%\|[^|\r\n]*\|\s*(?P<n>\d+)/(?P<total>\d+) "
                 r"\[[^\]\r\n]*?(?P<unit>episode/s|s/episode)")


def bar_states(text: str, desc: str) -> list[tuple[int, int, int]]:
    """(percent, done, total) of every state of the bars whose description contains ``desc``."""
    return [(int(m["pct"]), int(m["n"]), int(m["total"])) for m in BAR.finditer(text) if desc in m["desc"]]


def assert_counts_episodes(states, total):
    assert states, "no progress bar in the output"
    assert {t for _, _, t in states} == {total}
    done = [n for _, n, _ in states]
    assert done == sorted(done) and done[-1] == total and states[-1][0] == 100


def test_run_episodes_reports_each_episode_as_it_ends(tiny_dt, hopper_stats):
    """Two lanes, more jobs than simulators, episodes ended by the simulator (the hopper falls) and
    by the step cap: the reports add up to the jobs, and each comes when its episodes have ended."""
    model = tiny_dt("primal+dt", K=5)
    mean, std = hopper_stats
    venvs = [rollout.vector_env("hopper-medium", 2, False, None) for _ in range(2)]
    agents = [Agent(model, DataInfo("hopper-medium", mean, std, reward_scale=1000.0, targets=(3600.0,))) for _ in venvs]
    jobs = [(t, e) for t in (3600.0, 1800.0) for e in range(4)]
    reports, steps_at = [], []
    counted = {"steps": 0}
    for a in agents:  # count env steps taken so far, to see when the reports come
        act = a.act

        def counting(obs, reward, _act=act):
            counted["steps"] += len(obs)
            return _act(obs, reward)
        a.act = counting

    def on_episode(n):
        reports.append(n)
        steps_at.append(counted["steps"])

    try:
        res = run_episodes(agents, venvs, jobs, seed=3, max_steps=49, on_episode=on_episode)
    finally:
        for v in venvs:
            v.close()
    lengths = np.array(res["lengths"])
    assert (lengths < 49).any() and (lengths == 49).any(), "the test wants both kinds of episode end"
    assert sum(reports) == len(jobs) and min(reports) >= 1
    # by the k-th report, at least the shortest episodes' steps have been taken
    done = np.cumsum(reports)
    shortest = np.cumsum(np.sort(lengths))
    assert all(steps_at[k] >= shortest[done[k] - 1] for k in range(len(reports)))
    assert steps_at[-1] == res["env_steps"]


def test_rollout_bar_counts_episodes_and_ends_at_100_percent(tmp_path, tiny_dt, dt_checkpoint_file, run_cli):
    ckpt = dt_checkpoint_file(tmp_path, tiny_dt("primal+dt", K=5))
    p = run_cli("eval.rollout", f"checkpoint={ckpt}", "episodes=3", "targets=3600,1800", "max_steps=40",
                "num_envs=2", "progress=true", f"out={tmp_path / 'r.json'}", terminal=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_counts_episodes(bar_states(p.stderr, "hopper-medium"), 3 * 2)


def test_training_evaluation_bar_counts_episodes(tmp_path, hopper_file, run_cli):
    p = run_cli("primal_dt.train", "preset=smoke", f"data_source=d4rl:{hopper_file}", f"out={tmp_path}",
                "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.s=8", "K=5", "batch_size=8",
                "warmup_steps=1", "steps=2", "eval.every=0", "eval.final_episodes=3", "eval.targets=3000,1500",
                "eval.max_steps=25", "eval.num_envs=2", "threads=1", "tensorboard=false", "progress=true",
                terminal=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_counts_episodes(bar_states(p.stderr, "eval at step 2"), 3 * 2)
