"""Names, simulators and scores: the registry against Gymnasium and the D4RL convention."""

import re
from pathlib import Path

import numpy as np
import pytest

from envs import get_spec, list_names, normalized_score
from envs.vector import make_sim


def test_all_names_exist_with_their_simulators():
    names = list_names()
    assert len(names) == 20
    for fam in ("hopper", "halfcheetah", "walker2d", "ant"):
        for lv in ("random", "medium", "medium-replay", "medium-expert", "expert"):
            spec = get_spec(f"{fam}-{lv}")
            assert spec.family == fam and spec.level == lv and spec.gym_id.endswith("-v4")
            assert spec.minari_gym_id.endswith("-v5") and spec.max_episode_steps == 1000
    s = get_spec("hopper-medium")
    assert (s.gym_id, s.minari_ids, s.obs_dim, s.act_dim) == ("Hopper-v4", ("mujoco/hopper/medium-v0",), 11, 3)
    assert s.targets == (3600.0, 1800.0) and s.d4rl_file == "hopper_medium-v2.hdf5"
    assert get_spec("walker2d-medium-replay").d4rl_file == "walker2d_medium_replay-v2.hdf5"
    assert get_spec("hopper-medium-replay").minari_ids == ()
    assert get_spec("hopper-medium-expert").minari_ids == ("mujoco/hopper/medium-v0", "mujoco/hopper/expert-v0")
    assert get_spec("Hopper_Medium-v2").name == "hopper-medium"  # D4RL spelling accepted


@pytest.mark.parametrize("family", ["hopper", "halfcheetah", "walker2d", "ant"])
def test_dims_match_gymnasium(family):
    spec = get_spec(f"{family}-medium")
    for gym_id, obs_dim in ((spec.gym_id, spec.obs_dim), (spec.minari_gym_id, spec.minari_obs_dim)):
        env = make_sim(gym_id)
        assert env.observation_space.shape == (obs_dim,), gym_id
        assert env.action_space.shape == (spec.act_dim,), gym_id
        assert env.spec.max_episode_steps == spec.max_episode_steps
        env.close()


def test_unknown_name_lists_valid_ones_and_suggests():
    with pytest.raises(KeyError) as e:
        get_spec("hoper-medum")
    msg = str(e.value)
    assert "Did you mean 'hopper-medium'" in msg and "walker2d-expert" in msg
    with pytest.raises(KeyError, match="Valid names"):
        get_spec("cartpole-medium")


def test_normalized_score_d4rl_convention():
    assert normalized_score("hopper-medium", 3234.3) == pytest.approx(100.0)
    assert normalized_score("hopper-medium", -20.272305) == pytest.approx(0.0)
    # halfway between random and expert
    mid = (-280.178953 + 12135.0) / 2
    assert normalized_score("halfcheetah-medium", mid) == pytest.approx(50.0)
    out = normalized_score("walker2d-medium", np.array([1.629008, 4592.3]))
    assert isinstance(out, np.ndarray) and np.allclose(out, [0.0, 100.0])
    assert isinstance(normalized_score("ant-medium", 100.0), float)


def test_family_of_reads_every_spelling_files_record():
    from envs.registry import family_of

    for text, family in (("Hopper-v4", "hopper"), ("hopper-medium-v2", "hopper"), ("mujoco/walker2d/expert-v0", "walker2d"),
                         ("HalfCheetah-v5", "halfcheetah"), ("half_cheetah", "halfcheetah"), ("Ant-v4", "ant"),
                         ("primal-dt/ant/medium-v0", "ant"), ("antmaze-umaze-v2", None), ("Humanoid-v4", None)):
        assert family_of(text) == family, text


def test_the_docs_table_of_reference_returns_is_the_registrys():
    """docs/data.md states what every score is normalized with; it must be what the code uses."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    rows = re.findall(r"^\| (\w+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) \| (\S+) / (\S+) \|$", text, flags=re.M)
    assert [r[0] for r in rows] == ["hopper", "halfcheetah", "walker2d", "ant"]
    for family, gym_id, low, high, minari_gym_id, t1, t2 in rows:
        for level in ("medium", "medium-replay", "medium-expert"):
            spec = get_spec(f"{family}-{level}")
            assert (spec.gym_id, spec.minari_gym_id, spec.targets) == (gym_id, minari_gym_id, (float(t1), float(t2)))
            assert (spec.ref_min, spec.ref_max) == (float(low), float(high))
