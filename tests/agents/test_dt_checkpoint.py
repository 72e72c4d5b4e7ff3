"""The DT checkpoint schema (agents.dt_checkpoint): one writer, one reader, and errors that say what is
wrong with which file (another kind, another schema version, parts missing)."""

import dataclasses
import re

import numpy as np
import pytest
import torch

from agents import dt_checkpoint as schema
from agents.decision_transformer import Batch
from agents.dt_checkpoint import DTCheckpoint, TrainingState
from primal_dt.run import checkpoint as ck_io


def inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, K, c = 2, model.cfg.K, model.cfg
    S, A = torch.randn(B, K, c.state_dim, generator=g), torch.rand(B, K, c.act_dim, generator=g) * 2 - 1
    return Batch(S, A, torch.randn(B, K, 1, generator=g), torch.arange(K).expand(B, K))


def outputs(model):
    with torch.no_grad():
        return model(inputs(model))[0]


def training_state(model):
    """A real optimizer / scheduler after one step (which changes ``model``'s weights), and random
    streams as the trainer records them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    model(inputs(model))[0].pow(2).mean().backward()
    opt.step()
    sched.step()
    rng = [{"torch": torch.get_rng_state(), "numpy": schema.numpy_state(),
            "sampler": {"bit_generator": np.random.default_rng(3).bit_generator.state, "K": model.cfg.K, "batch_size": 8}}]
    return TrainingState(opt.state_dict(), sched.state_dict(), rng, step=7, train_time=1.5,
                         history={"eval/hopper-medium/3600": [(5, 12.5)]})


def test_round_trip_keeps_every_field_and_the_model_outputs(tmp_path, tiny_dt, dt_checkpoint):
    m = tiny_dt()
    ck = dt_checkpoint(m, targets=(3000.0, 1500.0), reward_scale=500.0, training=training_state(m))
    back = schema.load(schema.save(ck, tmp_path / "last.pt"))
    assert back.model_config == ck.model_config and back.config == ck.config
    for f in ("env", "reward_scale", "targets", "gym_id", "source"):
        assert getattr(back.data, f) == getattr(ck.data, f), f
    np.testing.assert_array_equal(back.data.state_mean, ck.data.state_mean)
    np.testing.assert_array_equal(back.data.state_std, ck.data.state_std)
    assert back.data.state_mean.dtype == np.float32 and back.data.targets == (3000.0, 1500.0)
    assert back.model.keys() == ck.model.keys() and all(torch.equal(back.model[k], ck.model[k]) for k in ck.model)
    t, t0 = back.training, ck.training
    assert (t.step, t.train_time, t.history) == (7, 1.5, t0.history) and back.step == 7
    assert t.scheduler == t0.scheduler and t.optimizer["param_groups"] == t0.optimizer["param_groups"]
    assert all(torch.equal(a["exp_avg"], b["exp_avg"])
               for a, b in zip(t.optimizer["state"].values(), t0.optimizer["state"].values()))
    assert torch.equal(t.rng[0]["torch"], t0.rng[0]["torch"]) and t.rng[0]["sampler"] == t0.rng[0]["sampler"]
    model = back.build_model()
    assert not model.training
    torch.testing.assert_close(outputs(model), outputs(m), atol=0, rtol=0)


def test_inference_only_checkpoint_has_no_training_state(tmp_path, tiny_dt, dt_checkpoint):
    ck = dt_checkpoint(tiny_dt())
    assert {"optimizer", "scheduler", "rng", "step"}.isdisjoint(ck.to_dict())
    back = schema.load(schema.save(ck, tmp_path / "m.pt"))
    assert back.training is None and back.step == 0


def test_a_run_directory_means_its_last_pt(tmp_path, tiny_dt, dt_checkpoint_file):
    m = tiny_dt()
    path = dt_checkpoint_file(tmp_path / "run", m, targets=(1234.0,))
    assert path.name == "last.pt" and schema.resolve(tmp_path / "run") == path
    assert schema.load(tmp_path / "run").data.targets == (1234.0,)
    assert schema.load(str(path)).data.targets == (1234.0,)


def test_clear_errors(tmp_path, tiny_dt, hopper_stats, dt_checkpoint, foreign_checkpoint_file):
    m = tiny_dt()
    with pytest.raises(ValueError, match=r"classifier\.pt holds a 'classifier' model, expected 'dt'"):
        schema.load(foreign_checkpoint_file(tmp_path))
    no_data = {k: v for k, v in dt_checkpoint(m).to_dict().items() if k != "data"}
    path = ck_io.save_atomic(no_data, tmp_path / "no-data.pt")
    with pytest.raises(ValueError, match=r"no-data\.pt lacks data, data\.env, .*not written by primal_dt\.train"):
        schema.load(path)
    (tmp_path / "empty-run").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty-run: no checkpoint at .*empty-run/last\.pt, nor in any run under"):
        schema.load(tmp_path / "empty-run")
    with pytest.raises(FileNotFoundError, match=r"checkpoint=.*nope\.pt: no checkpoint at .*nope\.pt; it does not exist: give a run"):
        schema.load(tmp_path / "nope.pt")
    newer = {**dt_checkpoint(m).to_dict(), "schema": schema.SCHEMA_VERSION + 1}
    with pytest.raises(ValueError, match="written by a newer primal-dt"):
        schema.load(newer)
    for schema_value in (None, 0, "1", True):  # absent or not today's: not a file this package wrote
        other = {**dt_checkpoint(m).to_dict(), "schema": schema_value}
        with pytest.raises(ValueError, match=rf"has checkpoint schema {re.escape(repr(schema_value))}, not "
                                             rf"{schema.SCHEMA_VERSION}: it was not written by primal-dt"):
            schema.load(ck_io.save_atomic(other, tmp_path / "other-schema.pt"))
    renamed = dt_checkpoint(m).to_dict()
    renamed["model_config"]["layout"] = renamed["model_config"].pop("name")  # a form no release wrote
    with pytest.raises(ValueError, match="model_config is not a valid DTConfig .*layout"):
        schema.load(renamed)
    other_dims = dt_checkpoint(m).to_dict()
    other_dims["data"]["state_mean"] = torch.zeros(17)
    other_dims["data"]["state_std"] = torch.ones(17)
    with pytest.raises(ValueError, match="data.state_mean and data.state_std have 17 and 17 entries but the model "
                                         "observes state_dim=11"):
        schema.load(other_dims)
    bad_scale = dt_checkpoint(m).to_dict()
    bad_scale["data"]["reward_scale"] = 0.0
    with pytest.raises(ValueError, match="data.reward_scale must be a finite number > 0, got 0.0"):
        schema.load(bad_scale)
    wider = dt_checkpoint(tiny_dt(d_model=64)).to_dict()
    wider["model_config"] = dataclasses.asdict(m.cfg)  # weights of another width than the config says
    with pytest.raises(ValueError, match="weights do not fit its model_config"):
        schema.load(wider).build_model()
    assert isinstance(schema.load(dt_checkpoint(m)), DTCheckpoint)


def test_the_dataset_fingerprint_is_kept_and_decides_what_data_fits(tmp_path, tiny_dt, hopper_stats, dt_checkpoint,
                                                                     write_hopper_file):
    from envs import load_dataset

    mine = load_dataset("hopper-medium", source=f"d4rl:{write_hopper_file(tmp_path / 'a-v2.hdf5')}", verbose=False)
    other = load_dataset("hopper-medium", source=f"d4rl:{write_hopper_file(tmp_path / 'b-v2.hdf5', seed=1)}",
                         verbose=False)
    ck = dt_checkpoint(tiny_dt(), source=mine.source)
    ck.data.fingerprint = mine.fingerprint
    back = schema.load(schema.save(ck, tmp_path / "run" / "last.pt"))
    assert back.data.fingerprint == mine.fingerprint and back.origin == f"checkpoint {tmp_path / 'run' / 'last.pt'}"
    schema.check_data(back.data, mine, back.origin)
    with pytest.raises(ValueError, match=f"was trained on {mine.source} .*but the data read now from {other.source} "
                                         "differs"):
        schema.check_data(back.data, other, back.origin)
    # a checkpoint that records no fingerprint (made in code) vouches for no data
    unknown = schema.DataInfo("hopper-medium", mine.state_mean, mine.state_std, 1000.0, source=mine.source)
    with pytest.raises(ValueError, match="made.pt records no dataset fingerprint"):
        schema.check_data(unknown, mine, "made.pt")


# -- malformed fields: every one is a ValueError naming the field, never another exception -------------------
@pytest.fixture(scope="module")
def trained_dict(tiny_dt, dt_checkpoint):
    """A DT checkpoint dict with a real training state (what primal_dt.train writes), d_model 32."""
    m = tiny_dt()
    return dt_checkpoint(m, training=training_state(m)).to_dict()


def _with(d: dict, path: tuple, value):
    """A copy of checkpoint dict ``d`` with the field at ``path`` set to ``value`` (``_GONE``: removed)."""
    import copy

    d = copy.deepcopy(d)
    node = d
    for key in path[:-1]:
        node = node[key]
    if value is _GONE:
        if isinstance(node, dict):
            node.pop(path[-1], None)
        elif -len(node) <= path[-1] < len(node):  # a list: the entry taken out
            del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


_GONE = object()
FIELDS = [("config",), ("model_config",), ("model",), ("data",), ("optimizer",), ("scheduler",), ("rng",), ("step",),
          ("train_time",), ("history",), ("data", "env"), ("data", "state_mean"), ("data", "state_std"),
          ("data", "reward_scale"), ("data", "targets"), ("data", "held_out"), ("data", "gym_id"), ("data", "source"),
          ("data", "fingerprint"), ("model_config", "d_model"), ("model_config", "n_layers"), ("model_config", "K"),
          ("model_config", "max_timestep"), ("model_config", "name"), ("model_config", "attention_options"),
          ("model_config", "state_dim"), ("rng", 0), ("optimizer", "param_groups"), ("history", "eval/x")]


def test_a_malformed_field_is_one_error_naming_the_field(trained_dict):
    """Hostile values (wrong kinds, absurd sizes, NaN, missing parts) in any field a reader uses: the
    schema accepts the checkpoint whole or refuses it with a ValueError, and what it accepts builds."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    values = st.one_of(st.just(_GONE), st.none(), st.booleans(), st.integers(-5, 5),
                       st.sampled_from([10**9, 10**12, 2**63, -1]), st.floats(allow_nan=True),
                       st.text(max_size=3), st.lists(st.integers(-2, 2), max_size=3),
                       st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                       st.sampled_from([torch.zeros(3), torch.full((11,), float("nan")), torch.zeros(624, dtype=torch.int64)]))

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.sampled_from(FIELDS), values)
    def prop(path, value):
        d = _with(trained_dict, path, value)
        try:
            ck = schema.DTCheckpoint.from_dict(d, where="checkpoint x.pt")
        except ValueError as err:
            assert "checkpoint x.pt" in str(err), err
            return
        try:
            ck.build_model()
        except ValueError as err:  # names and shapes are checked when the network is built
            assert "model_config" in str(err), err

    prop()


