"""A lane of simulators in its own process: a SyncVectorEnv stepped beside the agent, not under its GIL,
and, where the agent can travel, the lane's agent in that process too (``run_hosted``: the whole
act-then-step loop there, jobs taken over the pipe in the order in-process lanes would; else the process
only steps while the agent acts in the evaluator). Part of a MuJoCo step is Python, so a worker *thread*
only half overlaps the agent; one process per lane, not per simulator, so 100 simulators on 2 cores cost 2.

A process that will run more than one torch thread starts from a clean interpreter (``forkserver``): GNU
OpenMP hangs in a forked child whose parent already ran a parallel region; a one-thread child is forked.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import pickle
import traceback
from collections import deque
from multiprocessing.connection import wait

import numpy as np

from eval.episodes import Jobs, run_lanes, step_rows, vector_env

_PRELOAD = ["torch", "gymnasium", "mujoco", "envs", "agents", "eval.episodes"]
"""what a clean (forkserver) lane process imports once for all lanes: the expensive part of its start"""


class _Closed(Exception):
    """The evaluator closed the lane while it ran (it is shutting down after another lane failed)."""


class LaneTraceback(Exception):
    """The traceback, in the lane process, of an exception re-raised in the evaluator: its ``__cause__``, as
    ``concurrent.futures`` does for a process pool, so the caller catches the lane's own exception type and a
    printed traceback shows where in the lane it was raised."""

    def __str__(self) -> str:
        return f"\n\n(in the lane process)\n{self.args[0]}"


def _error(err: Exception) -> tuple:
    """What a lane sends of an exception: the exception pickled (None if pickle refuses it), its type's name and
    message for that case, and its traceback as text (a traceback object does not pickle)."""
    try:
        blob = pickle.dumps(err, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(blob)  # an exception whose __init__ takes other arguments than its args does not load
    except Exception:  # noqa: BLE001 - whatever pickle raises, the type's name and message still travel
        blob = None
    return blob, type(err).__name__, str(err), traceback.format_exc()


class _JobsFromEvaluator:
    """The evaluator's job queue as a hosted lane sees it (``eval.episodes.Jobs.take``): the lane reports
    every step with how many of its episodes just ended, and waits for jobs when some did; the evaluator
    answers in (step, lane) order. Once the queue is empty the lane stops asking."""

    def __init__(self, conn):
        self.conn, self.empty = conn, False

    def take(self, step: int, n: int) -> list:
        if self.empty:
            return []
        self.conn.send(("take", (step, n)))
        if n == 0:  # a report: the evaluator needs it to keep the order, the lane needs no answer
            return []
        cmd, payload = self.conn.recv()
        if cmd != "jobs":
            raise _Closed
        jobs, more = payload
        self.empty = not more
        return jobs


def _host(conn, venv, agent_bytes: bytes, seed: int, max_steps: int, threads: int) -> dict:
    """The hosted lane loop (in the lane process): this lane's episodes, jobs taken from the evaluator."""
    import torch

    from agents.threads import keep_freed_memory

    torch.set_num_threads(max(1, int(threads)))
    keep_freed_memory()
    agent = pickle.loads(agent_bytes)
    returns, lengths = {}, {}
    out = run_lanes([agent], [venv], _JobsFromEvaluator(conn), seed, max_steps, returns, lengths,
                    on_episode=lambda n: conn.send(("ended", n)))
    return {**out, "returns": returns, "lengths": lengths, "threads": torch.get_num_threads()}


def _serve(conn, name: str, num_envs: int, gym_id: str | None) -> None:
    with contextlib.closing(conn), contextlib.ExitStack() as opened:  # the simulators closed first, then the pipe
        try:
            venv = opened.enter_context(contextlib.closing(vector_env(name, num_envs, gym_id=gym_id)))
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
                elif cmd == "host":
                    conn.send(("done", _host(conn, venv, *args)))
        except (EOFError, KeyboardInterrupt, _Closed):
            pass
        except Exception as err:  # reported to the evaluator, which raises it there
            with contextlib.suppress(OSError):
                conn.send(("error", _error(err)))


