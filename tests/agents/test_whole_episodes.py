"""Whole-episode training (``whole_episodes=true``): lanes walk episodes in consecutive K-step chunks, each chunk
run through the stream's recurrent form from the state its episode's previous chunk left. The stream agent in a
real Hopper simulator equals that chunked forward at every step (the trained computation is the deployed one);
the lanes cover every episode in order; a run trains, validates, resumes exactly and says its stream is exact."""

from pathlib import Path

import numpy as np
import pytest
import torch

from agents import Agent, DataInfo, compile_check, dt_checkpoint, train_config, train_step, training
from agents.decision_transformer import Batch, DecisionTransformer, DTConfig
from agents.stream_training import Carry
from envs import EpisodeChunks, SegmentSampler, Trajectories
from primal_dt.run.errors import SetupError

from .test_compile_check import Cheap
from .test_stream_training import episode_tensors, simulate
from .test_training import QUIET, TINY, args, train


def chunked_forward(model, S, A, R, Tt, K, pad_last=False):
    """Actions of the model run over the episode K steps at a time, each chunk from the state the one before left."""
    state, preds = model.chunk_form().init(1), []
    for c in range(0, S.shape[1], K):
        part = [x[:, c:c + K] for x in (S, A, R, Tt)]
        n, mask = part[0].shape[1], None
        if pad_last and n < K:  # the sampler's last chunk: right-padded to K steps, masked
            part = [torch.cat([x, torch.zeros(1, K - n, *x.shape[2:], dtype=x.dtype)], 1) for x in part]
            mask = torch.arange(K)[None] < n
        with torch.no_grad():
            pred, _, state = model(Batch(*part, mask=mask, trailing=True, state=state))
        preds.append(pred[:, :n])
    return torch.cat(preds, 1)[0].numpy()


@pytest.mark.parametrize("layout", ["primalformer-dt", "primal+dt", "dt"])
def test_stream_agent_in_hopper_equals_the_chunked_forward_it_trains(layout, tiny_dt, hopper_stats):
    """70 steps, K = 20: three whole chunks and a short (or padded) fourth, each from the carried state. Softmax
    layers stream over 3K - 1 tokens in both (so the chunked forward is not the K-step segment forward)."""
    m = tiny_dt(layout, K=20)
    mean, std = hopper_stats
    ag = Agent(m, DataInfo("hopper-medium", mean, std, reward_scale=1000.0, targets=(3600.0,)), engine="stream")
    rec = simulate(ag, T=70)
    assert len(rec["act"]) == 70
    S, A, R, Tt = episode_tensors(rec, mean, std)
    np.testing.assert_allclose(rec["act"], chunked_forward(m, S, A, R, Tt, K=20), atol=1e-5, rtol=0)
    np.testing.assert_allclose(rec["act"], chunked_forward(m, S, A, R, Tt, K=20, pad_last=True), atol=1e-5, rtol=0)
    with torch.no_grad():  # the K-step segments' forward is another policy past the first chunk
        segment, _ = m(Batch(S[:, 40:60], A[:, 40:60], R[:, 40:60], Tt[:, 40:60]))
    assert np.abs(segment[0].numpy() - rec["act"][40:60]).max() > 1e-4  # (ten times the tolerance above)


def small_trajectories(lengths, obs_dim=3, act_dim=2):
    n = sum(lengths)
    rng = np.random.default_rng(0)
    return Trajectories(observations=rng.normal(size=(n, obs_dim)), actions=rng.uniform(-1, 1, (n, act_dim)),
                        rewards=np.ones(n), starts=np.cumsum([0, *lengths[:-1]]), lengths=lengths,
                        terminal=np.ones(len(lengths), bool))


