"""The DT checkpoint schema (agents.dt_checkpoint): one writer, one reader, files of release 0.1
still read, and errors that say what is wrong with which file."""

import inspect

import numpy as np
import pytest
import torch
import yaml

from agents import dt_checkpoint as schema
from agents.dt_checkpoint import DTCheckpoint, TrainingState
from primal_dt import checkpoint as ck_io
from primal_dt.attention import get_class


def inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, K, c = 2, model.cfg.K, model.cfg
    S, A = torch.randn(B, K, c.state_dim, generator=g), torch.rand(B, K, c.act_dim, generator=g) * 2 - 1
    return S, A, torch.randn(B, K, 1, generator=g), torch.arange(K).expand(B, K)


def outputs(model):
    with torch.no_grad():
        return model(*inputs(model))[0]


def training_state(model):
    """A real optimizer / scheduler after one step (which changes ``model``'s weights), and random
    streams as the trainer records them."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    model(*inputs(model))[0].pow(2).mean().backward()
    opt.step()
    sched.step()
    rng = [{"torch": torch.get_rng_state(), "sampler": {"bit_generator": np.random.default_rng(3).bit_generator.state,
                                                        "K": model.cfg.K, "batch_size": 8}}]
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


def legacy_model_config(cfg) -> dict:
    """``model_config`` as files wrote it before it was the user's model options: ``layout``, a list of
    ``layers`` and a dict of per-mechanism ``options`` (primal's ``s`` among them)."""
    keep = ("state_dim", "act_dim", "K", "d_model", "n_heads", "n_layers", "dropout", "activation", "mlp_ratio",
            "max_timestep")
    return {**{k: getattr(cfg, k) for k in keep}, "layout": cfg.name, "layers": list(cfg.layer_names()),
            "options": cfg.options()}


def release_0_1(model, hopper_stats):
    """A checkpoint dict as release 0.1's primal_dt.train wrote it: no ``schema`` key, K / max_timestep
    repeated under ``data``, no dataset fingerprint, numpy's global random state as numpy itself
    returns it (a tuple holding a uint32 array), and the model config in its old form."""
    mean, std = hopper_stats
    opt = torch.optim.AdamW(model.parameters())
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
           "sampler": {"bit_generator": np.random.default_rng(3).bit_generator.state, "K": model.cfg.K, "batch_size": 8}}
    return {"kind": "dt", "config": {"env": "hopper-medium", "K": model.cfg.K, "reward_scale": 1000.0},
            "model_config": legacy_model_config(model.cfg), "model": model.state_dict(), "optimizer": opt.state_dict(),
            "scheduler": {}, "rng": [rng], "step": 40, "train_time": 2.0,
            "history": {},
            "data": {"env": "hopper-medium", "gym_id": "Hopper-v4", "source": "d4rl:/data/hopper_medium-v2.hdf5",
                     "state_mean": torch.as_tensor(mean), "state_std": torch.as_tensor(std), "reward_scale": 1000.0,
                     "targets": [3600.0, 1800.0], "K": model.cfg.K, "max_timestep": model.cfg.max_timestep}}


def test_release_0_1_checkpoints_still_load(tmp_path, tiny_dt, hopper_stats):
    """Read with weights_only=True, numpy's random state included (the only numpy objects allowed)."""
    from agents.dt_checkpoint import set_numpy_state

    m = tiny_dt()
    d = release_0_1(m, hopper_stats)
    path = ck_io.save_atomic(d, tmp_path / "last.pt")
    for ck in (schema.load(d), schema.load(path)):
        assert ck.data.fingerprint == ""  # none recorded: data checks fall back to the statistics, with a note
        set_numpy_state(ck.training.rng[0]["numpy"])
        assert np.random.get_state()[2] == d["rng"][0]["numpy"][2]
        np.testing.assert_array_equal(np.random.get_state()[1], d["rng"][0]["numpy"][1])
        assert ck.data.env == "hopper-medium" and ck.data.reward_scale == 1000.0
        assert ck.data.targets == (3600.0, 1800.0) and ck.data.source == "d4rl:/data/hopper_medium-v2.hdf5"
        np.testing.assert_array_equal(ck.data.state_mean, hopper_stats[0])
        assert ck.step == 40 and ck.config["K"] == m.cfg.K and ck.model_config == m.cfg
        torch.testing.assert_close(outputs(ck.build_model()), outputs(m), atol=0, rtol=0)
    assert schema.load(path).to_dict()["schema"] == schema.SCHEMA_VERSION  # rewritten in today's layout


