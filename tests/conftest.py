"""Shared test setup: one thread per test process (the CI machine has 2 cores) and fixed seeds;
small Decision-Transformer models and checkpoint files for the agent and evaluator tests; real
processes (with file-size limits and file permissions that hold even for root), hostile files and
hostile option values for the robustness tests."""

import contextlib
import ctypes
import io
import os
import resource
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# CI runs the property tests on the same examples every time (a failure there is reproducible, not a
# draw); elsewhere hypothesis explores new ones on each run. No deadlines: the machines are shared.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, deadline=None)
_hypothesis_settings.register_profile("default", deadline=None)
_hypothesis_settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# -- real simulator data: trainer and evaluator tests run on it through the real loader ---------------
def hopper_rollouts(episodes: int = 24, max_steps: int = 120, seed: int = 0) -> dict:
    """Episodes of a noisy open-loop policy in Hopper-v4, in D4RL's flat layout."""
    import gymnasium as gym

    env = gym.make("Hopper-v4")
    rng = np.random.default_rng(seed)
    cols = {k: [] for k in ("observations", "actions", "rewards", "terminals", "timeouts")}
    for e in range(episodes):
        obs, _ = env.reset(seed=seed + e)
        bias = rng.uniform(-0.5, 0.5, size=3)
        for t in range(max_steps):
            act = np.clip(bias + 0.3 * rng.standard_normal(3), -1, 1).astype(np.float32)
            nxt, rew, term, trunc, _ = env.step(act)
            timeout = not term and t == max_steps - 1
            for k, v in zip(cols, (obs, act, rew, term, timeout)):
                cols[k].append(v)
            obs = nxt
            if term or timeout:
                break
    env.close()
    return {k: np.asarray(v) for k, v in cols.items()}


def _write_hopper(path, seed: int = 0):
    with h5py.File(path, "w") as f:
        for k, v in hopper_rollouts(seed=seed).items():
            f.create_dataset(k, data=v.astype(bool if k in ("terminals", "timeouts") else np.float32))
    return path


@pytest.fixture(scope="session")
def write_hopper_file():
    """``write(path, seed=0) -> path``: a D4RL-format file of real Hopper-v4 episodes (other seeds,
    other episodes and statistics)."""
    return _write_hopper


@pytest.fixture(scope="session")
def hopper_file(tmp_path_factory):
    """A small D4RL-format HDF5 file of real Hopper-v4 rollouts (``data_source=d4rl:PATH``)."""
    return _write_hopper(tmp_path_factory.mktemp("data") / "hopper_rollouts-v2.hdf5")


# -- Decision-Transformer models and checkpoints shared by tests/agents and tests/eval ---------------
# Factories, so one test can build several; session-scoped because they are pure functions (module
# fixtures such as a rollout test's checkpoint use them too). Checkpoints are real files written by
# agents.dt_checkpoint.save, the one writer the trainer uses.
ENV = "hopper-medium"


@pytest.fixture(scope="session")
def hopper_stats():
    """(state_mean, state_std) [11] float32: normalisation statistics that are not the identity, so a
    test notices when an agent forgets them."""
    import numpy as np

    obs_dim = _spec().obs_dim
    rng = np.random.default_rng(0)
    return rng.normal(0, 0.3, obs_dim).astype(np.float32), rng.uniform(0.5, 2.0, obs_dim).astype(np.float32)


@pytest.fixture(scope="session")
def hopper_info(hopper_stats):
    """An ``agents.DataInfo`` with hopper_stats, the papers' return scale (1000) and target 3600: what
    ``agents.Agent(model, hopper_info)`` acts with."""
    from agents import DataInfo

    return DataInfo(env=ENV, state_mean=hopper_stats[0], state_std=hopper_stats[1], reward_scale=1000.0,
                    targets=(3600.0,))


@pytest.fixture(scope="session")
def tiny_dt():
    """tiny_dt(layout="primal+dt", K=5, options=None, layers=(), seed=0, d_model=32, n_heads=2,
    n_layers=3): a small DecisionTransformer for hopper (eval mode, no dropout, seeded weights)."""
    from agents import DecisionTransformer, DTConfig
    from primal_dt.run.options import attention_words

    def make(layout="primal+dt", K=5, options=None, layers=(), seed=0, d_model=32, n_heads=2, n_layers=3):
        spec = _spec()
        torch.manual_seed(seed)
        options = {"primal": {"s": 8}} if options is None else options
        cfg = DTConfig(state_dim=spec.obs_dim, act_dim=spec.act_dim, K=K, d_model=d_model, n_heads=n_heads,
                       n_layers=n_layers, name=layout, layers=",".join(layers),
                       s=options.get("primal", {}).get("s", 8), attention_options=attention_words(options),
                       dropout=0.0)
        return DecisionTransformer(cfg).eval()

    return make


