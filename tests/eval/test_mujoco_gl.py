"""A MUJOCO_GL value that stops MuJoCo from loading (MuJoCo reads it at import, so every simulator
fails, not only videos) is one clear line that names the value, the valid ones and what to do, in
real processes: for a library user building a simulator, and for ``python -m eval.rollout`` in each
simulator layout, before any simulation; valid values still roll out."""

import ctypes.util
import json

import pytest

NONSENSE = ("MUJOCO_GL=nonsense is not a value MuJoCo accepts, so no MuJoCo simulator can load, with or without "
            "video; valid values: egl, osmesa, glfw, or unset; run `unset MUJOCO_GL` (or set MUJOCO_GL=egl) and "
            "start again")

LAYOUTS = {"one-env": ["num_envs=1"], "process-lanes": ["num_envs=2"], "async": ["num_envs=2", "asynchronous=true"]}


@pytest.fixture
def checkpoint(tmp_path, tiny_dt, dt_checkpoint_file):
    return dt_checkpoint_file(tmp_path, tiny_dt("primal+dt", K=5))


def rollout(run_cli, ckpt, out, *extra):
    return run_cli("eval.rollout", f"checkpoint={ckpt}", "engine=stream", "episodes=2", "targets=3600",
                   "max_steps=10", "progress=false", f"out={out}", *extra)


def test_building_a_simulator_names_the_value_and_the_fix(run_code, monkeypatch):
    monkeypatch.setenv("MUJOCO_GL", "nonsense")
    p = run_code("import envs; envs.make_env('hopper-medium')")
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == f"ValueError: {NONSENSE}"


@pytest.mark.parametrize("layout, video", [
    pytest.param(layout, video, id=f"{layout}-{video}",
                 marks=[] if (layout, video) in {("one-env", "true"), ("process-lanes", "false")} else [pytest.mark.slow])
    for video in ("false", "true") for layout in LAYOUTS])
def test_rollout_with_an_invalid_value_is_one_error_line(layout, video, tmp_path, checkpoint, run_cli,
                                                        one_line_error, monkeypatch):
    """Without a video too: the simulators themselves cannot load. Nothing is written."""
    monkeypatch.setenv("MUJOCO_GL", "nonsense")
    out = tmp_path / "report.json"
    p = rollout(run_cli, checkpoint, out, f"video={video}", *LAYOUTS[layout])
    assert one_line_error(p, NONSENSE) == f"error: {NONSENSE}"
    assert not out.exists() and not list(tmp_path.glob("rollout-*.json"))


@pytest.mark.parametrize("gl, library, install", [("egl", "EGL", "EGL (an NVIDIA driver, or Mesa's: "),
                                                    ("osmesa", "OSMesa", "OSMesa (libosmesa6)")])
def test_a_backend_rolls_out_where_installed_and_says_what_to_install_where_not(gl, library, install, tmp_path,
                                                                              checkpoint, run_cli, one_line_error,
                                                                              monkeypatch):
    """egl and osmesa are valid values, but MuJoCo loads the backend's library at import: without it
    (OSMesa on this test's machine, usually) no simulator can load; with it, rollouts run."""
    monkeypatch.setenv("MUJOCO_GL", gl)
    monkeypatch.delenv("PYOPENGL_PLATFORM", raising=False)
    out = tmp_path / "report.json"
    p = rollout(run_cli, checkpoint, out, "num_envs=2")
    if ctypes.util.find_library(library) is not None:
        assert p.returncode == 0, p.stderr[-3000:]
        assert len(json.loads(out.read_text())["targets"]["3600"]["returns"]) == 2
        return
    one_line_error(p, f"MUJOCO_GL={gl} names a backend MuJoCo cannot load here (",
                   f"valid values: egl, osmesa, glfw, or unset; install {install}", "or run `unset MUJOCO_GL`")
    assert not out.exists()


@pytest.mark.parametrize("gl", [None, pytest.param("glfw", marks=pytest.mark.slow)], ids=["unset", "glfw"])
def test_valid_values_still_roll_out(gl, tmp_path, checkpoint, run_cli, monkeypatch):
    """Unset, and glfw (which cannot render without a display, but rollouts need no rendering:
    ``test_video`` covers what a video then says), load the simulators on any machine."""
    if gl is None:
        monkeypatch.delenv("MUJOCO_GL", raising=False)
    else:
        monkeypatch.setenv("MUJOCO_GL", gl)
        monkeypatch.delenv("DISPLAY", raising=False)
    out = tmp_path / "report.json"
    p = rollout(run_cli, checkpoint, out, "num_envs=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "MUJOCO_GL" not in p.stderr
    assert len(json.loads(out.read_text())["targets"]["3600"]["returns"]) == 2


def test_a_lane_started_by_forkserver_names_the_value_not_a_dead_worker(run_code, monkeypatch):
    """A lane with more than one thread starts by forkserver, which preloads mujoco: without the check in
    the caller it died with a bare EOFError."""
    monkeypatch.setenv("MUJOCO_GL", "nonsense")
    p = run_code("from eval.simulators import SimulatorProcess; SimulatorProcess('hopper-medium', 2, threads=2)")
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == f"ValueError: {NONSENSE}"


@pytest.mark.slow
def test_training_that_will_evaluate_refuses_at_once(tmp_path, hopper_file, tiny_train, run_cli, one_line_error,
                                                     monkeypatch):
    """Before the first step (not at the first evaluation, minutes later), and before any run directory is
    made; a run without simulator evaluation does not need MuJoCo to load and trains."""
    monkeypatch.setenv("MUJOCO_GL", "nonsense")
    p = run_cli("primal_dt.train", *tiny_train.args(hopper_file, tmp_path / "a", "steps=4", "eval.every=2",
                                                     "eval.episodes=1"))
    assert one_line_error(p, NONSENSE) == f"error: {NONSENSE}"
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").rglob("*.pt"))
    p = run_cli("primal_dt.train", *tiny_train.args(hopper_file, tmp_path / "b", "steps=4", *tiny_train.QUIET))
    assert p.returncode == 0, p.stderr[-3000:]