@pytest.mark.parametrize("path, value, words", [
    (("config",), 5, "config must be a mapping"),
    (("history",), [1, 2], "history must be a mapping of tag"),
    (("rng",), _GONE, "lacks rng"),
    (("optimizer",), _GONE, "lacks optimizer"),
    (("step",), "7", "step must be an integer >= 0"),
    (("model_config", "d_model"), 10**9, "d_model=1000000000"),
    (("model_config", "n_layers"), 10**6, "1000000 layers"),
    (("model_config", "max_timestep"), 10**12, "holds"),
    (("step",), 10**30, "step must be an integer >= 0 and at most 1e+15"),  # TensorBoard's int64 refused it late
    (("data", "targets"), [1e300], "data.targets must be a number of at most 1e+15 in size"),  # inf in float32
    (("data", "gym_id"), "Hopper-v99", "data.gym_id must be the simulator of hopper-medium (Hopper-v4 or Hopper-v5)"),
])
def test_each_malformed_field_is_named(trained_dict, path, value, words):
    """The fields the issue found ending in tracebacks (or, for sizes, in the allocator) are refused by name,
    before any network is built."""
    with pytest.raises(ValueError, match=re.escape(words)):
        schema.DTCheckpoint.from_dict(_with(trained_dict, path, value), where="checkpoint x.pt")


