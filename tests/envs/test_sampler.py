"""Segment sampling against hand-computed segments of a 5-step, 2-episode dataset; filtered sampling (the best
episodes by return) on the replicas shipped with the package."""

from pathlib import Path

import numpy as np
import pytest
import torch

from envs import SegmentSampler, Trajectories
from envs.d4rl import read_d4rl
from envs.sampler import Batch


@pytest.fixture
def tiny():
    # episode A: 3 steps, rewards 1,2,3 (terminal); episode B: 2 steps, rewards 4,5 (time limit)
    obs = np.array([[0.0, 10], [1, 20], [2, 30], [3, 40], [4, 50]])
    return Trajectories(observations=obs, actions=np.arange(5, dtype=float)[:, None] * [1, -1],
                        rewards=[1, 2, 3, 4, 5], starts=[0, 3], lengths=[3, 2], terminal=[True, False])


# Every segment the sampler can produce with K=4, by its first step (hand-computed):
# rtg of A = 6,5,3 ; of B = 9,5 ; right padding is zero and masked out.
EXPECTED = {
    0: dict(rows=[0, 1, 2], rtg=[6, 5, 3], ts=[0, 1, 2]),
    1: dict(rows=[1, 2], rtg=[5, 3], ts=[1, 2]),
    2: dict(rows=[2], rtg=[3], ts=[2]),
    3: dict(rows=[3, 4], rtg=[9, 5], ts=[0, 1]),
    4: dict(rows=[4], rtg=[5], ts=[1]),
}


def _expected_row(ds, first, K=4, scale=2.0):
    e = EXPECTED[first]
    n = len(e["rows"])
    states = np.zeros((K, 2), np.float32)
    states[:n] = (ds.observations[e["rows"]] - ds.state_mean) / ds.state_std
    actions = np.zeros((K, 2), np.float32)
    actions[:n] = ds.actions[e["rows"]]
    pad = lambda v: np.array(list(v) + [0] * (K - n))  # noqa: E731
    return dict(states=states, actions=actions, rewards=pad(ds.rewards[e["rows"]]), rtg=pad(e["rtg"]) / scale,
                timesteps=pad(e["ts"]), mask=np.arange(K) < n)


def test_every_segment_matches_hand_computed_values(tiny):
    s = SegmentSampler(tiny, K=4, batch_size=400, reward_scale=2.0, max_timestep=1000, seed=0)
    b = s.sample()
    assert b.states.shape == (400, 4, 2) and b.actions.shape == (400, 4, 2)
    assert b.rewards.shape == (400, 4, 1) and b.rtg.shape == (400, 4, 1)
    assert b.timesteps.dtype == torch.long and b.mask.dtype == torch.bool
    assert b.states.dtype == torch.float32
    assert b.trailing is True and torch.equal(b.mask, b.mask.cummin(1).values)  # real steps first, as it says
    # the first state identifies the start: state 0 of row r is the normalized observation r
    norm = (tiny.observations - tiny.state_mean) / tiny.state_std
    seen = set()
    for i in range(400):
        first = int(np.argmin(np.abs(norm - b.states[i, 0].numpy()).sum(1)))
        seen.add(first)
        exp = _expected_row(tiny, first)
        np.testing.assert_allclose(b.states[i].numpy(), exp["states"], atol=1e-6)
        np.testing.assert_array_equal(b.actions[i].numpy(), exp["actions"])
        np.testing.assert_array_equal(b.rewards[i, :, 0].numpy(), exp["rewards"])
        np.testing.assert_allclose(b.rtg[i, :, 0].numpy(), exp["rtg"])
        np.testing.assert_array_equal(b.timesteps[i].numpy(), exp["timesteps"])
        np.testing.assert_array_equal(b.mask[i].numpy(), exp["mask"])
    assert seen == {0, 1, 2, 3, 4}


def test_trajectory_probability_is_proportional_to_length(tiny):
    s = SegmentSampler(tiny, K=2, batch_size=50_000, seed=1)
    idx, mask = s.indices()
    first = idx[:, 0]
    # episode A (3 steps) 3/5 of the time, each start within it uniform: 1/5 per step
    assert abs(np.mean(first < 3) - 0.6) < 0.01
    assert np.allclose(np.bincount(first, minlength=5) / len(first), 0.2, atol=0.01)
    assert mask[:, 0].all() and (mask[:, 1] == np.isin(first, [0, 1, 3])).all()


