"""Collect new offline datasets the way D4RL and Minari made theirs.

    python -m envs.collect env=hopper level=medium steps=1000000

1. Train (or resume, or reuse) a SAC behaviour policy (``envs.behavior``).
2. Expert: the best checkpoint. Medium: the earliest whose stochastic return is within ``medium_tolerance`` of
   ``medium_fraction`` x the D4RL expert score, else the closest.
3. medium / expert: stochastic episodes of that policy, one seeded noise stream per episode, so an interrupted
   run resumes from its shards with the same result. medium-replay: the SAC replay buffer up to the medium one.
4. Write a D4RL-layout file and a Minari dataset (``primal-dt/<env>/<level>-v0``), with their provenance.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import io
import math
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from envs import behavior
from envs import d4rl as d4rl_io
from envs.minari_source import COLLECTED_NAMESPACE, has_local, minari_root, write_minari
from envs.registry import FAMILIES, get_spec
from envs.replica import replica_dirs, replica_file
from envs.vector import make_sim
from primal_dt.run import errors, lock
from primal_dt.run.checkpoint import write_atomic
from primal_dt.run.cli import fail, parse as parse_cli
from primal_dt.run.progress import Bar

Level = Literal["medium", "expert", "medium-replay", "medium-expert"]  # random: D4RL's file
EPISODE = ("observations", "actions", "rewards", "terminations", "truncations")  # observations [T+1], others [T]


@dataclass
class CollectConfig:
    env: str = "hopper"
    """hopper | halfcheetah | walker2d | ant"""
    level: Level = "medium"
    """the dataset's level"""
    sim: Literal["v4", "v5"] = "v4"
    """simulator version: v4 (D4RL's models, the default for env names) or v5 (Minari's)"""
    workdir: str | None = None
    """SAC run directory (none: runs/behavior/<GymId>-seed<seed>)"""
    train: bool = True
    """train/resume SAC up to train_steps; false: use the checkpoints as they are"""
    train_steps: int = 300_000
    """SAC environment steps"""
    checkpoint_every: int = 10_000
    """SAC steps between policy checkpoints (each evaluated; the medium policy is picked among them)"""
    seed: int = 0
    """SAC training seed"""
    rollout_seed: int = 1_000_000
    """episode i of the rollouts resets with rollout_seed + i"""
    steps: int = 1_000_000
    """environment steps per rolled-out dataset (whole episodes, at least this)"""
    medium_fraction: float = 1 / 3
    """medium = the checkpoint reaching this fraction of the D4RL expert score ..."""
    medium_return: float | None = None
    """... or this return, if given"""
    medium_tolerance: float = 0.1
    """relative band around the medium target in which the earliest checkpoint wins"""
    medium_step: int | None = None
    """force the medium checkpoint (a SAC step)"""
    expert_step: int | None = None
    """force the expert checkpoint (a SAC step; none: the best)"""
    num_envs: int = 16
    """episodes rolled out side by side (one batched policy call per step)"""
    out: str | None = None
    """D4RL-format output directory (none: $PRIMAL_DT_DATA_DIR or ~/.primal-dt/datasets)"""
    write_d4rl: bool = True
    """write the D4RL-layout HDF5 file"""
    write_minari: bool = True
    """write the Minari dataset (primal-dt/<env>/<level>-v0)"""
    next_observations: bool = True
    """store D4RL's next_observations (false halves small replicas)"""
    overwrite: bool = False
    """replace existing output files"""
    threads: int = 1
    """torch CPU threads"""
    progress: bool = True
    """progress bars on a terminal; written to a file or a pipe, a plain progress line a minute instead
    (false: no bars)"""


def _score(e: dict) -> float:
    return float(e.get("stoch_return_mean", e["return_mean"]))


def medium_target(cfg: CollectConfig) -> float:
    return cfg.medium_return if cfg.medium_return is not None else cfg.medium_fraction * FAMILIES[cfg.env].ref_max


def select_checkpoints(evals: list[dict], cfg: CollectConfig):
    """(medium eval entry, expert eval entry) from ``evals.json`` entries (the module's step 2): the earliest
    medium checkpoint also keeps the medium-replay buffer as D4RL defined it."""
    if not evals:
        raise ValueError("no evaluated checkpoints yet (evals.json is empty); train first")
    by_step = {e["step"]: e for e in evals}
    for s in (cfg.medium_step, cfg.expert_step):
        if s is not None and s not in by_step:
            raise ValueError(f"no checkpoint at step {s}; have {sorted(by_step)}")
    expert = by_step[cfg.expert_step] if cfg.expert_step is not None else max(evals, key=_score)
    if cfg.medium_step is not None:
        return by_step[cfg.medium_step], expert
    target, ordered = medium_target(cfg), sorted(evals, key=lambda e: e["step"])
    inside = [e for e in ordered if abs(_score(e) - target) <= cfg.medium_tolerance * abs(target)]
    medium = inside[0] if inside else min(ordered, key=lambda e: abs(_score(e) - target))
    return medium, expert


