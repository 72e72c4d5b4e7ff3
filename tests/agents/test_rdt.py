"""model=rdt, the Decision Transformer that also sees each step's reward: tokens (R_t, s_t, a_t, r_t), a_t
predicted from s_t, r_t seen from the next step on. It trains, acts by both engines and exports like every
model, through the same code: its token layout is one entry of agents.token_layouts.TOKEN_LAYOUTS."""

import pytest
import torch

from agents.decision_transformer import TOKEN_LAYOUTS, Batch, softmax_stream_window
from agents.onnx_policy import OnnxPolicy


def segment(B=2, T=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randn(B, T, 11, generator=g), torch.rand(B, T, 3, generator=g) * 2 - 1,
                 torch.randn(B, T, 1, generator=g), torch.arange(T).expand(B, T),
                 rewards=torch.rand(B, T, 1, generator=g) * 3)


def test_rdt_sees_a_step_s_reward_from_the_next_step_on(tiny_dt):
    m = tiny_dt("rdt", K=4)
    assert m.tokens == TOKEN_LAYOUTS["rdt"] and m.tokens.kinds == ("rtg", "state", "action", "reward")
    assert m.layer_names == ["softmax"] * 3 and m.embed_reward.in_features == 1
    assert softmax_stream_window(m) == 4 * 3 + 2  # R, s, a, r of the K - 1 previous steps, then R_t, s_t
    b = segment()
    assert m.embed(b).shape == (2, 16, 32)
    with torch.no_grad():
        pred = m(b)[0]
        rewards = b.rewards.clone()
        rewards[:, 2] += 1.0
        moved = m(b._replace(rewards=rewards))[0]
        rtg = b.rtg.clone()
        rtg[:, 2] += 1.0
        seen = m(b._replace(rtg=rtg))[0]
    torch.testing.assert_close(moved[:, :3], pred[:, :3], atol=1e-6, rtol=0)  # r_t is not seen at t
    assert not torch.allclose(moved[:, 3], pred[:, 3])  # r_2 is seen at step 3
    torch.testing.assert_close(seen[:, :2], pred[:, :2], atol=1e-6, rtol=0)
    assert not torch.allclose(seen[:, 2], pred[:, 2])  # R_t is seen at t


@pytest.mark.parametrize("name, layers", [("primal+rdt", ["softmax", "softmax", "primal"]),
                                          ("primalformer-rdt", ["primal"] * 3)])
def test_a_stack_name_keeps_the_rdt_tokens(tiny_dt, name, layers):
    m = tiny_dt(name, K=4)
    assert m.tokens == TOKEN_LAYOUTS["rdt"] and m.layer_names == layers


@pytest.mark.parametrize("name, options", [("rdt", {}), ("primal+rdt", None),
                                           ("primalformer-rdt", {"primal": {"s": 8, "window": 6}})])
def test_rdt_streams_its_forward_and_recomputes_the_last_K_steps_with_per_row_restarts(name, options, tiny_dt,
                                                                                         engines_agree):
    """The stream is the streamed-equivalent model's forward over each row's episode so far, rewards
    included (row 1 restarts at step 6, its first reward input the old episode's: ignored); recompute with
    context K shows the first K steps the same tokens."""
    def episode(S, A, r):  # R_0 = 3600 / 1000, then each reward taken off
        R = 3.6 - torch.cat([torch.zeros(1, 1, 1), r[:, :-1].cumsum(1)], 1) / 1000
        return Batch(S, A, R, torch.arange(S.shape[1])[None], rewards=r)

    engines_agree(tiny_dt(name, K=4, options=options), episode)


def test_rdt_exports_and_the_graph_acts_as_the_stream_agent(tiny_dt, export_agrees, tmp_path, monkeypatch):
    from agents import load_agent
    from agents.export import read_metadata

    ck, path = export_agrees(tiny_dt("primal+rdt", K=4, n_layers=2), tmp_path)
    assert "the chunk (a_{t-1}, r_{t-1}, R_t, s_t)" in read_metadata(path)["semantics"]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # load_agent's export cache, kept in the test
    assert isinstance(load_agent(ck, runtime="onnx"), OnnxPolicy)  # its few steps agreed with the torch agent


@pytest.mark.parametrize("engine", ["recompute", "stream"])
def test_rdt_trains_and_evaluates_in_the_simulator(engine, hopper_file, tmp_path, tiny_train):
    from primal_dt.train import run

    s = run(tiny_train.args(hopper_file, tmp_path, "model=rdt", "steps=2", "eval.every=0", "eval.final_episodes=1",
                            "eval.max_steps=5", "eval.num_envs=1", f"eval.engine={engine}"))
    assert s["model"] == "rdt" and s["final"]["target3600"]["episodes"] == 1
