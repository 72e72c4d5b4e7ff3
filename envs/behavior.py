"""Behaviour-policy training for the collector: SAC in a Gymnasium MuJoCo simulator.

D4RL and Minari made their medium / expert / replay datasets from the checkpoints and replay
buffer of one SAC run; this module produces exactly those ingredients, resumably, so that a
killed multi-hour run continues where it stopped.

Layout of ``workdir`` (every file written atomically, temp + rename):
  sac_step0010000.pt ...    SAC checkpoints: the networks' and optimizers' tensors and the step
                            counters, plain data read with ``torch.load(weights_only=True)``
  replay.npz                replay buffer as of the newest checkpoint, as arrays (read with
                            ``allow_pickle=False``; append-only while training, so its first N
                            transitions are the buffer "up to step N")
  evals.json                [{step, return_mean, return_std, stoch_return_mean, episodes}, ...]
  meta.json                 env id, seed, total steps requested
  .lock                     held (``primal_dt.run.lock``, an OS file lock the kernel drops when the trainer
                            exits in any way) by the process training here, so that two trainers never
                            share a directory

Nothing here unpickles: stable-baselines3's own files (``.zip`` models, ``replay.pkl``) are pickles,
which run whatever code they name when loaded, so a directory holding only those is refused with
the way to convert them (``OLD_FORMAT``) in the user's own trusted environment.

stable-baselines3 is an optional extra (``pip install primal-dt[collect]``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from primal_dt.run import json_reader, lock

CKPT_RE = re.compile(r"sac_step(\d+)\.pt$")
REPLAY = "replay.npz"
REPLAY_ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")
OLD_FORMAT = ("{what} is in stable-baselines3's pickle format, which can run any code when loaded, so "
              "primal-dt does not read it. If you made it yourself and trust it, convert the directory once "
              "in your own environment: python -c \"from envs.behavior import convert_sb3; "
              "convert_sb3('{workdir}')\" (this unpickles it); otherwise delete it and train again")


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


LOCK_NAME = lock.FILENAME


def trainer(workdir: str | Path) -> str | None:
    """Who is training in ``workdir`` right now, in words ("process 1234"), else None."""
    return lock.holder(workdir)


def list_checkpoints(workdir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every policy checkpoint in ``workdir``, oldest first; a directory of
    stable-baselines3 pickles only (an older release's, or someone else's) is a ValueError saying how
    to convert it."""
    workdir = Path(workdir)
    old = sorted(workdir.glob("sac_step*.zip"))
    if old and not list(workdir.glob("sac_step*.pt")):
        raise ValueError(OLD_FORMAT.format(what=f"{old[0]} (and every sac_step*.zip in {workdir})", workdir=workdir))
    out = []
    for p in workdir.glob("sac_step*.pt"):
        m = CKPT_RE.search(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def save_checkpoint(model, path: Path) -> None:
    """The SAC model's tensors (networks, optimizers, entropy coefficient) and step counters, as plain
    data: what resuming training and rolling the policy out need, without a pickle."""
    import torch

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"params": model.get_parameters(), "log_ent_coef": model.log_ent_coef.detach().clone(),
                "num_timesteps": int(model.num_timesteps), "n_updates": int(model._n_updates)}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict:
    """A checkpoint of ``save_checkpoint``, read with ``weights_only=True`` (torch's warnings about
    pickles silenced, so only this refusal prints); anything else is a ValueError naming the file."""
    import pickle
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ck = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as err:
        raise ValueError(f"{path} is not a primal-dt behaviour checkpoint (plain tensors only; "
                         f"{type(err).__name__}: {str(err).splitlines()[0][:200]})") from err
    if not (isinstance(ck, dict) and isinstance(ck.get("params"), dict) and "policy" in ck["params"]):
        raise ValueError(f"{path} is not a primal-dt behaviour checkpoint (expected params.policy)")
    return ck


def save_replay(model, path: Path) -> None:
    """The replay buffer as arrays (``REPLAY_ARRAYS``, ``pos``, ``full``) in an ``.npz``."""
    rb = model.replay_buffer
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, pos=rb.pos, full=rb.full, **{k: getattr(rb, k) for k in REPLAY_ARRAYS})
    os.replace(tmp, path)


def load_replay(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of ``save_replay``'s file (``allow_pickle=False``: an object array is refused);
    ``replay.pkl`` (stable-baselines3's pickle) is a ValueError saying how to convert it."""
    path = Path(path)
    if not path.exists() and path.with_name("replay.pkl").exists():
        raise ValueError(OLD_FORMAT.format(what=path.with_name("replay.pkl"), workdir=path.parent))
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in (*REPLAY_ARRAYS, "pos", "full")}
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path} is not a replay buffer of arrays ({err})") from err