def test_lanes_walk_every_episode_chunk_after_chunk_and_resume_where_they_were():
    ds = small_trajectories([7, 3, 12, 5])
    seg = SegmentSampler(ds, K=4, batch_size=3, seed=0)
    lanes = EpisodeChunks.of(seg, ds.starts, ds.lengths)
    seen = {lane: [] for lane in range(3)}
    for _ in range(12):
        idx, mask, fresh = lanes.indices()
        for lane in range(3):
            real = idx[lane][mask[lane]]
            if fresh[lane]:
                seen[lane].append([])
                assert real[0] in ds.starts  # a lane restarts only at an episode's first step
            else:
                assert real[0] == seen[lane][-1][-1] + 1  # and otherwise goes on where it stopped
            seen[lane][-1].extend(real.tolist())
    for walks in seen.values():
        for walk in walks[:-1]:  # every finished walk is one whole episode, in order
            e = int(np.searchsorted(ds.starts, walk[0]))
            assert walk == list(range(ds.starts[e], ds.starts[e] + ds.lengths[e]))
    saved = lanes.state_dict()
    ahead = [lanes.indices() for _ in range(5)]
    again = EpisodeChunks.of(SegmentSampler(ds, K=4, batch_size=3, seed=99), ds.starts, ds.lengths)
    again.load_state_dict(saved)
    for want in ahead:
        for x, y in zip(want, again.indices()):
            np.testing.assert_array_equal(x, y)
    with pytest.raises(ValueError, match="no lanes for 3 episode chunks: it was not written by a run with "
                                         "whole_episodes=true"):
        again.load_state_dict(seg.state_dict())


def test_a_whole_episode_run_trains_validates_and_resumes_exactly(hopper_file, tmp_path, capsys):
    opts = ("model=primalformer-dt", "whole_episodes=true", "val_fraction=0.2", *QUIET)
    run = training.prepare(train_config.build(args(hopper_file, tmp_path / "probe", *opts)))
    b = run.sampler.batch(run.sampler.indices()[0])
    assert b.state is not None and (b.timesteps[:, 0] == 0).all()  # every lane begins an episode
    assert run.validation.whole_episodes and run.validation.episodes > 0
    straight = dt_checkpoint.load(train(args(hopper_file, tmp_path / "straight", *opts, "steps=4"))["run_dir"])
    first = train(args(hopper_file, tmp_path / "split", *opts, "steps=2"))["run_dir"]
    carried = torch.load(Path(first) / "last.pt", weights_only=True)["rng"][0]["sampler"]["carried"]
    assert carried and any(t.abs().sum() > 0 for t in carried)  # the lanes' state, saved with the checkpoint
    resumed = dt_checkpoint.load(train([*TINY, f"resume={first}", "steps=4"])["run_dir"])
    assert all(torch.equal(resumed.model[k], straight.model[k]) for k in straight.model)
    assert straight.fidelity("stream").exact and straight.fidelity("stream").note() is None
    assert not straight.fidelity("recompute").exact  # K steps from nothing: not what such a run trained
    assert "engine=stream is (exact" in straight.fidelity("recompute").note()
    out = capsys.readouterr().out
    assert "validation action MSE" in out and " chunks)" in out


def test_a_whole_episode_run_is_evaluated_by_the_stream_unless_told_otherwise(hopper_file, tmp_path, capsys):
    from eval import rollout

    built = train_config.build(args(hopper_file, tmp_path, "whole_episodes=true"))
    assert built.cfg.eval.engine == "stream" and built.provenance["eval.engine"] == "whole_episodes=true"
    told = train_config.build(args(hopper_file, tmp_path, "whole_episodes=true", "eval.engine=recompute"))
    assert told.cfg.eval.engine == "recompute"
    assert train_config.build(args(hopper_file, tmp_path)).cfg.eval.engine == "recompute"
    run = train(args(hopper_file, tmp_path / "run", "model=primalformer-dt", "whole_episodes=true", "steps=2",
                     *QUIET))["run_dir"]
    common = [f"checkpoint={run}", "episodes=1", "max_steps=5", "num_envs=1", "progress=false"]
    report = rollout.main(common)
    assert report["engine"] == "stream" and report["exact"] and report["whole_episodes"]
    assert "engine=stream: checkpoint" in capsys.readouterr().out
    compared = rollout.main([*common, "engine=recompute"])
    assert compared["engine"] == "recompute" and not compared["exact"]
    assert "engine=stream is (exact" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (("model=primalformer-dt", "stream_window=4"), "whole_episodes=true is the third way to an exact stream: use it "
                                                   "without stream_window and from_start"),
    (("model=primalformer-dt", "from_start=true", "K=40", "max_timestep=40"), "the third way to an exact stream"),
])
def test_whole_episodes_refuses_what_cannot_carry_a_state(hopper_file, tmp_path, extra, message):
    with pytest.raises((SetupError, ValueError), match=message):
        training.prepare(train_config.build(args(hopper_file, tmp_path, "whole_episodes=true", *extra, *QUIET)))


