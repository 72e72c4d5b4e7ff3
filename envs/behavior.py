"""Behaviour-policy training for the collector: SAC in a Gymnasium MuJoCo simulator, resumably.

D4RL and Minari made their medium / expert / replay datasets from the checkpoints and replay buffer of one
SAC run. ``workdir`` holds, each written atomically: ``sac_step<N>.pt`` (tensors only, read with
``weights_only=True``), ``replay.npz`` (append-only, so its first N transitions are the buffer "up to step N";
read with ``allow_pickle=False``), ``evals.json``, ``meta.json`` and ``.lock`` (one trainer per directory).
Nothing here unpickles: stable-baselines3's own files are pickles, which run whatever code they name.
"""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from envs.vector import make_sim
from primal_dt.run import checkpoint, errors, json_reader, lock
from primal_dt.run.checkpoint import save_atomic, write_atomic
from primal_dt.run.cli import parse
from primal_dt.run.progress import Bar

CKPT_RE = re.compile(r"sac_step(\d+)\.pt$")
REPLAY = "replay.npz"
REPLAY_ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")


def _require_sb3():
    try:
        import stable_baselines3  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("training a behaviour policy needs stable-baselines3: pip install 'primal-dt[collect]' "
                          "(or pip install stable-baselines3)") from exc


def list_checkpoints(workdir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every policy checkpoint, oldest first."""
    return sorted((int(m.group(1)), p) for p in Path(workdir).glob("sac_step*.pt") if (m := CKPT_RE.search(p.name)))


def save_checkpoint(model, path: Path) -> None:
    """What resuming SAC and rolling its policy out need, as plain tensors."""
    save_atomic({"params": model.get_parameters(), "log_ent_coef": model.log_ent_coef.detach().clone(),
                 "num_timesteps": int(model.num_timesteps), "n_updates": int(model._n_updates)}, path,
                "behaviour-policy checkpoint")


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint of ``save_checkpoint``; anything else is a ValueError naming the file."""
    ck = checkpoint.load(path, keys=("params",))
    if not (isinstance(ck["params"], dict) and "policy" in ck["params"]):
        raise ValueError(f"{path} is not a primal-dt behaviour checkpoint (expected params.policy)")
    return ck


def save_replay(model, path: Path) -> None:
    rb = model.replay_buffer
    buf = io.BytesIO()
    np.savez(buf, pos=rb.pos, full=rb.full, **{k: getattr(rb, k) for k in REPLAY_ARRAYS})
    write_atomic(path, buf.getbuffer(), "replay buffer")


def load_replay(path: str | Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in (*REPLAY_ARRAYS, "pos", "full")}
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path} is not a replay buffer of arrays ({err})") from err


def read_evals(workdir: str | Path) -> list[dict]:
    """``evals.json``'s entries, each checked (the collector selects by step and return_mean: those are required,
    the others checked when present); [] before any."""
    p = Path(workdir) / "evals.json"
    evals = json_reader.read(p) if p.exists() else []
    fields = {"step": int, "return_mean": float, "return_std": float, "stoch_return_mean": float, "episodes": int}
    if not isinstance(evals, list) or not all(_valid(e, fields, ("step", "return_mean")) for e in evals):
        raise ValueError(f"{p} is not the evaluations file envs.behavior writes (a list of "
                         f"{{{', '.join(fields)}}}, numbers); delete it to evaluate the checkpoints again")
    return evals


def read_meta(workdir: str | Path) -> dict | None:
    """``meta.json``, checked; None before a trainer wrote one."""
    p, fields = Path(workdir) / "meta.json", {"env_id": str, "seed": int, "total_steps": int}
    if not p.exists():
        return None
    meta = json_reader.read(p)
    if not _valid(meta, fields, tuple(fields)):
        raise ValueError(f"{p} is not the work file envs.behavior writes ({{{', '.join(fields)}}}); the "
                         "directory is damaged: use another work directory")
    return meta


def _valid(entry, fields: dict, required: tuple) -> bool:
    """A dict whose ``required`` fields, and the others it has, are of their kinds (a bool is no number)."""
    return isinstance(entry, dict) and all(
        not isinstance(entry.get(k), bool) and isinstance(entry.get(k), (int, float) if kind is float else kind)
        for k, kind in fields.items() if k in required or k in entry)