def convert_sb3(workdir: str | Path) -> list[Path]:
    """Write ``save_checkpoint`` / ``save_replay`` files beside a directory's stable-baselines3 files
    (``sac_step*.zip``, ``replay.pkl``); returns what it wrote. It UNPICKLES them, which runs any code
    they name: for files you made and trust, called by you; primal-dt never calls it."""
    _require_sb3()
    from stable_baselines3 import SAC

    workdir, written, model = Path(workdir), [], None
    for z in sorted(workdir.glob("sac_step*.zip")):
        model = SAC.load(z, device="cpu")
        model.num_timesteps = int(re.search(r"(\d+)", z.stem).group(1))
        save_checkpoint(model, z.with_suffix(".pt"))
        written.append(z.with_suffix(".pt"))
    if model is not None and (workdir / "replay.pkl").exists():
        model.load_replay_buffer(workdir / "replay.pkl")
        save_replay(model, workdir / REPLAY)
        written.append(workdir / REPLAY)
    return written


def read_evals(workdir: str | Path) -> list[dict]:
    """``evals.json``'s entries, each checked (a damaged file is one ValueError naming it); [] before any."""
    p = Path(workdir) / "evals.json"
    if not p.exists():
        return []
    evals = json_reader.read(p)
    fields = {"step": int, "return_mean": float, "return_std": float, "stoch_return_mean": float, "episodes": int}
    required = ("step", "return_mean")  # what the collector selects by; the others are checked when present
    if not isinstance(evals, list) or not all(
            isinstance(e, dict) and all(_of(e.get(k), kind) for k, kind in fields.items() if k in required or k in e)
            for e in evals):
        raise ValueError(f"{p} is not the evaluations file envs.behavior writes (a list of "
                         f"{{{', '.join(fields)}}}, numbers); delete it to evaluate the checkpoints again")
    return evals


def read_meta(workdir: str | Path) -> dict | None:
    """``meta.json`` (env id, seed, total steps), checked; None before a trainer wrote one."""
    p = Path(workdir) / "meta.json"
    if not p.exists():
        return None
    meta = json_reader.read(p)
    fields = {"env_id": str, "seed": int, "total_steps": int}
    if not isinstance(meta, dict) or not all(_of(meta.get(k), kind) for k, kind in fields.items()):
        raise ValueError(f"{p} is not the work file envs.behavior writes ({{{', '.join(fields)}}}); the "
                         "directory is damaged: use another work directory")
    return meta


def _of(v, kind: type) -> bool:
    if isinstance(v, bool):
        return False
    return isinstance(v, (int, float)) if kind is float else isinstance(v, kind)


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
    # one trainer per directory (two would interleave files), held before anything in it is read
    lock.hold(workdir, "behaviour-policy work directory")
    try:
        meta_path = workdir / "meta.json"
        meta = read_meta(workdir)
        if meta is not None:
            if meta["env_id"] != cfg.env_id:
                raise ValueError(
                    f"{workdir} holds a behaviour policy for {meta['env_id']}, not {cfg.env_id}; "
                    "use another work directory"
                )
        _atomic_json(meta_path, {"env_id": cfg.env_id, "seed": cfg.seed, "total_steps": cfg.total_steps})
        return _train(workdir, cfg, progress)
    finally:
        lock.release(workdir)


def _train(workdir: Path, cfg: BehaviorConfig, progress: bool) -> Path:
    from stable_baselines3 import SAC
    from stable_baselines3.common.callbacks import BaseCallback

    from envs.vector import make_sim

    env = make_sim(cfg.env_id)
    ckpts = list_checkpoints(workdir)
    model = SAC("MlpPolicy", env, buffer_size=cfg.total_steps, seed=cfg.seed, device="cpu", verbose=0)
    step0 = 0
    if ckpts:
        step0, path = ckpts[-1]
        ck = load_checkpoint(path)
        model.set_parameters(ck["params"], exact_match=True, device="cpu")
        model.log_ent_coef.data.copy_(ck["log_ent_coef"])
        model.num_timesteps, model._n_updates = ck["num_timesteps"], ck["n_updates"]
        if (workdir / REPLAY).exists() or (workdir / "replay.pkl").exists():
            replay, rb = load_replay(workdir / REPLAY), model.replay_buffer
            n = min(len(replay["rewards"]), rb.buffer_size)
            for k in REPLAY_ARRAYS:
                getattr(rb, k)[:n] = replay[k][:n]
            rb.pos, rb.full = min(int(replay["pos"]), n) % rb.buffer_size, bool(replay["full"]) and n == rb.buffer_size
        print(f"[behavior] resuming {cfg.env_id} SAC from {path.name} (step {step0})", flush=True)
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
                save_checkpoint(self.model, workdir / f"sac_step{t:07d}.pt")
                save_replay(self.model, workdir / REPLAY)
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
    from primal_dt.run import errors
    from primal_dt.run.cli import parse

    def run(argv):
        args = parse(BehaviorConfig, argv, prog="python -m envs.behavior", description=__doc__.split("\n\n")[0])
        out = Path(os.environ.get("PRIMAL_DT_BEHAVIOR_DIR", f"runs/behavior/{args.env_id}-seed{args.seed}"))
        return train_behavior(out, args)

    return errors.main(run, argv)  # a busy or planted-on directory: one error line, as every entry point


if __name__ == "__main__":
    main()
