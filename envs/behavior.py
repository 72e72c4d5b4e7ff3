"""Behaviour-policy training for the collector: SAC in a Gymnasium MuJoCo simulator.

D4RL and Minari made their medium / expert / replay datasets from the checkpoints and replay
buffer of one SAC run; this module produces exactly those ingredients, resumably, so that a
killed multi-hour run continues where it stopped.

Layout of ``workdir`` (every file written atomically, temp + rename):
  sac_step0010000.zip ...   policy checkpoints (stable-baselines3 format)
  replay.pkl                replay buffer as of the newest checkpoint (append-only while
                            training, so its first N transitions are the buffer "up to step N")
  evals.json                [{step, return_mean, return_std, stoch_return_mean, episodes}, ...]
  meta.json                 env id, seed, total steps requested
  train.lock                pid of the process training here ("free" once it stops), so that
                            two trainers never share a directory

stable-baselines3 is an optional extra (``pip install primal-dt[collect]``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CKPT_RE = re.compile(r"sac_step(\d+)\.zip$")


def _require_sb3():
    try:
        import stable_baselines3  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "training a behaviour policy needs stable-baselines3: "
            "pip install 'primal-dt[collect]' (or pip install stable-baselines3)"
        ) from exc
    return stable_baselines3


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


LOCK_NAME = "train.lock"


def training_pid(workdir: str | Path) -> int | None:
    """Pid of a live process training in ``workdir`` (from its lock file), else None."""
    lock = Path(workdir) / LOCK_NAME
    try:
        pid = int(lock.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # stale lock of a killed run
    except PermissionError:
        pass
    return pid


def _acquire_lock(workdir: Path) -> Path:
    """One trainer per work directory: two would interleave checkpoints and replay buffers."""
    lock = workdir / LOCK_NAME
    pid = training_pid(workdir)
    if pid is not None and pid != os.getpid():
        raise RuntimeError(f"{workdir} is being trained by process {pid}; wait for it to finish "
                           f"(or remove {lock} if that process is not a trainer)")
    tmp = lock.with_suffix(f".{os.getpid()}")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, lock)
    return lock


def list_checkpoints(workdir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every policy checkpoint in ``workdir``, oldest first."""
    out = []
    for p in Path(workdir).glob("sac_step*.zip"):
        m = CKPT_RE.search(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def read_evals(workdir: str | Path) -> list[dict]:
    p = Path(workdir) / "evals.json"
    return json.loads(p.read_text()) if p.exists() else []


def evaluate_policy(model, env_id: str, episodes: int, seed: int, deterministic: bool) -> np.ndarray:
    """Undiscounted returns of ``episodes`` full episodes of an SB3 policy."""
    from envs.vector import make_sim

    env = make_sim(env_id)
    returns = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        done, total = False, 0.0
        while not done:
            act, _ = model.predict(obs, deterministic=deterministic)
            obs, r, term, trunc, _ = env.step(act)
            total += float(r)
            done = term or trunc
        returns.append(total)
    env.close()
    return np.asarray(returns)


@dataclass
class BehaviorConfig:
    """Options of ``python -m envs.behavior`` (the work directory: $PRIMAL_DT_BEHAVIOR_DIR, else
    runs/behavior/<env_id>-seed<seed>)."""

    env_id: str = "Hopper-v5"
    """Gymnasium simulator id"""
    total_steps: int = 300_000
    """SAC environment steps to reach (a resumed run continues up to this)"""
    checkpoint_every: int = 10_000
    """steps between policy checkpoints, each evaluated"""
    eval_episodes: int = 5
    """episodes per checkpoint evaluation"""
    seed: int = 0
    """SAC training seed"""
    threads: int = 1
    """torch CPU threads"""


def train_behavior(workdir: str | Path, cfg: BehaviorConfig, progress: bool = True) -> Path:
    """Train (or resume) SAC until ``cfg.total_steps``; returns ``workdir``."""
    _require_sb3()
    import torch

    torch.set_num_threads(cfg.threads)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    meta_path = workdir / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta["env_id"] != cfg.env_id:
            raise ValueError(
                f"{workdir} holds a behaviour policy for {meta['env_id']}, not {cfg.env_id}; "
                "use another work directory"
            )
    lock = _acquire_lock(workdir)
    try:
        _atomic_json(meta_path, {"env_id": cfg.env_id, "seed": cfg.seed, "total_steps": cfg.total_steps})
        return _train(workdir, cfg, progress)
    finally:
        # keep the file, without a pid: it marks this directory as lock-aware (see envs.collect)
        lock.write_text("free")


def _train(workdir: Path, cfg: BehaviorConfig, progress: bool) -> Path:
    from stable_baselines3 import SAC
    from stable_baselines3.common.callbacks import BaseCallback

    from envs.vector import make_sim

    env = make_sim(cfg.env_id)
    ckpts = list_checkpoints(workdir)
    if ckpts:
        step0, path = ckpts[-1]
        model = SAC.load(path, env=env, device="cpu")
        if (workdir / "replay.pkl").exists():
            model.load_replay_buffer(workdir / "replay.pkl")
        print(f"[behavior] resuming {cfg.env_id} SAC from {path.name} (step {step0})", flush=True)
    else:
        step0 = 0
        model = SAC("MlpPolicy", env, buffer_size=cfg.total_steps, seed=cfg.seed, device="cpu", verbose=0)
    evals = [e for e in read_evals(workdir) if e["step"] <= step0]

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.total_steps, initial=step0, desc=f"SAC {cfg.env_id}", unit="step",
                   mininterval=5)

    class _Ckpt(BaseCallback):
        def _on_step(self) -> bool:
            t = self.num_timesteps
            if bar is not None:
                bar.update(t - bar.n)
            if t % cfg.checkpoint_every == 0:
                det = evaluate_policy(self.model, cfg.env_id, cfg.eval_episodes, 10_000 + t, True)
                sto = evaluate_policy(self.model, cfg.env_id, cfg.eval_episodes, 20_000 + t, False)
                tmp = workdir / f"sac_step{t:07d}.tmp.zip"
                self.model.save(tmp)
                os.replace(tmp, workdir / f"sac_step{t:07d}.zip")
                rtmp = workdir / "replay.tmp.pkl"
                self.model.save_replay_buffer(rtmp)
                os.replace(rtmp, workdir / "replay.pkl")
                evals.append({"step": t, "return_mean": float(det.mean()), "return_std": float(det.std()),
                              "stoch_return_mean": float(sto.mean()), "episodes": cfg.eval_episodes})
                _atomic_json(workdir / "evals.json", evals)
                if bar is not None:
                    bar.set_postfix(ret=f"{det.mean():.0f}")
                else:
                    print(f"[behavior] step {t}: return {det.mean():.1f} +- {det.std():.1f}", flush=True)
            return True

    remaining = cfg.total_steps - step0
    if remaining > 0:
        model.learn(remaining, callback=_Ckpt(), reset_num_timesteps=step0 == 0)
    if bar is not None:
        bar.close()
    return workdir


def main(argv: list[str] | None = None) -> Path:
    """``python -m envs.behavior``: train (or resume) the SAC behaviour policy on its own."""
    from primal_dt.cli import parse

    args = parse(BehaviorConfig, argv, prog="python -m envs.behavior", description=__doc__.split("\n\n")[0])
    out = Path(os.environ.get("PRIMAL_DT_BEHAVIOR_DIR", f"runs/behavior/{args.env_id}-seed{args.seed}"))
    return train_behavior(out, args)


if __name__ == "__main__":
    main()