def plot_evals(evals: list[dict], medium: dict, expert: dict, target: float, path: Path) -> Path:
    """Return of every checkpoint, the chosen medium/expert policies marked: the choice checked at a glance."""
    from matplotlib.figure import Figure  # no pyplot: no backend to pick, no global figure to close

    ev = sorted(evals, key=lambda e: e["step"])
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot([e["step"] for e in ev], [e["return_mean"] for e in ev], "o-", ms=3, label="deterministic")
    ax.plot([e["step"] for e in ev], [_score(e) for e in ev], "s-", ms=3, alpha=0.7, label="stochastic")
    ax.axhline(target, color="gray", ls="--", lw=1, label=f"medium target {target:.0f}")
    for e, name, c in ((medium, "medium", "tab:orange"), (expert, "expert", "tab:green")):
        ax.plot([e["step"]], [_score(e)], "*", ms=14, color=c, label=f"{name}: step {e['step']}")
    ax.set(xlabel="SAC environment steps", ylabel="episode return")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return write_atomic(path, buf.getbuffer(), "plot of the checkpoints' returns")


class SACPolicy:
    """stable-baselines3's SAC policy with the weights of a ``behavior.save_checkpoint`` file (of the simulator
    ``env``), as a batched numpy policy whose noise the caller supplies: tanh(mean + std * eps) in the box."""

    def __init__(self, path: str | Path, env):
        from stable_baselines3.sac.policies import SACPolicy as Policy

        self.policy = Policy(env.observation_space, env.action_space, lambda _: 0.0)
        self.policy.load_state_dict(behavior.load_checkpoint(path)["params"]["policy"])

    def __call__(self, obs: np.ndarray, eps: np.ndarray | None) -> np.ndarray:
        with torch.no_grad():
            mean, log_std, _ = self.policy.actor.get_action_dist_params(torch.as_tensor(obs, dtype=torch.float32))
        u = mean.double().numpy() + (0 if eps is None else np.exp(log_std.double().numpy()) * eps)
        return self.policy.unscale_action(np.tanh(u))


def rollout_episodes(policy, make_env, seeds: list[int], act_dim: int, bar=None) -> list[dict]:
    """One episode per seed, side by side; episode i resets with seeds[i] and draws its noise from its own
    np.random.default_rng(seeds[i]), so it does not depend on its neighbours."""
    envs = [make_env() for _ in seeds]
    rngs = [np.random.default_rng(s) for s in seeds]
    eps = [{k: [] for k in EPISODE} for _ in seeds]
    for ep, env, s in zip(eps, envs, seeds):
        ep["observations"].append(env.reset(seed=int(s))[0])
    live = list(range(len(seeds)))
    while live:
        noise = np.stack([rngs[i].standard_normal(act_dim) for i in live])
        actions = policy(np.stack([eps[i]["observations"][-1] for i in live]), noise)
        if bar is not None:
            bar.update(len(live))
        for i, a in zip(live, actions):
            obs, r, term, trunc, _ = envs[i].step(a)
            for k, v in zip(EPISODE, (obs, a, r, term, trunc)):
                eps[i][k].append(v)
        live = [i for i in live if not (eps[i]["terminations"][-1] or eps[i]["truncations"][-1])]
    for env in envs:
        env.close()
    return [{**{k: np.asarray(ep[k], bool if k in EPISODE[3:] else np.float32) for k in EPISODE},
             "seed": int(s)} for ep, s in zip(eps, seeds)]


def _save_shard(path: Path, episodes: list[dict]) -> None:
    arrays = {k: np.concatenate([ep[k] for ep in episodes]) for k in EPISODE}
    arrays["lengths"] = np.array([len(ep["rewards"]) for ep in episodes])
    arrays["seeds"] = np.array([ep["seed"] for ep in episodes])
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_atomic(path, buf.getbuffer(), "rollout shard")