def test_from_start_draws_whole_episode_prefixes_one_episode_as_likely_as_another(tiny):
    s = SegmentSampler(tiny, K=4, batch_size=20_000, reward_scale=2.0, seed=2, from_start=True)
    b = s.sample()
    first = b.timesteps[:, 0].numpy()
    assert (first == 0).all()  # every segment is its episode's beginning
    a = b.rtg[:, 0, 0].numpy() == 3.0  # episode A's return-to-go at its start is 6 / 2
    assert abs(a.mean() - 0.5) < 0.02  # by episode, not by length (A is 3 steps, B 2)
    for i in (int(np.argmax(a)), int(np.argmin(a))):
        exp = _expected_row(tiny, 0 if a[i] else 3)
        np.testing.assert_allclose(b.states[i].numpy(), exp["states"], atol=1e-6)
        np.testing.assert_array_equal(b.mask[i].numpy(), exp["mask"])
        np.testing.assert_array_equal(b.timesteps[i].numpy(), exp["timesteps"])
    s2 = SegmentSampler(tiny, K=4, batch_size=20_000, reward_scale=2.0, seed=2, from_start=True)
    s2.load_state_dict(s.state_dict())
    assert torch.equal(s.sample().states, s2.sample().states)  # resume draws the same prefixes


def test_real_tokens_first_then_padding(tiny):
    b = SegmentSampler(tiny, K=4, batch_size=256, seed=2).sample()
    m = b.mask.numpy()
    assert (np.diff(m.astype(int), axis=1) <= 0).all()  # never False then True
    assert (b.states.numpy()[~m] == 0).all() and (b.rtg.numpy()[~m] == 0).all()


def test_timesteps_clipped_to_episode_limit(tiny):
    b = SegmentSampler(tiny, K=3, batch_size=256, max_timestep=2, seed=3).sample()
    ts = b.timesteps.numpy()
    assert ts.max() == 1  # timestep 2 clipped to max_timestep - 1
    assert set(np.unique(ts)) <= {0, 1}


def test_state_dict_makes_resume_exact(tiny):
    a = SegmentSampler(tiny, K=3, batch_size=8, seed=4)
    a.sample()
    state = a.state_dict()
    ref = [a.sample() for _ in range(3)]
    b = SegmentSampler(tiny, K=3, batch_size=8, seed=999)
    b.load_state_dict(state)
    for r in ref:
        got = b.sample()
        for x, y in zip(r, got):
            assert x is y or torch.equal(x, y)


def test_accepts_a_generator_and_custom_batch(tiny):
    g = np.random.default_rng(5)
    s = SegmentSampler(tiny, K=2, batch_size=4, seed=g)
    assert s.rng is g and s.sample(batch_size=7).mask.shape == (7, 2)
    with pytest.raises(ValueError):
        SegmentSampler(tiny, K=0)


def test_reward_scale_divides_and_defaults_to_raw_returns(tiny):
    """One meaning everywhere: returns-to-go are divided by reward_scale (the DT papers' 1000)."""
    raw = SegmentSampler(tiny, K=4, batch_size=64, seed=6).sample()
    scaled = SegmentSampler(tiny, K=4, batch_size=64, reward_scale=1000.0, seed=6).sample()
    assert torch.equal(raw.states, scaled.states)  # same seed: same segments
    raw_rtgs = {float(g) for e in EXPECTED.values() for g in e["rtg"]}  # hand-computed, unscaled
    assert set(raw.rtg[:, :, 0][raw.mask].tolist()) == raw_rtgs
    torch.testing.assert_close(scaled.rtg, raw.rtg / 1000.0)
    assert scaled.rtg.abs().max() < 0.01
    for bad in (0.0, -1000.0):
        with pytest.raises(ValueError, match="reward_scale must be > 0"):
            SegmentSampler(tiny, reward_scale=bad)


