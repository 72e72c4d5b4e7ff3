"""The command line: key=value and --key value, shorthands, presets with provenance, --help."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from primal_dt.run import presets
from agents import train_config
from agents.train_config import build, check
from primal_dt.run.runtime import native_bf16

ROOT = Path(__file__).resolve().parents[2]
PAPER = [f"{f}-{lv}" for f in ("hopper", "halfcheetah", "walker2d") for lv in ("medium", "medium-replay", "medium-expert")]


def test_issue_example_and_flag_spelling_agree():
    a = build(["env=hopper-medium", "model=primal+dt", "seed=3", "steps=20000", "model.s=64"])
    b = build(["--env", "hopper-medium", "--model", "primal+dt", "--seed", "3", "--steps", "20000", "--model.s", "64"])
    assert a.cfg == b.cfg
    c = a.cfg
    assert (c.env, c.model.name, c.seed, c.steps, c.model.s) == ("hopper-medium", "primal+dt", 3, 20000, 64)
    assert a.cfg.preset == "hopper-medium" and "Primal-Attention" in a.source
    assert a.provenance["steps"] == "command line" and a.provenance["lr"] == "preset hopper-medium"
    assert a.provenance["eval.num_envs"] == "default"
    assert build(["attention=softmax"]).cfg.model.name == "softmax"
    assert build(["env=hopper-random"]).cfg.preset == ""  # no preset of that name: defaults
    smoke = build(["preset=smoke", "eval.targets=3000"]).cfg
    assert smoke.steps == 300 and smoke.eval.targets == (3000.0,)
    assert build(["eval.targets=3600,1800"]).cfg.eval.targets == (3600.0, 1800.0)
    built = build(["preset=smoke", "seed=2"])
    full = train_config.describe(built, full=True)
    assert "seed" in full and "[command line]" in full and "[preset smoke]" in full and "[default]" in full
    assert "smoke test, not a paper setting" in full  # the preset's source line
    short = train_config.describe(built)  # what a run prints: only what differs from the defaults, a line each
    lines = short.splitlines()
    assert lines[0].startswith("config (preset smoke); the other ") and "print_config=true" in lines[0]
    assert "[default]" not in short and max(map(len, lines)) < 120
    assert "  seed " in short and "  model.d_model " in short and "  eval.engine " not in short
    assert len(lines) - 1 + int(lines[0].split("the other ")[1].split()[0]) == full.count("\n")
    # a paper preset's source line (colons, semicolons, citations) never reaches the header: names only
    head = train_config.describe(build(["env=hopper-medium", "recipe=cpu"])).splitlines()[0]
    assert head.startswith("config (preset hopper-medium; recipe cpu); the other ") and len(head) < 120


@pytest.mark.parametrize("name", PAPER + ["smoke"])
def test_presets_have_a_source_and_valid_values(name):
    raw = presets.load_preset("dt", name)
    assert len(str(raw["source"])) > 40
    cfg = build([f"preset={name}"]).cfg
    check(cfg)
    if name != "smoke":
        m = cfg.model
        assert (m.d_model, m.n_heads, m.n_layers, cfg.K, cfg.batch_size, cfg.lr, cfg.eta, cfg.steps) == \
            (256, 4, 3, 20, 64, 1e-3, 0.05, 100_000)
        assert cfg.env == name and len(cfg.eval.targets) == 2


@pytest.mark.parametrize("name", presets.list_presets("dt"))
def test_every_dt_preset_loads_with_a_source(name):
    cfg = build([f"preset={name}"]).cfg
    check(cfg)
    assert len(str(presets.load_preset("dt", name)["source"])) > 40


@pytest.mark.parametrize("name", PAPER)
def test_the_cpu_recipe_lays_its_values_over_every_task_and_the_task_keeps_the_rest(name):
    """recipe=cpu sets exactly what configs/dt/recipes/cpu.yaml holds; the data, targets, reward scale and
    primal settings stay the task's; the command line still wins over both."""
    task, cpu = build([f"env={name}"]), build([f"env={name}", "recipe=cpu", "seed=4"])
    recipe = train_config.flat({k: v for k, v in train_config.load_recipe("cpu").items() if k != "source"})
    flat_task, flat_cpu = (train_config.flat(dataclasses.asdict(b.cfg)) for b in (task, cpu))
    for key, value in flat_cpu.items():
        if key in recipe:
            want = (("bf16" if native_bf16("cpu") else "off") if recipe[key] == "auto" else recipe[key])
            assert value == want and cpu.provenance[key] == "recipe cpu", key
        elif key not in ("recipe", "seed"):
            assert value == flat_task[key], key
    check(cpu.cfg)
    assert cpu.cfg.env == name and cpu.cfg.eval.targets == task.cfg.eval.targets and cpu.cfg.seed == 4
    assert "recipe cpu:" in cpu.source and "Decision Transformer" in cpu.source
    assert build([f"env={name}", "recipe=cpu", "steps=500"]).cfg.steps == 500
    assert "[recipe cpu]" in train_config.describe(cpu)


