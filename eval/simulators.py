"""A lane of simulators in its own process: a SyncVectorEnv stepped beside the agent, not under its GIL.

Gymnasium's MuJoCo envs spend most of a step in Python (wrappers, observation and reward code), so a
worker *thread* only half overlaps the agent. ``SimulatorProcess`` holds a whole lane (one
SyncVectorEnv, autoreset disabled) in one subprocess and talks to it over a pipe: the evaluator sends
a step, lets the other lane's agent act, then collects the result. One process per lane, not per
simulator (AsyncVectorEnv's layout), so 100 simulators on 2 cores cost 2 processes.

The main-side object offers what ``eval.episodes`` uses of a vector env (``num_envs``, ``reset``,
``close``) plus ``step_rows_async`` / ``step_rows_wait``.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import numpy as np


def _serve(conn, name: str, num_envs: int, gym_id: str | None) -> None:
    from gymnasium.vector import AutoresetMode

    from envs import make_vector_env
    from eval.episodes import step_rows

    venv = None
    try:
        venv = make_vector_env(name, num_envs, None, False, gym_id=gym_id, autoreset_mode=AutoresetMode.DISABLED)
        conn.send(("ok", None))
        while True:
            cmd, args = conn.recv()
            if cmd == "close":
                break
            if cmd == "reset":
                obs, _ = venv.reset(seed=args[0], options=args[1])
                conn.send(("ok", obs))
            elif cmd == "step":
                conn.send(("ok", step_rows(venv, *args)))
    except (EOFError, KeyboardInterrupt):
        pass
    except Exception as err:  # reported to the evaluator, which raises it there
        try:
            conn.send(("error", (type(err).__name__, str(err), traceback.format_exc())))
        except OSError:
            pass
    finally:
        if venv is not None:
            venv.close()
        conn.close()


class SimulatorProcess:
    """``num_envs`` simulators of ``name`` (a SyncVectorEnv) in a subprocess."""

    def __init__(self, name: str, num_envs: int, gym_id: str | None = None):
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        self.num_envs = int(num_envs)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, name, self.num_envs, gym_id), daemon=True,
                                 name=f"simulators-{name}")
        self._proc.start()
        child.close()
        self._closed = False
        self._receive()  # the simulators are built (or the worker says why not)

    def _receive(self):
        try:
            status, payload = self._conn.recv()
        except EOFError:
            code = self._proc.exitcode
            raise RuntimeError(f"the simulator process died (exit code {code}); "
                               "run with lanes=1 or asynchronous=true to see the simulator's own error") from None
        if status == "error":
            kind, message, trace = payload
            if kind == "ValueError":  # a bad setting (env name, gym id): the same clear error as in-process
                raise ValueError(message)
            raise RuntimeError(f"the simulator process failed: {kind}: {message}\n{trace}")
        return payload

    def reset(self, seed=None, options=None):
        self._conn.send(("reset", (seed, options)))
        return self._receive(), {}

    def step_rows_async(self, envs_idx: np.ndarray, actions: np.ndarray) -> None:
        self._conn.send(("step", (envs_idx, actions)))

    def step_rows_wait(self):
        return self._receive()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._conn.send(("close", None))
        except OSError:
            pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