@pytest.fixture(scope="session")
def dt_checkpoint(hopper_stats):
    """dt_checkpoint(model, targets=(3600, 1800), reward_scale=1000, env="hopper-medium", source="test",
    training=None) -> agents.dt_checkpoint.DTCheckpoint holding ``model`` and hopper_stats."""
    from agents.dt_checkpoint import DataInfo, DTCheckpoint

    def make(model, targets=(3600.0, 1800.0), reward_scale=1000.0, env=ENV, source="test", training=None):
        import envs

        mean, std = hopper_stats
        data = DataInfo(env=env, state_mean=mean, state_std=std, reward_scale=reward_scale, targets=targets,
                        gym_id=envs.get_spec(env).gym_id, source=source)
        return DTCheckpoint(model_config=model.cfg, model=model.state_dict(), data=data,
                            config={"env": env, "K": model.cfg.K}, training=training)

    return make


@pytest.fixture(scope="session")
def dt_checkpoint_file(dt_checkpoint):
    """dt_checkpoint_file(directory, model, **dt_checkpoint options) -> directory/last.pt, written
    by agents.dt_checkpoint.save (a run directory as primal_dt.train leaves it)."""
    from agents import dt_checkpoint as schema

    def write(directory, model, **kw):
        return schema.save(dt_checkpoint(model, **kw), Path(directory) / schema.FILENAME)

    return write


@pytest.fixture(scope="session")
def foreign_checkpoint_file():
    """foreign_checkpoint_file(directory) -> a real primal-dt checkpoint of another kind (a
    classifier's), which every DT reader must refuse by name."""
    from primal_dt.run import checkpoint

    def write(directory):
        return checkpoint.save_atomic({"kind": "classifier", "config": {}, "model": {}},
                                      Path(directory) / "classifier.pt")

    return write


def _spec():
    import envs

    return envs.get_spec(ENV)


# -- real processes -------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def _limits(file_size: int | None, honour_permissions: bool):
    """What a child process does before it runs Python: a file-size limit (writes past it fail with
    EFBIG, as a full disk fails them with ENOSPC), and for root, no capability to bypass file
    permissions (root ignores chmod otherwise)."""
    def apply():
        if file_size is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
        if honour_permissions and os.geteuid() == 0:
            libc = ctypes.CDLL(None, use_errno=True)
            for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, out of the bounding set
                if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                    raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    return apply


def _python(argv, file_size=None, honour_permissions=False, timeout=300, cwd=ROOT, terminal=False):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PRIMAL_DT_OFFLINE": "1"}
    if terminal:
        return _on_terminal([sys.executable, *map(str, argv)], cwd=cwd, env=env, timeout=timeout,
                            preexec_fn=_limits(file_size, honour_permissions))
    return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=_limits(file_size, honour_permissions))


def _on_terminal(cmd, timeout, **kw) -> subprocess.CompletedProcess:
    """``cmd`` with its stderr on a pseudo-terminal 200 columns wide, where progress bars are drawn (written to
    a pipe they are not); ``stderr`` is what the terminal showed, stdout is piped as usual."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: the terminal's last writer has gone
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=slave, text=True, timeout=timeout, **kw)
    finally:
        os.close(slave)
        reader.join(30)
        os.close(master)
    p.stderr = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    return p


@pytest.fixture(scope="session")
def run_cli():
    """run_cli(module, *args, file_size=None, honour_permissions=False, timeout=300, cwd=ROOT, terminal=False) ->
    CompletedProcess (text): ``python -m module args`` in a fresh process with this checkout on its
    path and one torch thread, for what only a real process shows: the exit status, a one-line
    error instead of a traceback, a real file-size limit (``file_size`` bytes, RLIMIT_FSIZE), file
    permissions that bind root too (``honour_permissions``), its stderr on a terminal (``terminal``)."""
    return lambda module, *args, **kw: _python(["-m", module, *args], **kw)


@pytest.fixture(scope="session")
def run_code():
    """run_code(code, file_size=None, honour_permissions=False, ...): as ``run_cli``, for ``python -c code``."""
    return lambda code, **kw: _python(["-c", code], **kw)


@pytest.fixture(scope="session")
def one_line_error():
    """one_line_error(proc, *fragments, status=2): the process failed with exit status ``status`` (2: bad
    input, 1: a failed run, e.g. a write) and one ``error:`` line holding every fragment, and no traceback;
    returns that line."""
    def check(proc, *fragments, status=2):
        assert proc.returncode == status, (proc.returncode, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
        lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert len(lines) == 1, proc.stderr[-3000:]
        for f in fragments:
            assert str(f) in lines[0], (f, lines[0])
        return lines[0]

    return check


@pytest.fixture(scope="session")
def killed_checkpoint_write():
    """killed_checkpoint_write(path) -> Path: start a real ``primal_dt.run.checkpoint.save_atomic`` of
    ``path`` in a process, kill -9 it once its temporary file is written (its fsync never returns,
    as if the machine stalled there) and return the temporary it left behind."""
    import signal
    import time

    def kill(path):
        path = Path(path)
        code = ("import os, time, torch\nfrom primal_dt.run import checkpoint\nos.fsync = lambda fd: time.sleep(600)\n"
                f"checkpoint.save_atomic({{'model': torch.zeros(1000)}}, {str(path)!r})\n")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen([sys.executable, "-c", code], env=env)
        deadline = time.time() + 60
        while time.time() < deadline and not list(path.parent.glob(f".{path.name}.*.tmp")):
            time.sleep(0.01)
        time.sleep(0.2)  # the temporary is written; the rename never comes
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        (tmp,) = path.parent.glob(f".{path.name}.*.tmp")
        return tmp

    return kill


# -- hostile files and values ---------------------------------------------------------------------------
class _Payload:
    """Unpickling this calls os.system: what a crafted checkpoint does to a reader that trusts pickle."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="session")