@pytest.fixture
def recipe_with(tmp_path, monkeypatch):
    """A copy of configs/ whose CPU recipe gets ``text`` appended (a real file the real loader reads)."""
    import shutil

    def make(text: str) -> Path:
        root = tmp_path / "configs"
        if not root.exists():
            shutil.copytree(presets.CONFIG_ROOT, root)
        path = root / "dt" / "recipes" / "cpu.yaml"
        path.write_text((presets.CONFIG_ROOT / "dt" / "recipes" / "cpu.yaml").read_text() + text)
        monkeypatch.setattr(presets, "CONFIG_ROOT", root)
        return path
    return make


def test_a_recipes_models_section_trains_that_model_its_own_way_and_the_command_line_still_wins(recipe_with):
    """``models: {dt: {...}}`` in a recipe is laid over the recipe for a run of that model by its name, whichever set
    the name (command line or preset), named in the provenance; other models, a ``model.layers`` layout and the
    command line's values are not touched."""
    recipe_with("models:\n  dt:\n    K: 40\n    stream_window: 21\n    eval:\n      engine: stream\n")
    dt = build(["env=hopper-medium", "recipe=cpu", "model=dt"])
    assert (dt.cfg.K, dt.cfg.stream_window, dt.cfg.eval.engine, dt.cfg.batch_size) == (40, 21, "stream", 64)
    assert dt.cfg.preset == "hopper-medium" and dt.cfg.model.name == "dt"
    assert dt.provenance["K"] == dt.provenance["eval.engine"] == "recipe cpu for dt"
    assert dt.provenance["batch_size"] == "recipe cpu" and "[recipe cpu for dt]" in train_config.describe(dt)
    check(dt.cfg)
    other = build(["env=hopper-medium", "recipe=cpu", "model=primal+dt"]).cfg
    assert (other.K, other.stream_window, other.eval.engine) == (20, 0, "recompute")
    back = build(["env=hopper-medium", "recipe=cpu", "model=dt", "K=20", "stream_window=0", "eval.engine=recompute"])
    assert (back.cfg.K, back.cfg.stream_window, back.cfg.eval.engine) == (20, 0, "recompute")
    assert back.provenance["K"] == "command line"
    recipe_with("models:\n  dt:\n    K: 40\n    stream_window: 21\n")  # no engine: stream_window's default
    dt = build(["env=hopper-medium", "recipe=cpu", "model=dt"])
    assert dt.cfg.eval.engine == "stream" and dt.provenance["eval.engine"] == "stream_window=21"
    back = build(["env=hopper-medium", "recipe=cpu", "model=dt", "K=20", "stream_window=0"])  # the protocol, whole
    assert (back.cfg.stream_window, back.cfg.eval.engine, back.provenance["eval.engine"]) == (0, "recompute", "default")
    layout = build(["env=hopper-medium", "recipe=cpu", "model=dt", "model.layers=softmax,softmax,softmax"]).cfg
    assert (layout.K, layout.stream_window) == (20, 0)
    assert build(["env=hopper-medium", "model=dt"]).cfg.stream_window == 0  # the paper's preset keeps the protocol
    # the CPU recipe's command offered to a long run leaves the model's own training to the recipe too
    from agents import time_projection
    offered = time_projection.cpu_recipe_command(build(["env=hopper-medium", "model=dt", "stream_window=10", "seed=2"]))
    assert "recipe=cpu" in offered and "seed=2" in offered and "stream_window" not in offered
    assert "stream_window=10" in time_projection.cpu_recipe_command(
        build(["env=hopper-medium", "model=primal+dt", "stream_window=10"]))  # the recipe sets it for dt only
    recipe_with("models:\n  primal+dt:\n    steps: 123\n")  # the preset names the model: no model= needed
    assert build(["env=hopper-medium", "recipe=cpu"]).cfg.steps == 123
    assert build(["env=hopper-medium", "recipe=cpu", "model=dt"]).cfg.steps == 7000