def evaluate_policy(model, env_id: str, episodes: int, seed: int, deterministic: bool) -> np.ndarray:
    env = make_sim(env_id)
    returns = []
    for ep in range(episodes):
        obs, _ = env.reset(seed=seed + ep)
        done, total = False, 0.0
        while not done:
            obs, r, term, trunc, _ = env.step(model.predict(obs, deterministic=deterministic)[0])
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
    _require_sb3()
    torch.set_num_threads(cfg.threads)
    workdir = Path(workdir)
    # one trainer per directory (two would interleave files), held before anything in it is read
    lock.hold(workdir, "behaviour-policy work directory")
    try:
        meta = read_meta(workdir)
        if meta is not None and meta["env_id"] != cfg.env_id:
            raise ValueError(f"{workdir} holds a behaviour policy for {meta['env_id']}, not {cfg.env_id}; "
                             "use another work directory")
        meta = json.dumps({"env_id": cfg.env_id, "seed": cfg.seed, "total_steps": cfg.total_steps})
        write_atomic(workdir / "meta.json", meta, "behaviour-policy metadata")
        return _train(workdir, cfg, progress)
    finally:
        lock.release(workdir)


def _train(workdir: Path, cfg: BehaviorConfig, progress: bool) -> Path:
    from stable_baselines3 import SAC
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.logger import Logger

    ckpts = list_checkpoints(workdir)
    model = SAC("MlpPolicy", make_sim(cfg.env_id), buffer_size=cfg.total_steps, seed=cfg.seed, device="cpu", verbose=0)
    # SB3's default logger (verbose=0, no tensorboard_log) makes an empty folder in /tmp at every learn(): ours
    # writes nowhere; the progress and evaluations go to the bar and evals.json
    model.set_logger(Logger(folder=None, output_formats=[]))
    step0 = 0
    if ckpts:
        step0, path = ckpts[-1]
        ck = load_checkpoint(path)
        model.set_parameters(ck["params"], exact_match=True, device="cpu")
        model.log_ent_coef.data.copy_(ck["log_ent_coef"])
        model.num_timesteps, model._n_updates = ck["num_timesteps"], ck["n_updates"]
        if (workdir / REPLAY).exists():
            replay, rb = load_replay(workdir / REPLAY), model.replay_buffer
            n = min(len(replay["rewards"]), rb.buffer_size)
            for k in REPLAY_ARRAYS:
                getattr(rb, k)[:n] = replay[k][:n]
            rb.pos, rb.full = min(int(replay["pos"]), n) % rb.buffer_size, bool(replay["full"]) and n == rb.buffer_size
        print(f"[behavior] resuming {cfg.env_id} SAC from {path.name} (step {step0})", flush=True)
    evals = [e for e in read_evals(workdir) if e["step"] <= step0]
    bar = Bar(total=cfg.total_steps, initial=step0, desc=f"SAC {cfg.env_id}", unit="step", mininterval=5,
              progress=progress)

    class _Ckpt(BaseCallback):
        def _on_step(self) -> bool:
            t = self.num_timesteps
            bar.update(t - bar.n)
            if t % cfg.checkpoint_every == 0:
                det = evaluate_policy(self.model, cfg.env_id, cfg.eval_episodes, 10_000 + t, True)
                sto = evaluate_policy(self.model, cfg.env_id, cfg.eval_episodes, 20_000 + t, False)
                save_checkpoint(self.model, workdir / f"sac_step{t:07d}.pt")
                save_replay(self.model, workdir / REPLAY)
                evals.append({"step": t, "return_mean": float(det.mean()), "return_std": float(det.std()),
                              "stoch_return_mean": float(sto.mean()), "episodes": cfg.eval_episodes})
                write_atomic(workdir / "evals.json", json.dumps(evals, indent=1), "checkpoint evaluations")
                bar.set_postfix(ret=f"{det.mean():.0f}")
                if bar.disable:  # no bar drawn (progress=false, or not a terminal): a line per checkpoint
                    print(f"[behavior] step {t}: return {det.mean():.1f} +- {det.std():.1f}", flush=True)
            return True

    if cfg.total_steps > step0:
        model.learn(cfg.total_steps - step0, callback=_Ckpt(), reset_num_timesteps=step0 == 0)
    bar.close()
    return workdir


def main(argv: list[str] | None = None) -> Path:
    """``python -m envs.behavior``: train (or resume) the SAC behaviour policy on its own."""

    def run(argv):
        args = parse(BehaviorConfig, argv, prog="python -m envs.behavior", description=__doc__.split("\n\n")[0])
        out = Path(os.environ.get("PRIMAL_DT_BEHAVIOR_DIR", f"runs/behavior/{args.env_id}-seed{args.seed}"))
        return train_behavior(out, args)

    return errors.main(run, argv)  # a busy or planted-on directory: one error line, as every entry point


if __name__ == "__main__":
    main()
