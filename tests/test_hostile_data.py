"""Hostile data: crafted checkpoints and altered dataset files, made here by the tests.

Each case is a real file read by a real entry point (or by its one reader, where the entry point adds nothing): one
``error:`` line naming the file and the field, the exit status, a bound on the time (a crafted tensor that asks for
terabytes, or an overflow, used to abort or hang), and nothing changed beside the file it reads."""

import copy
import os
import re
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from agents import dt_checkpoint as schema
from agents.dt_checkpoint import TrainingState
from primal_dt.run import checkpoint as ck_io

BOUND_S = 300
"""what a refusal may take in a fresh process on a loaded 2-core machine (imports included): a bound, not a speed"""


def tree(root: Path) -> dict:
    """Every entry under ``root``, with each file's size, mode and modification time: what a refused input must
    leave. A run's ``.lock`` (taken before its checkpoint is read, kept as every run directory keeps it) and a
    directory's own time are not compared."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() and not p.is_symlink() else
            (p.lstat().st_size, p.lstat().st_mode, p.lstat().st_mtime_ns) for p in sorted(Path(root).rglob("*"))
            if p.name != ".lock"}


def refused(run, root: Path, *fragments, status=2, check=None):
    """Run ``run()`` (a process), within ``BOUND_S``; it fails with one error line holding ``fragments`` and
    ``status``, and ``root`` is as it was."""
    before = tree(root)
    t0 = time.monotonic()
    proc = run()
    assert time.monotonic() - t0 < BOUND_S
    line = check(proc, *fragments, status=status)
    assert tree(root) == before, "a refused input changed files beside it"
    return line


@pytest.fixture(scope="module")
def trained(tiny_dt, dt_checkpoint):
    """A DT checkpoint dict with a real training state (an AdamW step taken, random streams as training records
    them, the sampler's PCG64 among them)."""
    model = tiny_dt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    from agents.decision_transformer import Batch

    B, K = 2, model.cfg.K
    batch = Batch(torch.randn(B, K, 11), torch.rand(B, K, 3), torch.randn(B, K, 1), torch.arange(K).expand(B, K))
    model(batch)[0].pow(2).mean().backward()
    opt.step()
    sched.step()
    rng = [{"torch": torch.get_rng_state(), "numpy": schema.numpy_state(),
            "sampler": {"bit_generator": np.random.default_rng(3).bit_generator.state, "K": K, "batch_size": 8}}]
    state = TrainingState(opt.state_dict(), sched.state_dict(), rng, step=7)
    return dt_checkpoint(model, training=state).to_dict()


def altered(d: dict, change) -> dict:
    d = copy.deepcopy(d)
    change(d)
    return d


def write(tmp_path, d: dict) -> Path:
    return ck_io.save_atomic(d, tmp_path / "run" / "last.pt")


def set_weight(name, value):
    return lambda d: d["model"].__setitem__(name, value)


# -- checkpoints: every tensor checked against the network its config builds, before anything is allocated --------
def test_a_stride_0_tensor_of_a_trillion_rows_is_refused_by_name_not_allocated(tmp_path, trained, run_cli,
                                                                              one_line_error):
    """A 10^12 x 11 view of 11 floats: a few bytes on disk, 44 TB for the first reader that computed on it."""
    path = write(tmp_path, altered(trained, set_weight("embed_state.weight", torch.zeros(11).expand(10**12, 11))))
    assert path.stat().st_size < 2_000_000
    refused(lambda: run_cli("eval.rollout", f"checkpoint={path}", "episodes=1", timeout=BOUND_S), tmp_path,
            str(path), "weight embed_state.weight", "(1000000000000, 11)", "(32, 11)", check=one_line_error)


@pytest.mark.parametrize("name, change, words", [
    ("stride-0 of the right shape", set_weight("embed_state.weight", torch.zeros(11).expand(32, 11)),
     "is a view of 44 bytes of storage"),
    ("int64 weights", lambda d: d["model"].__setitem__("embed_state.weight",
                                                       d["model"]["embed_state.weight"].to(torch.int64)),
     "weight embed_state.weight (model) is torch.int64, but its network keeps torch.float32"),
    ("a 1e38 weight", lambda d: d["model"]["embed_state.weight"].__setitem__((0, 0), 1e38),
     "weight embed_state.weight (model) holds values up to 1e+38 in size, beyond 1e+06"),
    ("a weight missing", lambda d: d["model"].pop("embed_state.bias"), "model lacks weight embed_state.bias"),
    ("a weight too many", set_weight("extra.weight", torch.zeros(3)), "holds weight extra.weight that its network"),
    ("a sampler state of 10**60",
     lambda d: d["rng"][0]["sampler"]["bit_generator"]["state"].__setitem__("state", 10**60), "rng[0]"),
    ("numpy's stream position 10**60", lambda d: d["rng"][0]["numpy"].__setitem__("pos", 10**60), "rng[0]"),
    ("param_groups missing", lambda d: d["optimizer"].pop("param_groups"), "optimizer lacks param_groups"),
    ("a NaN learning rate", lambda d: d["optimizer"]["param_groups"][0].__setitem__("lr", float("nan")),
     "optimizer.param_groups[0].lr must be finite"),
    ("a stride-0 optimizer moment", lambda d: next(iter(d["optimizer"]["state"].values())).__setitem__(
        "exp_avg", torch.zeros(11).expand(10**12, 11)), "optimizer.state[0].exp_avg must be a dense tensor"),
])
def test_a_crafted_checkpoint_field_is_one_error_naming_file_and_field(tmp_path, trained, name, change, words):
    """Each reader goes through ``dt_checkpoint.load``: the file is refused there, with a ValueError of one line
    (what eval.rollout, eval.report, a sweep's plan, a resume and export print after ``error:``)."""
    path = write(tmp_path, altered(trained, change))
    before = tree(tmp_path)
    t0 = time.monotonic()
    with pytest.raises(ValueError) as err:
        schema.load(path)
    assert time.monotonic() - t0 < 10
    message = str(err.value)
    assert "\n" not in message and str(path) in message and words in message, message
    assert "not a primal-dt checkpoint" not in message  # it is one, damaged
    assert tree(tmp_path) == before


def test_a_resume_from_an_overflowing_random_state_is_one_error_line(tmp_path, trained, run_cli, one_line_error):
    """numpy raised OverflowError (a traceback) when the sampler's state was set, after the run had started."""
    bad = altered(trained, lambda d: d["rng"][0]["sampler"]["bit_generator"]["state"].__setitem__("state", 10**60))
    path = write(tmp_path, bad)
    refused(lambda: run_cli("primal_dt.train", f"resume={path}", timeout=BOUND_S), tmp_path, str(path), "rng[0]",
            "sampler", check=one_line_error)


def test_a_huge_weight_is_one_error_line_in_a_rollout(tmp_path, trained, run_cli, one_line_error):
    """A finite 1e38 weight made every action inf: a FloatingPointError traceback at the first step."""
    path = write(tmp_path, altered(trained, lambda d: d["model"]["action_head.0.weight"].__setitem__((0, 0), 1e38)))
    refused(lambda: run_cli("eval.rollout", f"checkpoint={path}", "episodes=1", timeout=BOUND_S), tmp_path,
            str(path), "weight action_head.0.weight", check=one_line_error)


def test_the_state_dict_check_serves_any_field(tiny_dt):
    """One function checks any state_dict-like field against a network's own (an average of the weights, say)."""
    model = tiny_dt()
    with torch.device("meta"):
        expected = type(model)(model.cfg).state_dict()
    ck_io.check_state_dict(model.state_dict(), expected, "checkpoint x.pt", "ema")
    bad = {**model.state_dict(), "embed_state.weight": torch.zeros(32, 11, dtype=torch.float64)}
    with pytest.raises(ValueError, match=re.escape("checkpoint x.pt: weight embed_state.weight (ema) is torch.float64")):
        ck_io.check_state_dict(bad, expected, "checkpoint x.pt", "ema")


# -- datasets: episodes counted against the file's own promise ---------------------------------------------------
@pytest.fixture(scope="module")
def collected(tmp_path_factory, write_hopper_file):
    """write(path, change) -> path: real Hopper-v4 episodes in a D4RL file written by envs.collect's writer with the
    provenance it records (its episodes and steps counted), then ``change``d in place as a converter might."""
    from envs.d4rl import write_d4rl

    with h5py.File(write_hopper_file(tmp_path_factory.mktemp("rollouts") / "hopper-v2.hdf5"), "r") as f:
        arrays = {k: f[k][()] for k in f}
    ends = arrays["terminals"] | arrays["timeouts"]
    provenance = {"collector": "envs.collect", "name": "hopper-medium", "gym_id": "Hopper-v4",
                  "episodes": int(ends.sum()), "steps": len(ends)}

    def write(path, change=lambda f: None):
        write_d4rl(path, arrays, provenance)
        with h5py.File(path, "r+") as f:
            change(f)
        return path

    return write


def one_terminal_left(f):
    """All terminals but the last zeroed: the one survivor keeps a reader from seeing that ends were lost."""
    t = f["terminals"][()]
    last = np.flatnonzero(t)[-1]
    t[:] = False
    t[last] = True
    f["terminals"][...] = t


def test_a_collected_file_whose_timeouts_were_deleted_is_refused_before_training(tmp_path, collected, tiny_train,
                                                                                 run_cli, one_line_error):
    """It trained on joined episodes (exit 0, one note) before: the provenance says envs.collect always writes them."""
    def change(f):
        one_terminal_left(f)
        del f["timeouts"]

    path = collected(tmp_path / "hopper-v2.hdf5", change)
    refused(lambda: run_cli("primal_dt.train", *tiny_train.args(path, tmp_path / "runs", "steps=2",
                                                                 *tiny_train.QUIET), timeout=BOUND_S),
            tmp_path, str(path), "envs.collect", "'timeouts'", check=one_line_error)
    assert not (tmp_path / "runs").exists()


def test_a_collected_file_whose_terminals_were_zeroed_counts_other_episodes(tmp_path, collected):
    from envs.d4rl import read_d4rl
    from envs.sources import DatasetError

    intact = read_d4rl(collected(tmp_path / "a.hdf5"), "hopper-medium", "Hopper-v4", verbose=False)
    assert len(intact) == intact.metadata["episodes"]
    path = collected(tmp_path / "b.hdf5", one_terminal_left)
    with pytest.raises(DatasetError, match=rf"{re.escape(str(path))}: its provenance .* promises "
                                           rf"{len(intact)} episodes in .* but its terminals and timeouts make"):
        read_d4rl(path, "hopper-medium", "Hopper-v4", verbose=False)


# -- exported policies --------------------------------------------------------------------------------------------
def test_a_policy_claiming_a_trillion_observations_is_refused_before_its_reset_allocates():
    """A reset allocated [batch, obs_dim] float32: 7 TiB for obs_dim=10**12 at batch 2."""
    from agents import onnx_policy

    meta = {"format": onnx_policy.FORMAT, "schema": 1, "obs_dim": 11, "act_dim": 3, "targets": [3600.0],
            "reward_scale": 1000.0, "stream_exact": True, "stream_window": 0, "stream_from_start": False,
            "stream_whole_episodes": False,
            "state": [{"name": "t", "shape": ["batch"], "dtype": "int64"}]}
    onnx_policy.check_metadata(meta, "p.onnx")
    for field, value, words in (("obs_dim", 10**12, "field obs_dim must be at most"),
                                ("act_dim", 10**12, "field act_dim must be at most"),
                                ("state", [{"name": "h", "shape": ["batch", 10**6, 10**6], "dtype": "float32"}],
                                 "field state[0].shape must be of at most")):
        with pytest.raises(ValueError, match=re.escape(words)) as err:
            onnx_policy.check_metadata({**meta, field: value}, "p.onnx")
        assert str(err.value).startswith("p.onnx")


# -- the collector -------------------------------------------------------------------------------------------------
def test_a_rollout_shard_holding_nan_is_refused_when_collected(tmp_path):
    """The collector wrote a dataset from it that the trainer then refused: it is refused where it is read."""
    from envs.collect import _load_shard, _save_shard

    eps = [{"observations": np.zeros((n + 1, 11), np.float32), "actions": np.zeros((n, 3), np.float32),
            "rewards": np.ones(n, np.float32), "terminations": np.zeros(n, bool),
            "truncations": np.eye(1, n, n - 1, dtype=bool)[0], "seed": s} for s, n in ((1, 5), (2, 7))]
    eps[1]["rewards"][3] = np.nan
    _save_shard(tmp_path / "shard_000000.npz", eps)
    before = tree(tmp_path)
    with pytest.raises(ValueError, match=r"shard_000000\.npz holds NaN or inf in its rewards.*delete it"):
        _load_shard(tmp_path / "shard_000000.npz")
    assert tree(tmp_path) == before


def test_an_empty_workdir_is_refused_not_read_as_the_default(tmp_path, run_cli, one_line_error):
    refused(lambda: run_cli("envs.collect", "workdir=", f"out={tmp_path / 'data'}", cwd=tmp_path, timeout=BOUND_S),
            tmp_path, "workdir= is empty", check=one_line_error)
    assert not (tmp_path / "runs").exists()


def test_a_new_report_takes_the_umasks_permissions(tmp_path, run_code):
    """Under umask 002 (a group's shared folder) a rollout report was 0644: the name was claimed with a fixed mode,
    which the atomic write then kept."""
    code = ("import os, stat, sys\nfrom pathlib import Path\nfrom primal_dt.run import checkpoint, outputs\n"
            "os.umask(0o002)\n"
            f"with outputs.new_file(Path({str(tmp_path / 'rollout-stream.json')!r}), 'rollout report') as out:\n"
            "    checkpoint.write_atomic(out, '{}', 'rollout report')\n"
            "print(oct(stat.S_IMODE(out.stat().st_mode)))\n")
    proc = run_code(code, timeout=BOUND_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0o664"]


def test_training_the_behaviour_policy_leaves_no_folder_in_tmp(tmp_path, run_code):
    """SB3's default logger made an empty SB3-<date> folder in the temporary directory at every training collect."""
    pytest.importorskip("stable_baselines3")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = (f"import os, tempfile\nos.environ['TMPDIR'] = {str(tmp)!r}\ntempfile.tempdir = None\n"
            "from envs import behavior\n"
            f"behavior.train_behavior({str(tmp_path / 'sac')!r}, behavior.BehaviorConfig(env_id='Hopper-v4', "
            "total_steps=100, checkpoint_every=100, eval_episodes=1), progress=False)\n")
    proc = run_code(code, timeout=BOUND_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "sac" / "sac_step0000100.pt").exists()
    assert not list(tmp.glob("SB3-*")), list(tmp.iterdir())  # (torch may keep its compile cache there)