def test_a_weight_holding_nan_is_refused_by_name(trained_dict):
    """Training never saves a step that diverged, so a NaN weight is damage: refused when read, not a
    FloatingPointError traceback at the first action."""
    d = _with(trained_dict, ("model",), dict(trained_dict["model"]))
    key = next(k for k, t in d["model"].items() if t.is_floating_point())
    d["model"][key] = torch.full_like(d["model"][key], float("nan"))
    with pytest.raises(ValueError, match=rf"checkpoint x.pt: weight {re.escape(key)} holds NaN or inf values"):
        schema.DTCheckpoint.from_dict(d, where="checkpoint x.pt")


def test_a_malformed_checkpoint_is_one_error_line_in_a_command(tmp_path, tiny_dt, dt_checkpoint, run_cli,
                                                               one_line_error):
    """What a command does with such a file: one error line naming it, exit 2 (here eval.rollout)."""
    m = tiny_dt()
    bad = _with(dt_checkpoint(m, training=training_state(m)).to_dict(), ("config",), 5)
    path = ck_io.save_atomic(bad, tmp_path / "run" / "last.pt")
    one_line_error(run_cli("eval.rollout", f"checkpoint={path}", "episodes=1"), str(path), "config must be a mapping")


# -- one declaration per field: the writer, the reader and the export metadata walk the same schema ---------------
def test_every_field_declares_its_check_once_and_one_without_is_refused_at_once():
    """Each stored field of the three records says how it is read back; a record field without a declaration
    would be written but read back as its default, so the schema refuses it when first walked."""
    for cls in (DTCheckpoint, schema.DataInfo, TrainingState):
        declared = {name for name, _ in schema.stored_fields(cls)}
        assert declared == {f.name for f in dataclasses.fields(cls) if f.name != "origin"}, cls
    careless = dataclasses.make_dataclass("Careless", [("a", int, schema.stored("step")), ("b", int)])
    with pytest.raises(TypeError, match=r"Careless\.b declares no check: declare it with stored"):
        schema.stored_fields(careless)