def test_random_dataset_against_a_naive_per_segment_computation():
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 30, size=40)
    n = int(lengths.sum())
    ds = Trajectories(observations=rng.standard_normal((n, 3)), actions=rng.standard_normal((n, 2)),
                      rewards=rng.standard_normal(n), starts=np.concatenate([[0], np.cumsum(lengths)[:-1]]),
                      lengths=lengths, terminal=rng.random(40) < 0.5)
    K, scale, max_t = 8, 100.0, 20
    s = SegmentSampler(ds, K=K, batch_size=300, reward_scale=scale, max_timestep=max_t, seed=8)
    state = s.state_dict()
    first = s.indices()[0][:, 0]
    s.load_state_dict(state)
    b = Batch(*(v.numpy() if isinstance(v, torch.Tensor) else v for v in s.sample()))
    for row, f in enumerate(first.tolist()):
        e = int(np.searchsorted(ds.starts, f, side="right") - 1)
        st, ln = int(ds.starts[e]), int(ds.lengths[e])
        rew = ds.rewards[st:st + ln].astype(np.float64)
        si = f - st
        m = min(K, ln - si)
        rtg = np.array([rew[t:].sum() for t in range(si, si + m)])  # naive suffix sums
        np.testing.assert_allclose(b.rtg[row, :m, 0], rtg / scale, rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(b.timesteps[row, :m], np.minimum(np.arange(si, si + m), max_t - 1))
        np.testing.assert_array_equal(b.actions[row, :m], ds.actions[f:f + m])
        np.testing.assert_allclose(b.states[row, :m], (ds.observations[f:f + m] - ds.state_mean) / ds.state_std,
                                   rtol=1e-5, atol=1e-6)
        assert b.mask[row].tolist() == [True] * m + [False] * (K - m)
        assert (b.states[row, m:] == 0).all() and (b.actions[row, m:] == 0).all()


def test_fixed_segments_and_foreign_statistics_give_the_sampled_batches(tiny):
    """``segments(first)`` is the batch ``sample`` draws for those starts; ``stats`` normalises with
    other statistics (held-out episodes read with the training episodes')."""
    s = SegmentSampler(tiny, K=4, batch_size=50, reward_scale=2.0, seed=3)
    state = s.state_dict()
    first = s.indices()[0][:, 0]
    s.load_state_dict(state)
    drawn, fixed = s.sample(), s.segments(first)
    assert all(x is y or torch.equal(x, y) for x, y in zip(drawn, fixed))
    mean, std = np.array([1.0, -2.0], np.float32), np.array([0.5, 4.0], np.float32)
    other = SegmentSampler(tiny, K=4, batch_size=50, reward_scale=2.0, seed=None, stats=(mean, std))
    b = other.segments(np.arange(5))
    for f in range(5):
        exp = _expected_row(tiny, f)
        n = int(exp["mask"].sum())
        np.testing.assert_allclose(b.states[f, :n].numpy(), (tiny.observations[EXPECTED[f]["rows"]] - mean) / std,
                                   rtol=1e-6)
        np.testing.assert_array_equal(b.actions[f].numpy(), exp["actions"])
        np.testing.assert_allclose(b.rtg[f, :, 0].numpy(), exp["rtg"])


# -- filtered behaviour cloning: the best fraction of episodes, on the replicas shipped with the package ---------
REPLICAS = Path(__file__).resolve().parents[2] / "envs" / "replicas"


@pytest.mark.parametrize("name", ["hopper-medium", "hopper-medium-replay"])
@pytest.mark.parametrize("from_start", [False, True])
def test_top_fraction_draws_only_from_the_episodes_of_highest_return(name, from_start):
    ds = read_d4rl(REPLICAS / f"{name.replace('-', '_')}-replica.hdf5", name, "Hopper-v4", verbose=False)
    s = SegmentSampler(ds, K=5, batch_size=4096, seed=1, from_start=from_start, top_fraction=0.1)
    kept = np.sort(np.argsort(-ds.returns)[:len(ds) // 10])  # the 10 % best, worked out here from the returns
    np.testing.assert_array_equal(s.episodes, kept)
    episode_of_step = np.repeat(np.arange(len(ds)), ds.lengths)
    drawn = np.unique(episode_of_step[s.indices()[0][:, 0]])
    assert set(drawn) <= set(kept) and len(drawn) > 0.9 * len(kept)  # every draw from them, (nearly) each of them
    assert ds.returns[drawn].min() >= np.delete(ds.returns, kept).max()
    if from_start:
        assert set(s.indices()[0][:, 0]) <= set(ds.starts[kept])


def test_top_fraction_keeps_statistics_and_every_draw_of_the_unfiltered_sampler(tiny):
    """fraction 1 is the sampler as it always was (the same random draws); a filtered one normalises alike."""
    whole, rng = SegmentSampler(tiny, K=2, batch_size=16, seed=3), np.random.default_rng(3)
    np.testing.assert_array_equal(whole.indices()[0][:, 0], rng.integers(0, tiny.num_steps, size=16))
    best = SegmentSampler(tiny, K=2, batch_size=64, seed=3, top_fraction=0.5)  # episode B: return 9 > 6
    assert best.episodes.tolist() == [1] and set(best.indices()[0][:, 0]) == {3, 4}
    torch.testing.assert_close(best.segments(np.array([3])).states, whole.segments(np.array([3])).states)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_a_top_fraction_outside_0_1_is_refused(tiny, bad):
    with pytest.raises(ValueError, match=r"top_fraction must be in \(0, 1\]"):
        SegmentSampler(tiny, top_fraction=bad)


# -- lead (stream-exact training): context before the drawn step, the protocol's steps counted -----------------
@pytest.mark.parametrize("lead,counted", [(6, 5), (20, 20)])
def test_lead_counts_the_steps_a_shorter_segment_drawn_there_counts(lead, counted):
    """Drawn at every step of a real replica, a segment of K = lead + counted steps with ``lead`` counts exactly the
    rows a segment of ``counted`` steps drawn at the same step holds (so an episode's first steps are counted as
    often as the papers' protocol counts them), and its context before them is its own episode's, ``lead`` steps
    back where the episode has them."""
    ds = read_d4rl(REPLICAS / "hopper_medium_replay-replica.hdf5", "hopper-medium-replay", "Hopper-v4", verbose=False)
    first = np.arange(ds.num_steps)
    led = SegmentSampler(ds, K=lead + counted, batch_size=1, seed=None, lead=lead)
    idx, mask = led.indices(first=first)
    short, short_mask = SegmentSampler(ds, K=counted, batch_size=1, seed=None).indices(first=first)
    rows_counted = np.where(mask, idx, -1)
    for i in (0, 1, lead - 1, lead, lead + 3, ds.starts[1] + 2, ds.num_steps - 1, *range(0, ds.num_steps, 997)):
        assert sorted(rows_counted[i][mask[i]]) == sorted(short[i][short_mask[i]]), i
    assert mask.sum() == short_mask.sum()
    np.testing.assert_array_equal(np.bincount(idx[mask], minlength=ds.num_steps),
                                  np.bincount(short[short_mask], minlength=ds.num_steps))  # the same count per step
    t = ds.timesteps[first]
    start = idx[:, 0]
    np.testing.assert_array_equal(first - start, np.minimum(t, lead))  # lead steps back, never before the episode
    np.testing.assert_array_equal(ds.timesteps[start], np.maximum(t - lead, 0))
    real = idx < ds.num_steps
    assert (real >= mask).all() and (real.sum(1) > mask.sum(1)).any()  # context is real and not counted


def test_lead_batches_carry_the_counted_steps_as_their_loss_mask(tiny):
    s = SegmentSampler(tiny, K=3, batch_size=8, seed=0, lead=1)
    idx, mask = s.indices(first=np.array([0, 1, 2, 3, 4]))
    np.testing.assert_array_equal(idx[:, 0], [0, 0, 1, 3, 3])  # one step back, never into the episode before
    np.testing.assert_array_equal(mask, [[1, 1, 0], [0, 1, 1], [0, 1, 0], [1, 1, 0], [0, 1, 0]])
    b = s.segments(np.array([0, 1, 2, 3, 4]))
    np.testing.assert_array_equal(b.loss_mask.numpy(), mask)
    np.testing.assert_array_equal(b.mask.numpy(), idx < tiny.num_steps)
    assert SegmentSampler(tiny, K=3, batch_size=8, seed=0).sample().loss_mask is None  # no lead: the real steps


@pytest.mark.parametrize("bad", [-1, 3, 2.5, True])
def test_a_lead_outside_0_to_K_minus_1_is_refused(tiny, bad):
    with pytest.raises(ValueError, match="lead must be an integer from 0 to K - 1 = 2"):
        SegmentSampler(tiny, K=3, lead=bad)
