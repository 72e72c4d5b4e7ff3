"""Stream-exact training: on a model with every layer windowed, the stream agent in a real Hopper
simulator reproduces ``model.forward`` over the whole episode, and the loss mask keeps exactly the
segment steps whose predictions equal the whole-episode (= streamed) ones."""

import dataclasses

import gymnasium as gym
import numpy as np
import pytest
import torch

from agents import Agent, DataInfo, DTConfig
from agents.decision_transformer import Batch
from agents.stream_training import first_exact_step, receptive_field, stream_exact_batch, stream_exact_config

W = 9  # tokens per window: 3 layers reach R = 3 * 8 = 24 tokens back


def windowed_model(tiny_dt, layout="primal+dt"):
    cfg = stream_exact_config(tiny_dt(layout).cfg, window=W)
    torch.manual_seed(0)
    from agents import DecisionTransformer

    return DecisionTransformer(cfg).eval()


def simulate(agent, T, seed=3):
    env = gym.make("Hopper-v4", terminate_when_unhealthy=False)  # a random model falls; keep simulating
    obs, _ = env.reset(seed=seed)
    agent.reset(1)
    rec = {"obs": [], "act": [], "rew": []}
    reward = None
    for _ in range(T):
        a = agent.act(obs[None], reward)[0]
        rec["obs"].append(obs), rec["act"].append(a)
        obs, r, term, trunc, _ = env.step(a)
        rec["rew"].append(r)
        reward = np.array([r], np.float32)
        if term or trunc:
            break
    env.close()
    return {k: np.asarray(v) for k, v in rec.items()}


def episode_tensors(rec, mean, std, target=3600.0, scale=1000.0):
    T = len(rec["act"])
    S = torch.as_tensor((rec["obs"] - mean) / std, dtype=torch.float32)[None]
    rtg = (target - np.concatenate([[0.0], np.cumsum(rec["rew"][:-1])])) / scale
    return (S, torch.as_tensor(rec["act"], dtype=torch.float32)[None],
            torch.as_tensor(rtg, dtype=torch.float32)[None, :, None], torch.arange(T)[None])


@pytest.mark.parametrize("layout", ["primal+dt", "dt", "primalformer-dt"])
def test_stream_agent_in_hopper_equals_forward_over_the_whole_episode(layout, tiny_dt, hopper_stats):
    m = windowed_model(tiny_dt, layout)
    mean, std = hopper_stats
    ag = Agent(m, DataInfo("hopper-medium", mean, std, reward_scale=1000.0, targets=(3600.0,)), engine="stream")
    rec = simulate(ag, T=60)
    T = len(rec["act"])
    assert T == 60  # 180 tokens: the windows (reach 24 tokens) slid far past the episode start
    S, A, R, Tt = episode_tensors(rec, mean, std)
    with torch.no_grad():
        pred, _ = m(Batch(S, A, R, Tt))
    np.testing.assert_allclose(rec["act"], pred[0].numpy(), atol=1e-5, rtol=0)


def test_loss_mask_keeps_exactly_the_steps_that_match_the_stream(tiny_dt):
    m = windowed_model(tiny_dt)
    reach = receptive_field(m)
    assert reach == 3 * (W - 1)
    first = first_exact_step(m)
    assert 3 * first + 1 >= reach > 3 * (first - 1) + 1
    K = first + 4  # 4 counted steps in a segment away from its episode's start
    g = torch.Generator().manual_seed(0)
    T = 40
    S, A = torch.randn(1, T, 11, generator=g), torch.rand(1, T, 3, generator=g) * 2 - 1
    R = torch.randn(1, T, 1, generator=g)
    Tt = torch.arange(T)[None]
    with torch.no_grad():
        full, _ = m(Batch(S, A, R, Tt))
        starts = [0, 5, 17, T - K]
        segs = [m(Batch(S[:, s:s + K], A[:, s:s + K], R[:, s:s + K], Tt[:, s:s + K]))[0] for s in starts]
    mask = torch.ones(len(starts), K, dtype=torch.bool)
    mask[-1, K - 2:] = False  # a padded tail stays excluded
    timesteps = torch.cat([Tt[:, s:s + K] for s in starts])
    loss_mask = stream_exact_batch(Batch(None, None, None, timesteps, mask), first).loss_mask
    assert loss_mask[0].all()  # the episode start: every step counts
    assert loss_mask[1].tolist() == [i >= first for i in range(K)]
    assert not loss_mask[-1, K - 2:].any()
    for row, (s, seg) in enumerate(zip(starts, segs)):
        for i in range(K):
            same = torch.allclose(seg[0, i], full[0, s + i], atol=1e-5, rtol=0)
            if loss_mask[row, i]:
                assert same, (s, i)
        if s > 0:  # the mask is not vacuous: excluded steps do differ from the stream's predictions
            assert not torch.allclose(seg[0, :first], full[0, s:s + first], atol=1e-5, rtol=0)