class SimulatorProcess:
    """``num_envs`` simulators of ``name`` (a SyncVectorEnv) in a subprocess; ``threads``: torch threads of an
    agent hosted in it (default: ``lane_threads`` of a stream agent in one of two lanes)."""

    def __init__(self, name: str, num_envs: int, gym_id: str | None = None, threads: int | None = None):
        from agents.threads import lane_threads
        from envs import check_mujoco_gl

        check_mujoco_gl()  # here, one clear line; in a forkserver child, a bare EOFError (it preloads mujoco)
        self.num_envs = int(num_envs)
        self.threads = lane_threads("stream", self.num_envs, 2) if threads is None else max(1, int(threads))
        methods = mp.get_all_start_methods()
        if self.threads > 1 and "forkserver" in methods:  # see the module docstring: OpenMP and fork
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
        else:
            ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, name, self.num_envs, gym_id), daemon=True,
                                 name=f"simulators-{name}")
        self._proc.start()
        child.close()
        self._closed = False
        self._receive()  # the simulators are built (or the worker says why not)

    @staticmethod
    def host_agents(agents, procs: list[SimulatorProcess], jobs, seed: int, max_steps: int, on_episode=None):
        """``eval.episodes.run_episodes`` with each agent in its lane's process (``run_hosted``), or None when one
        cannot travel there (``hostable``). The episode loop finds it on its lanes: it imports no lane code."""
        blobs = [hostable(a) for a in agents]
        if not all(b is not None for b in blobs):
            return None
        return run_hosted(blobs, procs, jobs, seed, max_steps, on_episode)

    def _receive(self, expect: tuple[str, ...] = ("ok",)):
        try:
            status, payload = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the simulator process died (exit code {self._proc.exitcode}); "
                               "run with lanes=1 or asynchronous=true to see the simulator's own error") from None
        if status == "error":  # the lane's own exception (a bad setting, the agent's): as if raised in-process
            blob, kind, message, trace = payload
            err = pickle.loads(blob) if blob is not None else RuntimeError(f"the simulator process failed: {kind}: "
                                                                           f"{message}")
            raise err from LaneTraceback(trace)
        if status not in expect:
            raise RuntimeError(f"the simulator process sent {status!r} where {' or '.join(expect)} was expected")
        return payload if expect == ("ok",) else (status, payload)

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
        with contextlib.suppress(OSError):
            self._conn.send(("close", None))
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


def hostable(agent) -> bytes | None:
    """The agent pickled for a lane process, or None when it cannot go there (a model on an accelerator, or
    an object pickle refuses)."""
    model = getattr(agent, "model", None)
    if model is None or any(p.device.type != "cpu" for p in model.parameters()):
        return None
    try:
        return pickle.dumps(agent, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        return None


def run_hosted(agent_bytes: list[bytes], procs: list[SimulatorProcess], jobs, seed: int, max_steps: int,
               on_episode=None) -> dict:
    """Run every job with each lane's agent in its own process; ``eval.episodes.run_episodes``' result. The
    evaluator serves jobs in (step, lane) order while jobs are left, at once after, and relays progress."""
    queue = Jobs(jobs)
    for p, blob in zip(procs, agent_bytes):
        p._conn.send(("host", (blob, seed, max_steps, p.threads)))
    returns = np.zeros(len(jobs))
    lengths = np.zeros(len(jobs), dtype=np.int64)
    act_s, act_rows, threads = [], [], []
    lanes = len(procs)
    asked = [deque() for _ in procs]  # (step, n) per lane, in the order sent
    done = [False] * lanes
    turn = [0, 0]  # the (step, lane) whose request is answered next

    def answer(k: int, n: int) -> None:
        if n:
            procs[k]._conn.send(("jobs", (queue.take(turn[0], n), len(queue) > 0)))

    def serve() -> None:
        """Answer what can be answered: in (step, lane) order while jobs are left, everything after."""
        while not all(done):
            step, k = turn
            if not len(queue):
                for j in range(lanes):
                    while asked[j]:
                        answer(j, asked[j].popleft()[1])
                return
            if not done[k]:
                if not asked[k]:
                    return  # lane k has not reached this step yet
                s, n = asked[k].popleft()
                if s != step:
                    raise RuntimeError(f"lane {k} reported step {s} where step {step} was due")
                answer(k, n)
            turn[:] = [step + (k + 1) // lanes, (k + 1) % lanes]

    busy = {p._conn: k for k, p in enumerate(procs)}
    while busy:
        for conn in wait(list(busy)):
            k = busy[conn]
            kind, payload = procs[k]._receive(expect=("take", "ended", "done"))
            if kind == "take":
                asked[k].append(payload)
            elif kind == "ended":
                if on_episode is not None:
                    on_episode(payload)
            else:
                del busy[conn]
                done[k] = True
                for j, r in payload["returns"].items():
                    returns[j], lengths[j] = r, payload["lengths"][j]
                act_s += payload["act_s"]
                act_rows += payload["act_rows"]
                threads.append(payload["threads"])
        serve()
    return {"returns": returns.tolist(), "lengths": lengths.tolist(), "act_s": act_s, "act_rows": act_rows,
            "env_steps": sum(act_rows), "lane_threads": threads}