def _leaves(d: dict, prefix=()) -> list[tuple]:
    """Every field path a written checkpoint holds, records opened (the state_dicts, the optimizer's and the
    config's insides are their checks' business)."""
    out = []
    for k, v in d.items():
        if k in schema.ENVELOPE:
            continue
        out.append((*prefix, k))
        if k in ("data", "model_config") and not prefix:
            out += _leaves(v, (k,))
    return out


def test_every_field_the_writer_writes_is_required_when_read(tiny_dt, dt_checkpoint, trained_dict):
    """A field left out of a file is an error naming the file and the field (it came back as its default,
    silently); the moving average alone is written only when kept, so its absence reads back as none."""
    paths = _leaves(trained_dict)
    assert ("data", "held_out") in paths and ("history",) in paths and ("model_config", "K") in paths
    for path in paths:
        d = _with(trained_dict, path, _GONE)
        if path == ("ema",):
            assert schema.DTCheckpoint.from_dict(d).ema is None
            continue
        with pytest.raises(ValueError) as err:
            schema.DTCheckpoint.from_dict(d, where="checkpoint x.pt")
        message, name = str(err.value), ".".join(path)
        if path[0] == "model_config" and len(path) == 2:
            assert f"checkpoint x.pt: model_config is not a valid DTConfig (it lacks {path[1]})" in message, message
        else:
            assert message.startswith(f"checkpoint x.pt lacks {name}") and "this release wrote" in message, message
    # an inference-only file holds no training state at all, and reads back as such
    bare = dt_checkpoint(tiny_dt()).to_dict()
    assert {"optimizer", "train_time", "history", "ema"}.isdisjoint(bare)
    assert schema.DTCheckpoint.from_dict(bare).training is None