def test_stream_exact_config_refuses_layers_without_a_window():
    cfg = DTConfig(state_dim=11, act_dim=3, K=5, d_model=32, n_heads=2, layers="softmax,linear,primal", s=8,
                   dropout=0.0)
    with pytest.raises(ValueError, match=r"layer 1 \(linear\) has no window"):
        stream_exact_config(cfg, 9)
    with pytest.raises(ValueError, match="window must be an integer"):
        stream_exact_config(cfg, 0)


# -- which steps the loss counts (stream_counts): the protocol's, each with its whole reach ---------------------
def test_lead_segments_predict_their_counted_steps_as_the_whole_episode_does(tiny_dt, hopper_file):
    """Segments the sampler draws with ``lead`` = the first exact step, at every step of real Hopper episodes: each
    counted prediction equals the forward over its whole episode (what the stream computes, test above), and the
    counted steps are those of a standard (K - lead)-step segment drawn there."""
    from envs import SegmentSampler
    from envs.d4rl import read_d4rl

    m = windowed_model(tiny_dt)
    lead = first_exact_step(m)
    K = lead + 3
    ds = read_d4rl(hopper_file, "hopper-medium", "Hopper-v4", verbose=False)
    T = int(ds.lengths.max())
    whole = SegmentSampler(ds, K=T, batch_size=1, seed=None, reward_scale=1000.0, max_timestep=1000)
    led = SegmentSampler(ds, K=K, batch_size=1, seed=None, reward_scale=1000.0, max_timestep=1000, lead=lead)
    first = np.arange(ds.num_steps)
    idx, counted = led.indices(first=first)
    assert counted.sum() == SegmentSampler(ds, K=K - lead, batch_size=1, seed=None).indices(first=first)[1].sum()
    with torch.no_grad():
        full, _ = m(whole.segments(ds.starts))  # each episode from its first step
        seg, _ = m(led.segments(first))
    row_of = {int(r): (e, int(r - s)) for e, s in enumerate(ds.starts) for r in range(s, s + ds.lengths[e])}
    checked = 0
    for i, j in zip(*np.nonzero(counted)):
        e, t = row_of[int(idx[i, j])]
        torch.testing.assert_close(seg[i, j], full[e, t], atol=1e-5, rtol=0)
        checked += 1
    assert checked == counted.sum() > 0
    context = (idx < ds.num_steps) & ~counted  # the steps before the drawn one: seen, not counted, and not exact
    i, j = next((i, j) for i, j in zip(*np.nonzero(context)) if ds.timesteps[idx[i, 0]] > 0 and j == 0)
    e, t = row_of[int(idx[i, j])]
    assert not torch.allclose(seg[i, j], full[e, t], atol=1e-5, rtol=0)


def test_a_stream_window_run_counts_the_protocols_steps_and_validates_as_the_protocol(hopper_file, tmp_path):
    from agents import train_config, training
    from primal_dt.run.errors import SetupError

    base = ["preset=smoke", "progress=false", "model.d_model=32", "model.n_heads=2", "model.n_layers=3", "model.s=8",
            "batch_size=8", "threads=1", "tensorboard=false", "eval.every=0", "eval.final_episodes=0",
            "val_fraction=0.2", f"data_source=d4rl:{hopper_file}"]
    run = training.prepare(train_config.build([*base, "stream_window=4", "K=8", f"out={tmp_path / 'w'}"]))
    lead = first_exact_step(run.model)
    assert run.cfg.stream_counts == "protocol" and run.sampler.lead == lead > 0 and run.exact_from is None
    assert (f"each 8-step segment starts {lead} steps before its drawn step (or at its episode's first) and counts "
            f"the {8 - lead} from it, the steps a standard run of K={8 - lead} counts") in training.announcement(run)
    batch, real = training.next_batch(run)
    assert batch.loss_mask is not None and (batch.loss_mask.sum(1) <= 8 - lead).all() and real > batch.loss_mask.sum()
    standard = training.prepare(train_config.build([*base, f"K={8 - lead}", f"out={tmp_path / 's'}"]))
    assert run.validation.counted == standard.validation.counted  # the same held-out steps: the curves compare
    tail = training.prepare(train_config.build([*base, "stream_window=4", "K=8", "stream_counts=tail",
                                                f"out={tmp_path / 't'}"]))
    assert tail.sampler.lead == 0 and tail.exact_from == lead and "(stream_counts=tail)" in training.announcement(tail)
    assert "stream-exact" not in training.announcement(standard)
    assert tail.validation.counted < run.validation.counted  # tails leave an episode's first steps out
    with pytest.raises(SetupError, match="stream_counts=tail says which steps a windowed run counts"):
        training.prepare(train_config.build([*base, "stream_counts=tail", f"out={tmp_path / 'x'}"]))
    # a checkpoint's config from before the option counted tails, and resumes so
    old = {k: v for k, v in dataclasses.asdict(run.cfg).items() if k != "stream_counts"}
    assert train_config.from_dict(old).stream_counts == "tail"
    assert train_config.from_dict({**old, "stream_window": 0}).stream_counts == "protocol"
