"""Record one rollout episode with MuJoCo off-screen rendering: a GIF file and a TensorBoard entry.

Rendering needs an off-screen OpenGL backend (``MUJOCO_GL=egl`` with a GPU/EGL driver, or
``osmesa``). ``rendering_available`` probes a backend in a child process (a failed GL context can
abort the process that tries it), so the evaluator can say clearly why no video was recorded
instead of crashing after the rollout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

BACKENDS = ("egl", "osmesa")

_PROBE = """
import gymnasium as gym
env = gym.make({gym_id!r}, render_mode="rgb_array", width=32, height=32)
env.reset(seed=0)
frame = env.render()
assert frame is not None and frame.shape == (32, 32, 3), frame
print("ok")
"""


def rendering_available(backend: str | None = None, gym_id: str = "Hopper-v4",
                        timeout: float = 60.0) -> tuple[bool, str]:
    """(True, backend) when ``backend`` (default: $MUJOCO_GL, else egl then osmesa) renders; else
    (False, a message saying what failed and what to do)."""
    tried = [backend] if backend else ([os.environ["MUJOCO_GL"]] if os.environ.get("MUJOCO_GL") else list(BACKENDS))
    errors = []
    for b in tried:
        env = {**os.environ, "MUJOCO_GL": b, "PYOPENGL_PLATFORM": b}
        try:
            p = subprocess.run([sys.executable, "-c", _PROBE.format(gym_id=gym_id)], env=env, capture_output=True,
                               text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            errors.append(f"MUJOCO_GL={b}: timed out")
            continue
        if p.returncode == 0 and p.stdout.strip().endswith("ok"):
            return True, b
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        errors.append(f"MUJOCO_GL={b}: {last}")
    return False, ("no video: MuJoCo off-screen rendering is unavailable on this machine ("
                   + "; ".join(errors) + "). Install an EGL driver (GPU) or OSMesa (libosmesa6) and set "
                   "MUJOCO_GL=egl or MUJOCO_GL=osmesa; the rollout results are unaffected.")


def record_episode(model, spec, stats: dict, target: float, engine: str, seed: int, out_dir, gym_id=None,
                   max_steps: int | None = None, backend: str | None = None, size: int = 240, every: int = 2,
                   tensorboard: bool = True) -> dict:
    """Roll out one episode (reset seed ``seed``) rendering every ``every``-th frame; writes
    ``<out_dir>/episode-<engine>.gif`` (``-2``, ``-3``, ... when taken) and a TensorBoard video (or frame strip) under
    ``<out_dir>/video``. Returns {"path", "frames", "return", "length"} or {"path": None, "message"}."""
    ok, msg = rendering_available(backend, gym_id or spec.gym_id)
    if not ok:
        print(msg, file=sys.stderr)
        return {"path": None, "message": msg}
    os.environ["MUJOCO_GL"] = msg
    os.environ.setdefault("PYOPENGL_PLATFORM", msg)
    from agents.agent import Agent
    from envs import make_env

    env = make_env(spec.name, None, gym_id=gym_id, render_mode="rgb_array", width=size, height=size)
    agent = Agent(model, state_mean=stats["state_mean"], state_std=stats["state_std"],
                  reward_scale=stats["reward_scale"], target=target, engine=engine)
    agent.reset(1)
    obs, _ = env.reset(seed=seed)
    frames, ret, reward = [env.render()], 0.0, None
    for t in range(max_steps or spec.max_episode_steps):
        a = agent.act(obs[None], reward)[0]
        obs, r, term, trunc, _ = env.step(a)
        ret += float(r)
        reward = np.array([r], dtype=np.float32)
        if t % every == every - 1:
            frames.append(env.render())
        if term or trunc:
            break
    env.close()
    from PIL import Image

    from primal_dt import runtime

    # a new name (episode-stream-2.gif, ...) rather than over an earlier recording
    path = runtime.new_path(runtime.numbered(Path(out_dir) / f"episode-{engine}.gif"), runtime.create_file,
                            what="episode GIF")
    imgs = [Image.fromarray(f) for f in frames]
    with runtime.writing(path, "episode GIF"):
        imgs[0].save(path, save_all=True, append_images=imgs[1:], duration=int(1000 * every * 0.008), loop=0)
    result = {"path": str(path), "frames": len(frames), "return": ret, "length": t + 1, "backend": msg}
    if tensorboard:
        result["tensorboard"] = _to_tensorboard(frames, Path(out_dir) / "video", f"rollout/{engine}")
    return result


def _to_tensorboard(frames, logdir: Path, tag: str) -> str:
    from torch.utils.tensorboard import SummaryWriter

    import torch

    w = SummaryWriter(str(logdir))
    try:
        vid = torch.as_tensor(np.stack(frames)).permute(0, 3, 1, 2).unsqueeze(0)  # [1, T, C, H, W]
        try:
            w.add_video(tag, vid, fps=int(1 / (2 * 0.008)))
            kind = "video"
        except (ImportError, ModuleNotFoundError):  # add_video encodes with moviepy
            idx = np.linspace(0, len(frames) - 1, 8).astype(int)
            w.add_image(tag + "/frames", np.concatenate([frames[i] for i in idx], axis=1), dataformats="HWC")
            kind = "frame strip (install moviepy for a TensorBoard video)"
    finally:
        w.close()
    return f"{kind} in {logdir}"