def _load_shard(path: Path) -> list[dict]:
    """The episodes of a shard; one whose episode lengths do not add up to its arrays is a ValueError."""
    try:
        z = np.load(path, allow_pickle=False)
        lengths, seeds = z["lengths"], z["seeds"]
        arrays = {k: z[k] for k in EPISODE}
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"rollout shard {path} cannot be read ({err}); delete it to collect it again") from None
    n = len(lengths)
    steps = int(lengths.sum()) if n and lengths.dtype.kind in "iu" and (lengths >= 0).all() else -1
    want = {"observations": steps + n, **{k: steps for k in arrays if k != "observations"}}
    if steps < 0 or len(seeds) != n or any(len(arrays[k]) != m for k, m in want.items()):
        raise ValueError(f"rollout shard {path} is damaged: its {n} episode lengths (total {steps}) do not match "
                         f"its arrays ({', '.join(f'{k} {len(v)}' for k, v in arrays.items())}); delete it to "
                         "collect it again")
    bad = next((k for k in ("observations", "actions", "rewards") if not np.isfinite(arrays[k]).all()), None)
    if bad is not None:  # found here, not when training refuses the dataset made of it
        raise ValueError(f"rollout shard {path} holds NaN or inf in its {bad}, which no simulator step gives; the file "
                         "is damaged: delete it to collect it again")
    parts = {k: np.split(v, np.cumsum(lengths + (k == "observations"))[:-1]) for k, v in arrays.items()}
    return [{**{k: v[e] for k, v in parts.items()}, "seed": seed} for e, seed in enumerate(seeds.tolist())]


def collect_rollouts(ckpt: Path, gym_id: str, act_dim: int, steps: int, seed0: int,
                     cache: Path, num_envs: int, progress: bool = True, desc: str = "") -> list[dict]:
    """At least ``steps`` steps of whole episodes, in shards of ``num_envs`` episodes under ``cache``, so a rerun
    continues where an interrupted one stopped."""
    cache.mkdir(parents=True, exist_ok=True)
    episodes: list[dict] = []
    for shard in sorted(cache.glob("shard_*.npz")):
        episodes += _load_shard(shard)
    done = sum(len(ep["rewards"]) for ep in episodes)
    bar = Bar(total=steps, initial=min(done, steps), desc=desc or f"rollouts {gym_id}", unit="step", mininterval=2,
              progress=progress)
    if done < steps:
        policy = SACPolicy(ckpt, make_sim(gym_id))
        while done < steps:
            seeds = [seed0 + len(episodes) + i for i in range(num_envs)]
            new = rollout_episodes(policy, lambda: make_sim(gym_id), seeds, act_dim, bar=bar)
            _save_shard(cache / f"shard_{len(episodes):06d}.npz", new)
            episodes += new
            done += sum(len(ep["rewards"]) for ep in new)
    bar.close()
    return episodes


def replay_episodes(replay_path: Path, upto: int, action_space=None) -> list[dict]:
    """Episodes of the (append-only) replay buffer's first ``upto`` transitions: the buffer as it was at that
    checkpoint, its unfinished last episode dropped, actions mapped back from SAC's [-1, 1] to the box."""
    rb = behavior.load_replay(replay_path)
    n = min(int(upto), len(rb["rewards"]) if rb["full"] else int(rb["pos"]))
    obs, nxt = rb["observations"][:n, 0], rb["next_observations"][:n, 0]
    act, rew = rb["actions"][:n, 0].astype(np.float64), rb["rewards"][:n, 0]
    done = rb["dones"][:n, 0].astype(bool)
    timeout = rb["timeouts"][:n, 0].astype(bool)
    if action_space is not None:
        low, high = action_space.low, action_space.high
        act = low + 0.5 * (act + 1.0) * (high - low)
    ends = (np.flatnonzero(done) + 1).tolist()
    return [{"observations": np.concatenate([obs[s:e], nxt[e - 1:e]]).astype(np.float32),
             "actions": act[s:e].astype(np.float32), "rewards": rew[s:e].astype(np.float32),
             "terminations": ~timeout[s:e] & done[s:e], "truncations": timeout[s:e].copy(), "seed": None}
            for s, e in zip([0] + ends[:-1], ends)]


def episodes_to_d4rl(episodes: list[dict], next_observations: bool = True) -> dict[str, np.ndarray]:
    out = {"observations": np.concatenate([ep["observations"][:-1] for ep in episodes]),
           "actions": np.concatenate([ep["actions"] for ep in episodes]),
           "rewards": np.concatenate([ep["rewards"] for ep in episodes]),
           "terminals": np.concatenate([ep["terminations"] for ep in episodes]),
           "timeouts": np.concatenate([ep["truncations"] & ~ep["terminations"] for ep in episodes])}
    if next_observations:
        out["next_observations"] = np.concatenate([ep["observations"][1:] for ep in episodes])
    return out