@pytest.mark.parametrize("text, says", [
    ("models:\n  dtt:\n    K: 40\n", "models.dtt is not a model this package builds: unknown model 'dtt'. Did you mean"),
    ("models:\n  dt:\n    KK: 40\n", "models.dt: unknown option 'KK'. Did you mean"),
    ("models:\n  dt:\n    model:\n      name: primal+dt\n", "models.dt sets the model it is for"),
    ("models:\n  dt: 40\n", "models must map a model's name to a mapping of its options"),
    ("models: [dt]\n", "models must map a model's name to a mapping of its options"),
])
def test_a_bad_models_section_is_one_error_naming_the_file_and_the_entry(recipe_with, text, says):
    recipe_with(text)
    with pytest.raises(ValueError) as err:
        build(["env=hopper-medium", "recipe=cpu", "model=primal+dt"])
    assert "configs/dt/recipes/cpu.yaml" in str(err.value) and says in str(err.value)


@pytest.mark.parametrize("native, device, want", [(True, "cpu", "bf16"), (True, "auto", "bf16"), (False, "cpu", "off"),
                                                   (False, "auto", "off"), (True, "cuda", "off"), (True, "cuda:1", "off")])
def test_amp_auto_is_bf16_on_a_cpu_computing_it_natively_resolved_when_configured(monkeypatch, native, device, want):
    """amp=auto (the CPU recipe's) means bf16 only for a run on a CPU with AVX512-BF16 or AMX; it is resolved by
    ``build``, so the config a sweep compares, a resume checks and a checkpoint keeps is what the run trains in."""
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: native)  # either instruction set counts
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    b = build(["env=hopper-medium", "amp=auto", f"device={device}"])
    assert b.cfg.amp == want and b.provenance["amp"] == "command line"
    assert build(["env=hopper-medium", f"device={device}"]).cfg.amp == "off"  # the default stays float32


def test_help_lists_every_option_with_its_default():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}  # one column, one line per option: no wrapped defaults
    p = subprocess.run([sys.executable, "-m", "primal_dt.train", "--help"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    flat = " ".join(p.stdout.split())
    for f in train_config.flat(dataclasses.asdict(train_config.TrainConfig())):
        assert f"--{f} " in flat or f"--{f}," in flat, f
    assert "(default: 100000)" in flat and "(default: primal+dt)" in flat and "(default: 3600 1800)" in flat


@pytest.mark.slow
def test_every_numeric_option_is_checked_whatever_its_value(fuzz_options):
    """Any value for any numeric option, sizes included (10**12 layers, NaN learning rates): ``check``
    accepts it or names an option given; a size no machine could build is refused here, not by the
    allocator. (tests/primal_dt/test_train.py draws values up to the first training step.)"""
    kinds = {k: "float" if isinstance(v, float) else "int" for k, v in
             train_config.flat(dataclasses.asdict(train_config.TrainConfig())).items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert {"lr", "model.d_model", "eval.max_steps", "seed", "threads"} <= set(kinds)
    fuzz_options(lambda argv: check(build(argv).cfg), {**kinds, "eval.targets": "floats"}, base=["preset=smoke"],
                 examples=150)


def test_sizes_no_machine_can_build_are_refused_by_name():
    for argv, msg in ((["model.d_model=1048576", "model.n_heads=1"], "model.d_model=1048576, model.n_layers=2.* parameters"),
                      (["model.n_layers=1000000000000"], "model.n_layers=1000000000000.* parameters"),
                      (["max_timestep=1000000000000"], "max_timestep=1000000000000 need about .* parameters"),
                      (["batch_size=1000000000", "K=1000"], "batch_size=1000000000, K=1000.* activation values")):
        with pytest.raises(ValueError, match=f"{msg}.*GB of float32"):
            check(build(["preset=smoke", *argv]).cfg)


def test_a_checkpoint_config_reads_back_and_an_option_this_release_lacks_is_named():
    """No compatibility for options no release wrote: a pre-release eval.precision is refused by name."""
    cfg = dataclasses.asdict(train_config.TrainConfig())
    assert train_config.from_dict(cfg) == train_config.TrainConfig()
    for value in ("fp32", "bf16"):
        with pytest.raises(ValueError, match="precision"):
            train_config.from_dict({**cfg, "eval": {**cfg["eval"], "precision": value}})