def crafted_checkpoint():
    """crafted_checkpoint(path, marker) -> path: a torch.save file shaped like a DT checkpoint whose
    pickle, if unpickled without restriction, creates ``marker`` (and whose weights are the payload)."""
    import torch

    def write(path, marker):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"kind": "dt", "schema": 1, "config": {"env": "hopper-medium"}, "model_config": {},
                    "model": _Payload(marker), "data": {}}, path)
        return path

    return write


def _values(kind: str):
    """Hostile and ordinary values of one option type, as command-line text."""
    from hypothesis import strategies as st

    ints = st.one_of(st.integers(-3, 70), st.integers(-2**40, 2**40), st.sampled_from([2**31, 2**32, 2**63]))
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-300, 1.5, 0.25]),
                       st.floats(-2, 2))
    small = st.integers(-2, 40)
    pick = {"int": ints, "float": floats, "size": small, "floats": st.lists(floats, min_size=1, max_size=3),
            "ints": st.lists(st.one_of(small, ints), min_size=1, max_size=3)}[kind]
    if kind in ("floats", "ints"):
        return pick.map(lambda xs: ",".join(map(repr, xs)))
    return pick.map(repr)


@pytest.fixture(scope="session")
def fuzz_options():
    """fuzz_options(validate, options, base=(), examples=40): hypothesis draws a non-empty subset of
    ``options`` ({command-line name: "int" | "float" | "size" (a model size: small) | "ints" | "floats"
    (comma lists)}) with hostile values (negative, zero, huge, NaN, inf) and calls
    ``validate(base + argv)``. It must return (a valid configuration) or fail with a message that
    names one of the options drawn: a ValueError, or SystemExit with a message or with argparse's
    error on stderr. Anything else (a traceback) fails the test with the smallest example found.
    Names starting with "--" are given argparse-style (``--name value``), others ``name=value``."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    def fuzz(validate, options: dict, base=(), examples: int = 40):
        names = sorted(options)

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True).flatmap(
            lambda keys: st.tuples(*[st.tuples(st.just(k), _values(options[k])) for k in keys])))
        def prop(drawn):
            argv = list(base)
            for k, v in drawn:
                argv += [k, v] if k.startswith("--") else [f"{k}={v}"]
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    validate(argv)
                return
            except ValueError as exc:
                message = str(exc)
            except SystemExit as exc:
                message = exc.code if isinstance(exc.code, str) else err.getvalue()
            assert any(k in message for k, _ in drawn), f"{argv}: {message!r} names none of the options given"

        prop()

    return fuzz


class TinyTrain:
    """Command lines of a tiny real training run (``python -m primal_dt.train`` options) on a data file,
    and the scalars its TensorBoard event files hold: what the trainer's tests share."""

    TINY = ["preset=smoke", "progress=false", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.s=8",
            "K=5", "batch_size=8", "warmup_steps=5", "threads=1"]
    QUIET = ["eval.every=0", "eval.final_episodes=0"]
    """no simulator evaluation"""

    @classmethod
    def args(cls, data_file, out, *extra) -> list[str]:
        return [*cls.TINY, f"data_source=d4rl:{data_file}", f"out={out}", *extra]

    @staticmethod
    def scalars(run_dir, tag) -> list[tuple[int, float]]:
        """(step, value) of ``tag`` in the run's event files; [] when the run never logged it."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


@pytest.fixture(scope="session")
def tiny_train():
    return TinyTrain
