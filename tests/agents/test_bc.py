"""model=bc, the Decision Transformer paper's transformer behaviour-cloning baseline: tokens (s_t, a_t), a_t
predicted from s_t, no return-to-go. It trains, acts by both engines and exports like every model, through
the same code (its token layout is one entry of agents.token_layouts.TOKEN_LAYOUTS)."""

import pytest
import torch

from agents.decision_transformer import TOKEN_LAYOUTS, Batch, softmax_stream_window


def segment(B=2, T=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randn(B, T, 11, generator=g), torch.rand(B, T, 3, generator=g) * 2 - 1,
                 torch.randn(B, T, 1, generator=g), torch.arange(T).expand(B, T))


def test_bc_reads_states_and_earlier_actions_only(tiny_dt):
    m = tiny_dt("bc", K=4)
    assert m.tokens == TOKEN_LAYOUTS["bc"] and m.tokens.kinds == ("state", "action")
    assert m.layer_names == ["softmax"] * 3 and not hasattr(m, "embed_return")
    assert softmax_stream_window(m) == 2 * 4 - 1  # s, a of the K - 1 previous steps, then s_t
    b = segment()
    assert m.embed(b).shape == (2, 8, 32)
    with torch.no_grad():
        pred = m(b)[0]
        torch.testing.assert_close(m(b._replace(rtg=b.rtg * 100 + 5))[0], pred, atol=0, rtol=0)  # no return token
        later = b.actions.clone()
        later[:, 2:] += 1.0
        moved = m(b._replace(actions=later))[0]
        states = b.states.clone()
        states[:, 2] += 1.0
        seen = m(b._replace(states=states))[0]
    torch.testing.assert_close(moved[:, :3], pred[:, :3], atol=1e-6, rtol=0)  # a_t is not seen at t
    assert not torch.allclose(moved[:, 3], pred[:, 3])  # a_2 is seen at step 3
    torch.testing.assert_close(seen[:, :2], pred[:, :2], atol=1e-6, rtol=0)
    assert not torch.allclose(seen[:, 2], pred[:, 2])  # s_t predicts a_t


def test_primal_plus_bc_keeps_the_bc_tokens(tiny_dt):
    m = tiny_dt("primal+bc", K=4)
    assert m.tokens == TOKEN_LAYOUTS["bc"] and m.layer_names == ["softmax", "softmax", "primal"]


def test_bc_streams_its_forward_and_recomputes_the_last_K_steps_with_per_row_restarts(tiny_dt, engines_agree):
    """The stream is the streamed-equivalent model's forward over each row's episode so far (row 1
    restarts at step 6); recompute with context K shows the first K steps the same tokens."""
    engines_agree(tiny_dt("bc", K=4),
                  lambda S, A, r: Batch(S, A, torch.zeros(1, S.shape[1], 1), torch.arange(S.shape[1])[None]))


def test_bc_exports_and_the_graph_acts_as_the_stream_agent(tiny_dt, export_agrees, tmp_path):
    from agents.export import read_metadata

    _, path = export_agrees(tiny_dt("bc", K=4, n_layers=2), tmp_path)
    assert "the chunk (a_{t-1}, s_t)" in read_metadata(path)["semantics"]


@pytest.mark.parametrize("engine", ["recompute", "stream"])
def test_bc_trains_and_evaluates_in_the_simulator(engine, hopper_file, tmp_path, tiny_train):
    from primal_dt.train import run

    s = run(tiny_train.args(hopper_file, tmp_path, "model=bc", "steps=2", "eval.every=0", "eval.final_episodes=1",
                            "eval.max_steps=5", "eval.num_envs=1", f"eval.engine={engine}"))
    assert s["final"]["target3600"]["episodes"] == 1  # (the target is bookkeeping only: bc does not read it)