def test_an_old_model_config_builds_the_same_network(tiny_dt):
    """Every form ``model_config`` took: windows and per-layer lists included, an options dict
    without primal's ``s`` (the mechanism's own default then), and ``attention_options`` as YAML text."""
    from agents import DecisionTransformer, DTConfig

    for m in (tiny_dt(), tiny_dt("dt", options={"softmax": {"window": 4}}),
              tiny_dt(layers=("softmax", "linear", "primal"), options={"primal": {"s": 6, "window": 5}})):
        old = DTConfig.from_dict(legacy_model_config(m.cfg))
        assert old.layer_specs() == m.cfg.layer_specs()
        again = DecisionTransformer(old).eval()
        again.load_state_dict(m.state_dict())
        torch.testing.assert_close(outputs(again), outputs(m), atol=0, rtol=0)
        yaml_text = {**m.cfg.to_dict(), "attention_options": yaml.safe_dump(m.cfg.options(), default_flow_style=True)}
        assert DTConfig.from_dict(yaml_text).layer_specs() == m.cfg.layer_specs()  # the YAML text configs held
    no_s = {**legacy_model_config(tiny_dt().cfg), "options": {}}
    default_s = inspect.signature(get_class("primal").__init__).parameters["s"].default
    assert DTConfig.from_dict(no_s).layer_specs()[-1].options == {"s": default_s}


def test_clear_errors(tmp_path, tiny_dt, hopper_stats, dt_checkpoint, foreign_checkpoint_file):
    m = tiny_dt()
    with pytest.raises(ValueError, match=r"classifier\.pt holds a 'classifier' model, expected 'dt'"):
        schema.load(foreign_checkpoint_file(tmp_path))
    no_data = {k: v for k, v in release_0_1(m, hopper_stats).items() if k != "data"}
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
    other_dims = dt_checkpoint(m).to_dict()
    other_dims["data"]["state_mean"] = torch.zeros(17)
    other_dims["data"]["state_std"] = torch.ones(17)
    with pytest.raises(ValueError, match="data.state_mean has 17 entries but the model observes state_dim=11"):
        schema.load(other_dims)
    bad_scale = dt_checkpoint(m).to_dict()
    bad_scale["data"]["reward_scale"] = 0.0
    with pytest.raises(ValueError, match="its data part is not valid: reward_scale must be > 0"):
        schema.load(bad_scale)
    wider = dt_checkpoint(tiny_dt(d_model=64)).to_dict()
    wider["model_config"] = m.cfg.to_dict()  # weights of another width than the config says
    with pytest.raises(ValueError, match="weights do not fit its model_config"):
        schema.load(wider).build_model()
    assert isinstance(schema.load(dt_checkpoint(m)), DTCheckpoint)


def test_the_dataset_fingerprint_is_kept_and_decides_what_data_fits(tmp_path, tiny_dt, hopper_stats, dt_checkpoint,
                                                                     write_hopper_file, capsys):
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
    # a checkpoint from before fingerprints: a note, then the normalisation statistics decide
    old = schema.DataInfo("hopper-medium", mine.state_mean, mine.state_std, 1000.0, source=mine.source)
    schema.check_data(old, mine, "old.pt")
    assert "old.pt records no dataset fingerprint" in capsys.readouterr().err
    with pytest.raises(ValueError, match="old.pt was trained on data with other normalisation statistics"):
        schema.check_data(old, other, "old.pt")