def carried_steps(layout: str, mode: str, n: int = 6, backend: str = "eager", device: str = "cpu"):
    """(losses, final weights, final carried state) of ``n`` steps on episode chunks whose lanes carry their state,
    in the step form ``mode``: episodes of 13, 7, 22 and 9 steps, K = 5, so lanes go on, restart and pad."""
    torch.manual_seed(0)
    cfg = DTConfig(state_dim=3, act_dim=2, K=5, d_model=16, n_heads=2, n_layers=2, name=layout, s=4, dropout=0.0)
    model = DecisionTransformer(cfg).train().to(device)
    ds = small_trajectories([13, 7, 22, 9])
    chunks = EpisodeChunks.of(SegmentSampler(ds, K=5, batch_size=3, seed=0, device=device), ds.starts, ds.lengths)
    lanes = Carry(model, chunks, device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-4, fused=mode != "eager")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    kw = {"backend": backend} if mode == "compile" else {}
    stepper = train_step.Stepper(mode, model, params, opt, sched, eta=0.05, grad_clip=0.25, **kw)
    losses = []
    for _ in range(n):
        loss, _, parts = stepper.step(lanes.batch(lanes.indices()[0]))
        lanes.carry(parts.pop("state"))
        losses.append(float(loss))
    return losses, [p.detach().clone() for p in params], lanes.state


@pytest.mark.parametrize("layout", ["primalformer-dt", "primal+dt", "dt"])
def test_the_compiled_step_carries_the_state_as_the_eager_step_does(layout):
    """Six steps over chunks that go on, restart and pad: the compiled step (torch.compile's cheapest backend; the
    form's own logic) gives the eager step's losses, weights and carried state to float rounding."""
    eager, compiled = carried_steps(layout, "eager"), carried_steps(layout, "compile")
    assert compiled[0] == pytest.approx(eager[0], rel=1e-5)
    for x, y in [*zip(eager[1], compiled[1]), *zip(eager[2], compiled[2])]:
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    assert any(t.abs().sum() > 0 for t in eager[2])  # (a state was carried)


def test_a_whole_episode_run_trains_in_the_compiled_step(monkeypatch, hopper_file, tmp_path, capsys):
    """compile=compile with whole_episodes=true: the compile check passes on carried chunks and the run trains as the
    eager run (the compiled forms by aot_eager here, the test hook: inductor is the slow tests')."""
    monkeypatch.setattr(compile_check, "STEPPER", Cheap)
    monkeypatch.setattr(train_step, "Stepper", Cheap)
    opts = ("model=primal+dt", "whole_episodes=true", "steps=6", *QUIET)
    compiled = train(args(hopper_file, tmp_path / "compiled", *opts, "compile=compile"))
    assert "compile=compile agrees with the eager step over 5 steps" in capsys.readouterr().out
    eager = train(args(hopper_file, tmp_path / "eager", *opts, "compile=eager"))
    a, b = (dt_checkpoint.load(s["run_dir"]) for s in (compiled, eager))
    for k in b.model:
        torch.testing.assert_close(a.model[k], b.model[k], rtol=1e-4, atol=1e-6)
    assert a.fidelity("stream").exact
