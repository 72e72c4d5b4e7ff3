"""Record one rollout episode with MuJoCo off-screen rendering: a GIF file and a TensorBoard entry.

Rendering needs an off-screen OpenGL backend (EGL, then OSMesa with ``MUJOCO_GL`` unset; only that one when
it is set), probed in a child process since a failed GL context can abort the process that tries it: without
one the evaluator says why and still writes its results. TensorBoard gets the GIF itself as an image summary
(torch's ``add_video`` needs ``moviepy.editor``, which moviepy 2 removed).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import gymnasium as gym

from envs.gl import INSTALL
from envs.gl import OFFSCREEN as BACKENDS  # tried in this order when MUJOCO_GL is unset

_PROBE = """
import gymnasium as gym
env = gym.make({gym_id!r}, render_mode="rgb_array", width=32, height=32)
env.reset(seed=0)
frame = env.render()
assert frame is not None and frame.shape == (32, 32, 3), frame
print("ok")
"""

_UNAFFECTED = "the rollout results are unaffected"


def rendering_available(backend: str | Sequence[str] | None = None, gym_id: str = "Hopper-v4") -> tuple[bool, str]:
    """(True, the backend that renders) or (False, what failed and what to do); ``backend``: one or several
    to try in order (default: $MUJOCO_GL when set, else ``BACKENDS``)."""
    backend = backend or os.environ.get("MUJOCO_GL") or BACKENDS
    tried = [backend] if isinstance(backend, str) else list(backend)
    errors = []
    for b in tried:
        env = {**os.environ, "MUJOCO_GL": b, "PYOPENGL_PLATFORM": b}
        try:
            p = subprocess.run([sys.executable, "-c", _PROBE.format(gym_id=gym_id)], env=env, capture_output=True,
                               text=True, timeout=60)
        except subprocess.TimeoutExpired:
            errors.append(f"MUJOCO_GL={b}: timed out")
            continue
        if p.returncode == 0 and p.stdout.strip().endswith("ok"):
            return True, b
        last = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}, no output"])[-1]
        errors.append(f"MUJOCO_GL={b}: {last}")
    return False, ("no video: MuJoCo off-screen rendering is unavailable on this machine ("
                   + "; ".join(errors) + "). Install " + " or ".join(INSTALL[b] for b in BACKENDS)
                   + f", and unset MUJOCO_GL ({', then '.join(BACKENDS)}, are tried) or set it to the one installed; "
                   f"{_UNAFFECTED}.")


def frame_every(dt: float, period: float = 0.04) -> int:
    """Render every n-th step so frames are ``period`` (25 fps) of simulated time apart, as close as the
    env's step ``dt`` allows: the GIF plays in real time."""
    return max(1, round(period / dt))


def record_episode(model, spec, info, target: float, engine: str, seed: int, out_dir, gym_id=None,
                   max_steps: int | None = None, backend: str | Sequence[str] | None = None, size: int = 240,
                   step: int = 0) -> dict:
    """Roll out one episode (reset seed ``seed``); writes ``<out_dir>/episode-<engine>.gif`` (``-2``, ... when
    taken) and the same GIF to TensorBoard under ``<out_dir>/video`` (tag ``rollout/<engine>`` at ``step``).
    Returns {"path", "frames", "fps", "return", "length", "backend", "tensorboard"}, or {"path": None,
    "message"} (printed) when nothing can render."""
    ok, msg = rendering_available(backend, gym_id or spec.gym_id)
    if not ok:
        print(msg, file=sys.stderr)
        return {"path": None, "message": msg}
    os.environ["MUJOCO_GL"] = msg
    os.environ.setdefault("PYOPENGL_PLATFORM", msg)
    from agents.agent import Agent
    from envs import make_env
    from eval.episodes import run_episodes

    try:  # the probe rendered, but a context can still fail here (another GL library already loaded)
        env = make_env(spec.name, None, gym_id=gym_id, render_mode="rgb_array", width=size, height=size)
        env.reset(seed=seed)
        env.render()
    except Exception as err:  # noqa: BLE001 - any rendering failure: say it, keep the rollout's results
        message = f"no video: rendering with MUJOCO_GL={msg} failed ({type(err).__name__}: {err}); {_UNAFFECTED}."
        print(message, file=sys.stderr)
        return {"path": None, "message": message}
    dt = float(getattr(env.unwrapped, "dt", 0.008))
    every = frame_every(dt)
    fps = 1.0 / (every * dt)
    filmed = Frames(env, every)
    venv = gym.vector.SyncVectorEnv([lambda: filmed], autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    with contextlib.closing(venv):  # the evaluators' loop on one simulator: episode 0 starts from reset seed ``seed``
        res = run_episodes(Agent(model, info, target=target, engine=engine), venv, [(float(target), 0)], seed,
                           max_steps or spec.max_episode_steps)
    return {**_write(filmed.frames, fps, Path(out_dir), engine, step), "frames": len(filmed.frames),
            "fps": fps, "return": res["returns"][0], "length": res["lengths"][0], "backend": msg}


class Frames(gym.Wrapper):
    """A simulator keeping a frame after each reset and every ``every``-th step (its last episode's)."""

    def __init__(self, env, every: int):
        super().__init__(env)
        self.every, self.frames, self.steps = every, [], 0

    def reset(self, **kwargs):
        out = self.env.reset(**kwargs)
        self.frames, self.steps = [self.env.render()], 0
        return out

    def step(self, action):
        out = self.env.step(action)
        self.steps += 1
        if self.steps % self.every == 0:
            self.frames.append(self.env.render())
        return out


def _write(frames, fps: float, out_dir: Path, engine: str, step: int) -> dict:
    """The GIF file, and the same GIF in TensorBoard (one encoding)."""
    from primal_dt.run import checkpoint, outputs
    from primal_dt.run.monitor import RunMonitor, encode_gif

    # a new name (episode-stream-2.gif, ...) rather than over an earlier recording
    with outputs.new_file(out_dir / f"episode-{engine}.gif", "episode GIF") as path:
        data = encode_gif(frames, fps)  # the file first, atomically: a failed write leaves no truncated GIF
        checkpoint.write_atomic(path, data, "episode GIF")
    with contextlib.closing(RunMonitor(out_dir / "video", progress=False)) as mon:
        mon.image(f"rollout/{engine}", data, frames[0].shape[:2], step)
    return {"path": str(path), "tensorboard": f"GIF (Images tab, tag rollout/{engine}) in {out_dir / 'video'}"}