@pytest.mark.parametrize("path, words", [
    (("extra",), "checkpoint x.pt holds field extra that this release of primal-dt does not read"),
    (("data", "extra"), "checkpoint x.pt holds field data.extra that this release of primal-dt does not read"),
    (("model_config", "extra"), "model_config is not a valid DTConfig (it holds extra, which DTConfig has not)"),
])
def test_an_unknown_field_is_an_error_naming_it(trained_dict, path, words):
    """A field this release does not declare (a newer release's, or an edit) is refused, not dropped."""
    with pytest.raises(ValueError, match=re.escape(words)):
        schema.DTCheckpoint.from_dict(_with(trained_dict, path, 1), where="checkpoint x.pt")


@pytest.mark.parametrize("path, value, words", [
    (("data",), 5, "checkpoint x.pt: data must be a mapping (DataInfo's fields), got 5"),
    (("data", "source"), 5, "checkpoint x.pt: data.source must be a string, got 5"),
    (("data", "held_out"), [-1], "checkpoint x.pt: data.held_out must be a list of integers >= 0"),
    (("train_time",), "1.5", "checkpoint x.pt: train_time must be a finite number >= 0"),
    (("ema",), [1], "checkpoint x.pt: ema must be a state_dict"),
])
def test_a_wrongly_typed_field_is_named_by_its_declared_check(trained_dict, path, value, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        schema.DTCheckpoint.from_dict(_with(trained_dict, path, value), where="checkpoint x.pt")


def test_the_export_metadata_holds_what_the_fields_declare(tiny_dt, dt_checkpoint):
    """The fields that declare an export key reach an exported policy's metadata with their values (none is
    overwritten by the graph's own description), in JSON."""
    import json

    from agents import export

    m = tiny_dt()
    ck = dt_checkpoint(m, targets=(3000.0, 1500.0), training=training_state(m))
    ck.data.fingerprint = "sha256:abc"
    declared = schema.exported(ck)
    assert declared == {"env": ck.data.env, "reward_scale": ck.data.reward_scale, "targets": [3000.0, 1500.0],
                        "gym_id": ck.data.gym_id, "data_source": ck.data.source, "data_fingerprint": "sha256:abc",
                        "train_step": 7}
    meta = export.metadata(export.stream_step(ck.build_model(), ck.data), ck, None, "in memory", "onnx")
    assert {k: meta[k] for k in declared} == declared and meta["default_target"] == 3000.0
    assert json.loads(json.dumps(meta))["train_step"] == 7


def test_a_diverged_runs_checkpoint_says_the_run_diverged_not_that_the_file_is_damaged(tmp_path, tiny_dt,
                                                                                     dt_checkpoint):
    """One AdamW step at an absurd learning rate moves the weights far beyond what any policy acts with: the
    file is still refused (no action would be finite), but as the run that diverged it is, while a weight that
    large in a file whose own training could not reach it stays damage."""
    m = tiny_dt()
    opt = torch.optim.AdamW(m.parameters(), lr=1e30)
    m(inputs(m))[0].pow(2).mean().backward()
    opt.step()
    state = TrainingState(opt.state_dict(), {"last_epoch": 1}, training_state(tiny_dt()).rng, step=1)
    path = schema.save(dt_checkpoint(m, training=state), tmp_path / "last.pt")
    with pytest.raises(ValueError) as err:
        schema.load(path)
    message = str(err.value)
    assert f"checkpoint {path}: weight " in message and "beyond 1e+06" in message and "damaged" not in message
    assert "its run's own learning rate moved them there" in message and "train again with a lower lr" in message


def test_a_run_at_an_absurd_learning_rate_ends_saying_its_last_checkpoint_diverged(hopper_file, tmp_path, tiny_train):
    """The trainer's divergence message names what its last checkpoint holds: the step-1 weights an lr of 1e30
    made, which the reader refuses as a diverged run's, not as a damaged file."""
    from primal_dt.train import Diverged, run

    with pytest.raises(Diverged, match="diverged at step") as err:
        run(tiny_train.args(hopper_file, tmp_path, "steps=50", "lr=1e30", "warmup_steps=0", "grad_clip=0",
                            "checkpoint_every=1", *tiny_train.QUIET))
    message = str(err.value)
    assert "its run's own learning rate moved them there" in message and "damaged" not in message, message
