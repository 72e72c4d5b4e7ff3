"""eval.spectrum on small stacks: spectra of known rank, head redundancy, padding, outputs; on a
DT checkpoint: the segments it analyses are the ones training drew."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from torch import nn

from eval.spectrum import analyse, attention_matrix, capture_attention_inputs, head_redundancy, main, singular_spectrum, write
from primal_dt.attention.softmax import SoftmaxAttention
from primal_dt.blocks import LayerSpec, Stack

D, H = 16, 2


class Wrapper(nn.Module):
    """Any module holding a Stack works; here an embedding in front of it."""

    def __init__(self, layers, causal=False):
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.stack = Stack(D, H, layers, causal=causal, dropout=0.0)

    def forward(self, x, mask=None):
        return self.stack(self.inp(x), mask)


class Unprobed(SoftmaxAttention):
    """A mechanism that names no values for the probe (as a user-defined one may)."""

    value_projection = None


def test_layers_are_analysed_and_unprobed_ones_skipped():
    torch.manual_seed(0)
    m = Wrapper(["softmax", LayerSpec("primal", {"s": 4}), "linear", "reformer", "softmax"])
    m.stack.blocks[4].attn = Unprobed(D, H)
    x = torch.randn(3, 12, 3)
    rep = analyse(m, lambda: m(x))
    assert [l.name for l in rep.layers] == ["stack.layer0", "stack.layer1", "stack.layer2", "stack.layer3"]
    assert rep.skipped == ["stack.layer4 (Unprobed)"]
    for layer in rep.layers:
        sv, cev = torch.tensor(layer.singular_values), torch.tensor(layer.explained_variance)
        assert sv[0] == pytest.approx(1.0) and (sv[1:] <= sv[:-1] + 1e-9).all()
        assert (cev[1:] >= cev[:-1] - 1e-9).all() and cev[-1] == pytest.approx(1.0)
        assert 1 <= layer.rank90 <= 12
    # the primal layer's induced kernel phi(q) phi(k)^T has rank <= d_head = 8 < T = 12
    primal = rep.layers[1]
    assert primal.explained_variance[D // H - 1] == pytest.approx(1.0, abs=1e-9)
    assert max(primal.singular_values[D // H:]) < 1e-6


def test_causal_layers_give_lower_triangular_matrices_and_softmax_rows_sum_to_one():
    torch.manual_seed(0)
    m = Wrapper(["softmax", LayerSpec("primal", {"s": 4}), "linear"], causal=True)
    x = torch.randn(2, 9, 3)
    mask = torch.tensor([[False] * 2 + [True] * 7, [True] * 9])
    captured = capture_attention_inputs(m, lambda: m(x, mask))
    soft, primal, lin = (attention_matrix(attn, xs, ms) for _, attn, xs, ms in captured)
    rows = (mask[:, None, :, None] & mask[:, None, None, :]).expand(2, H, 9, 9)
    for A in (soft, lin):
        assert (A.triu(1) == 0).all() and (A[~rows] == 0).all()
        torch.testing.assert_close(A.sum(-1)[rows[..., 0]], torch.ones(int(rows[..., 0].sum())))
    assert not primal.triu(1).eq(0).all()  # a kernel of prefix means, not a causal mixing matrix


def test_identical_heads_have_zero_redundancy_distance():
    A = torch.softmax(torch.randn(2, 1, 6, 6), -1)
    assert head_redundancy(A.expand(2, 3, 6, 6), None) == pytest.approx(0.0, abs=1e-12)
    B = torch.softmax(torch.randn(2, 3, 6, 6), -1)
    assert head_redundancy(B, None) > 0.05
    assert head_redundancy(B[:, :1], None) is None


def test_padding_is_left_out_of_the_spectrum():
    A = torch.softmax(torch.randn(1, 2, 5, 5), -1)
    padded = torch.zeros(1, 2, 8, 8)
    padded[:, :, 2:7, 2:7] = A
    mask = torch.tensor([[False, False, True, True, True, True, True, False]])
    sv, cev, r90 = singular_spectrum(A, None)
    svp, cevp, r90p = singular_spectrum(padded + torch.rand(1, 2, 8, 8) * ~(mask[:, None, :, None] & mask[:, None, None, :]), mask)
    torch.testing.assert_close(svp[:5], sv)
    assert (svp[5:] == 0).all() and (cevp[5:] == 1).all() and r90p == r90
    assert head_redundancy(padded, mask) == pytest.approx(head_redundancy(A, None))


def test_write_png_json_and_tensorboard(tmp_path):
    torch.manual_seed(0)
    m = Wrapper(["softmax", LayerSpec("primal", {"s": 4})])
    x = torch.randn(2, 7, 3)
    mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    rep = analyse(m, lambda: m(x, mask))
    files = write(rep, tmp_path / "spec")
    assert files["png"].stat().st_size > 1000
    data = json.loads(files["json"].read_text())
    assert [l["mechanism"] for l in data["layers"]] == ["SoftmaxAttention", "PrimalAttention"]
    assert list((tmp_path / "spec").glob("events.out.tfevents.*"))


def test_model_without_stack_is_a_clear_error():
    with pytest.raises(ValueError, match="no primal_dt.blocks.Stack"):
        analyse(nn.Linear(2, 2), lambda: None)


def test_cli_usage_and_missing_checkpoint(capsys):
    for argv, msg in (([], "--checkpoint"), (["checkpoint=x.pt", "bogus=1"], "--bogus"),
                      (["checkpoint=x.pt", "n=many"], "many"), (["checkpoint=x.pt", "tensorboard=maybe"], "maybe")):
        with pytest.raises(SystemExit) as exit_:  # tyro's errors
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and msg in err and "Traceback" not in err, err
    with pytest.raises(SystemExit, match="error: checkpoint /nonexistent/ckpt.pt does not exist"):
        main(["checkpoint=/nonexistent/ckpt.pt"])
    for bad, msg in (("n=0", "n must be >= 1, got 0"), ("seed=-1", r"seed must be in \[0, 4294967296\), got -1")):
        with pytest.raises(SystemExit, match=msg):
            main(["checkpoint=/nonexistent/ckpt.pt", bad])  # options are checked before the file is read


def test_unknown_checkpoint_kind_is_a_clear_error():
    from eval.spectrum import build_from_checkpoint

    with pytest.raises(ValueError, match="kind 'gan'"):
        build_from_checkpoint({"kind": "gan", "config": {}, "model": {}})


# -- DT checkpoints: the spectrum sees what training saw ----------------------------------------------
K, MAX_T, SCALE, SEED = 6, 50, 1000.0, 3


def dataset_file(path, seed=0):
    """A real D4RL-format file (hopper's dimensions) of 30 episodes with known rewards, so returns-to-go
    reach a few hundred: scaled right they are below 1, scaled 10^6 too large they are not."""
    from envs import Trajectories
    from envs.d4rl import write_d4rl

    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 80, size=30)
    n = int(lengths.sum())
    ds = Trajectories(observations=rng.normal(size=(n, 11)) * 2 + 1, actions=rng.uniform(-1, 1, (n, 3)),
                      rewards=rng.uniform(1, 4, n), starts=np.concatenate([[0], np.cumsum(lengths)[:-1]]),
                      lengths=lengths, terminal=rng.random(30) < 0.5)
    ends = ds.starts + ds.lengths - 1
    terminals, timeouts = np.zeros(n, bool), np.zeros(n, bool)
    terminals[ends], timeouts[ends] = ds.terminal, ~ds.terminal
    return write_d4rl(path, {"observations": ds.observations, "actions": ds.actions, "rewards": ds.rewards,
                             "terminals": terminals, "timeouts": timeouts})


@pytest.fixture
def trained_dt(tmp_path, tiny_dt):
    """(checkpoint path, dataset source): a primal+dt model trained a few steps on the file, as
    primal_dt.train does (its sampler, seed and settings), saved with the schema."""
    from agents.decision_transformer import DecisionTransformer, dt_loss
    from agents.dt_checkpoint import DataInfo, DTCheckpoint, save
    from envs import SegmentSampler, load_dataset

    source = f"d4rl:{dataset_file(tmp_path / 'hopper_small-v2.hdf5')}"
    data = load_dataset("hopper-medium", source=source, verbose=False)
    torch.manual_seed(SEED)
    model = DecisionTransformer(dataclasses.replace(tiny_dt("primal+dt", K=K).cfg, max_timestep=MAX_T)).train()
    sampler = SegmentSampler(data, K, 16, SCALE, MAX_T, SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        dt_loss(model, sampler.sample(), eta=0.05)[0].backward()
        opt.step()
    info = DataInfo(env="hopper-medium", state_mean=data.state_mean, state_std=data.state_std, reward_scale=SCALE,
                    targets=(3600.0, 1800.0), gym_id=data.gym_id, source=data.source, fingerprint=data.fingerprint)
    config = {"env": "hopper-medium", "data_source": source, "K": K, "max_timestep": MAX_T, "reward_scale": SCALE,
              "seed": SEED}
    path = save(DTCheckpoint(model.cfg, model.state_dict(), info, config), tmp_path / "run" / "last.pt")
    return path, source


def test_dt_spectrum_feeds_the_batches_training_draws(trained_dt):
    """Same K, reward_scale (a divisor), max_timestep and seed as the training sampler: the same
    batch, returns-to-go included (a multiplier here once made them 10^6 too large)."""
    from envs import SegmentSampler, load_dataset
    from eval.spectrum import build_from_checkpoint
    from primal_dt.run import checkpoint

    path, source = trained_dt
    model, run = build_from_checkpoint(checkpoint.load(path), n=32, seed=11)
    fed = []
    hook = model.register_forward_pre_hook(lambda mod, args, kwargs: fed.append(args), with_kwargs=True)
    try:
        run()
    finally:
        hook.remove()
    (got,) = fed[0]
    data = load_dataset("hopper-medium", source=source, verbose=False)
    train = SegmentSampler(data, K, 32, SCALE, MAX_T, 11)  # as primal_dt.train builds it
    idx, want_mask = SegmentSampler(data, K, 32, SCALE, MAX_T, 11).indices()  # the same draw
    ref = train.sample()
    for name in ("states", "actions", "rtg", "timesteps", "mask"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    # independently of the sampler's arithmetic: raw return-to-go / 1000 at every real step
    np.testing.assert_array_equal(got.mask.numpy(), want_mask)
    np.testing.assert_allclose(got.rtg[..., 0].numpy()[want_mask], data.rtg[idx[want_mask]] / SCALE, rtol=1e-6)
    assert 0 < float(got.rtg.max()) < 1
    assert int(got.timesteps.max()) <= MAX_T - 1 and got.states.shape == (32, K, 11)


def test_dt_spectrum_cli_end_to_end_and_foreign_data_is_refused(trained_dt, tmp_path):
    from eval.spectrum import main

    path, _ = trained_dt
    assert main([f"checkpoint={path}", f"out={tmp_path / 'spec'}", "n=8", "tensorboard=false"]) == 0
    data = json.loads((tmp_path / "spec" / "spectrum.json").read_text())
    assert [l["mechanism"] for l in data["layers"]] == ["SoftmaxAttention", "SoftmaxAttention", "PrimalAttention"]
    # a run directory works as everywhere else (its last.pt), and gives the same spectrum
    assert main([f"checkpoint={path.parent}", f"out={tmp_path / 'spec-dir'}", "n=8", "tensorboard=false"]) == 0
    assert json.loads((tmp_path / "spec-dir" / "spectrum.json").read_text())["layers"] == data["layers"]
    other = f"d4rl:{dataset_file(tmp_path / 'other-v2.hdf5', seed=1)}"
    with pytest.raises(SystemExit, match=f"error: checkpoint {path} was trained on {trained_dt[1]} .*but the data "
                                         f"read now from {other} differs"):
        main([f"checkpoint={path}", f"out={tmp_path / 'spec2'}", "n=8", f"data_source={other}"])


@pytest.mark.slow
def test_a_spectrum_that_cannot_be_written_is_one_line_and_leaves_no_partial_file(trained_dt, tmp_path, run_cli,
                                                                                  one_line_error):
    path, _ = trained_dt
    out = tmp_path / "spec"
    p = run_cli("eval.spectrum", f"checkpoint={path}", f"out={out}", "n=8", "tensorboard=false", file_size=10_000)
    one_line_error(p, f"could not write the spectrum plot {out / 'spectrum.png'}: file too large", status=1)
    assert not out.exists() or not list(out.iterdir())
    (tmp_path / "file").write_text("x")
    p = run_cli("eval.spectrum", f"checkpoint={path}", f"out={tmp_path / 'file' / 'spec'}", "n=8", "tensorboard=false")
    one_line_error(p, f"{tmp_path / 'file' / 'spec' / 'spectrum.png'}: a part of the path is a file", status=1)