def check(cfg: CollectConfig) -> None:
    """Every option, before a policy is trained or a file touched: a bad one is one ``error:`` line."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            fail(msg)

    need(cfg.env in FAMILIES, f"env must be one of {sorted(FAMILIES)}, got {cfg.env!r}")
    need(cfg.out is None or bool(cfg.out.strip()), "out= is empty: give the directory to write the dataset into "
         "(leave out= out for the default data folder)")
    need(cfg.workdir is None or bool(cfg.workdir.strip()), "workdir= is empty: give the SAC run directory (leave "
         "workdir= out for runs/behavior/<GymId>-seed<seed>)")
    finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)  # noqa: E731
    for key, low in (("train_steps", 1), ("checkpoint_every", 1), ("steps", 1), ("num_envs", 1), ("threads", 1),
                     ("seed", 0), ("rollout_seed", 0), ("medium_step", 0), ("expert_step", 0)):
        value = getattr(cfg, key)
        need(value is None or value >= low, f"{key} must be >= {low}, got {value}")
    need(cfg.seed < 2**32, f"seed must be < 2**32 (numpy's global seed, which SAC sets), got {cfg.seed}")
    need(cfg.threads <= 4096, f"threads must be <= 4096, got {cfg.threads}")
    need(finite(cfg.medium_fraction) and 0 < cfg.medium_fraction <= 1,
         f"medium_fraction must be in (0, 1], got {cfg.medium_fraction}")
    need(cfg.medium_return is None or finite(cfg.medium_return),
         f"medium_return must be a finite return, got {cfg.medium_return}")
    need(finite(cfg.medium_tolerance) and cfg.medium_tolerance >= 0,
         f"medium_tolerance must be >= 0, got {cfg.medium_tolerance}")
    # contradictions found only after hours of SAC training otherwise
    need(cfg.write_d4rl or cfg.write_minari, "write_d4rl=false and write_minari=false leave nothing to write")
    need(not cfg.out or not Path(cfg.out).exists() or Path(cfg.out).is_dir(),
         f"out={cfg.out} is a file; give the directory to write the dataset into")
    need(not cfg.train or cfg.checkpoint_every <= cfg.train_steps, f"checkpoint_every={cfg.checkpoint_every} is more "
         f"than train_steps={cfg.train_steps}: no policy would be saved to collect with")


def run(cfg: CollectConfig) -> dict:
    """The whole collection; returns the provenance written with the data."""
    check(cfg)
    behavior._require_sb3()
    torch.set_num_threads(cfg.threads)
    spec = get_spec(f"{cfg.env}-{cfg.level}")
    gym_id = f"{FAMILIES[cfg.env].sim}-{cfg.sim}"
    workdir = Path(cfg.workdir or f"runs/behavior/{gym_id}-seed{cfg.seed}")
    out_dir = Path(cfg.out) if cfg.out else replica_dirs()[0]
    d4rl_path = out_dir / replica_file(cfg.env, cfg.level)
    minari_id = f"{COLLECTED_NAMESPACE}/{cfg.env}/{cfg.level}-v0"
    if not cfg.overwrite and cfg.write_d4rl and d4rl_path.exists():
        fail(f"{d4rl_path} exists; pass overwrite=true to replace it")
    if not cfg.overwrite and cfg.write_minari and has_local(minari_id):
        fail(f"Minari dataset {minari_id} exists under {minari_root()}; pass overwrite=true")

    # 1. behaviour policy
    recorded = behavior.read_meta(workdir)
    if recorded is not None and recorded["env_id"] != gym_id:
        fail(f"{workdir} trains {recorded['env_id']}, not {gym_id}")
    have = max([s for s, _ in behavior.list_checkpoints(workdir)], default=0)
    if cfg.train and have < cfg.train_steps:
        who = lock.holder(workdir)
        if who is not None:
            fail(f"{workdir} is being trained by {who}; run again when it is done, or pass train=false to use "
                 f"its {have}-step checkpoints now")
        print(f"[collect] training SAC on {gym_id} in {workdir} up to {cfg.train_steps} steps (have {have})",
              flush=True)
        behavior.train_behavior(workdir, behavior.BehaviorConfig(
            env_id=gym_id, total_steps=cfg.train_steps, checkpoint_every=cfg.checkpoint_every,
            seed=cfg.seed, threads=cfg.threads), progress=cfg.progress)
    else:
        print(f"[collect] using the checkpoints in {workdir} (newest: step {have})", flush=True)
    ckpts = dict(behavior.list_checkpoints(workdir))
    evals = [e for e in behavior.read_evals(workdir) if e["step"] in ckpts]
    medium, expert = select_checkpoints(evals, cfg)
    target = medium_target(cfg)
    print(f"[collect] medium policy: step {medium['step']} (stochastic return {_score(medium):.1f}, "
          f"target {target:.0f}); expert policy: step {expert['step']} ({_score(expert):.1f})", flush=True)
    print(f"[collect] checkpoint returns drawn in {plot_evals(evals, medium, expert, target, workdir / 'evals.png')}",
          flush=True)

    # 2. episodes
    def rollouts(entry, seed0, tag):
        cache = workdir / "rollouts" / f"step{entry['step']:07d}-seed{seed0}-n{cfg.num_envs}"
        return collect_rollouts(ckpts[entry["step"]], gym_id, spec.act_dim, cfg.steps, seed0,
                                cache, cfg.num_envs, cfg.progress, desc=f"{tag} rollouts {gym_id}")

    parts = {}
    if cfg.level in ("medium", "medium-expert"):
        parts["medium"] = (medium, rollouts(medium, cfg.rollout_seed, "medium"))
    if cfg.level in ("expert", "medium-expert"):
        parts["expert"] = (expert, rollouts(expert, cfg.rollout_seed + 1_000_000, "expert"))
    if cfg.level == "medium-replay":
        space = make_sim(gym_id).action_space
        parts["replay"] = (medium, replay_episodes(workdir / behavior.REPLAY, medium["step"], space))
    episodes = [ep for _, eps in parts.values() for ep in eps]
    returns = np.array([float(np.sum(ep["rewards"], dtype=np.float64)) for ep in episodes])
    train_meta = behavior.read_meta(workdir) or {}
    policies = {k: {"step": e["step"], "return_stochastic": round(_score(e), 2),
                    "return_deterministic": round(float(e["return_mean"]), 2),
                    "episode_seeds": ([eps[0]["seed"], eps[-1]["seed"]] if eps and eps[0]["seed"] is not None
                                      else "SAC training (replay buffer)")}
                for k, (e, eps) in parts.items()}
    versions = {"python": platform.python_version()}
    for package in ("gymnasium", "mujoco", "stable-baselines3", "minari", "torch", "numpy"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[package] = md.version(package)
    main_part = next(iter(policies.values()))  # the medium policy where there is one (it comes first)
    provenance = {
        "collector": "envs.collect", "name": spec.name, "level": cfg.level, "gym_id": gym_id, "policies": policies,
        "not_published_data": True, "policy_step": main_part["step"], "policy_return": main_part["return_stochastic"],
        "steps": int(sum(len(ep["rewards"]) for ep in episodes)), "episodes": len(episodes),
        "dataset_return_mean": round(float(returns.mean()), 2), "dataset_return_std": round(float(returns.std()), 2),
        "train_seed": train_meta.get("seed", cfg.seed), "train_steps_available": max(ckpts),
        "medium_target_return": target, "ref_min_score": spec.ref_min, "ref_max_score": spec.ref_max,
        "workdir": str(workdir), "config": asdict(cfg), "versions": versions,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    # 3. files
    if cfg.write_d4rl:
        d4rl_io.write_d4rl(d4rl_path, episodes_to_d4rl(episodes, cfg.next_observations), provenance)
        print(f"[collect] wrote {d4rl_path} ({d4rl_path.stat().st_size / 1e6:.2f} MB)", flush=True)
    if cfg.write_minari:
        path = write_minari(minari_id, episodes, gym_id, metadata=provenance, ref_min_score=spec.ref_min,
                            ref_max_score=spec.ref_max, overwrite=cfg.overwrite,
                            description=f"{spec.name} replica collected by primal-dt envs.collect in {gym_id}")
        print(f"[collect] wrote Minari dataset {minari_id} at {path}", flush=True)
    print(f"[collect] {provenance['episodes']} episodes, {provenance['steps']:,} steps, "
          f"return {returns.mean():.1f} +- {returns.std():.1f}", flush=True)
    return provenance


def parse(argv: list[str] | None = None) -> CollectConfig:
    return parse_cli(CollectConfig, argv, prog="python -m envs.collect", description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> dict:
    def collect(argv: list[str]) -> dict:
        cfg = parse(argv)
        with errors.setup_errors(ImportError):  # a work file that is not what it should be, a busy directory, no SB3
            return run(cfg)

    return errors.main(collect, argv)  # a refused write: one line naming the file; Ctrl-C: status 130


if __name__ == "__main__":
    main()
