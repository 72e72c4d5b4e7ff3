"""The recompute engine (the papers' protocol): an action is the model's prediction on the last K steps."""

import numpy as np
import torch

from agents.decision_transformer import Batch


def test_recompute_with_context_K_matches_a_forward_on_the_last_K_steps(tiny_dt, hopper_stats, make_agent,
                                                                       rollout_inputs, run_agent):
    m = tiny_dt("primal+dt", K=4)
    obs, rew = rollout_inputs(T=12, B=1)
    ag = make_agent(m, "recompute")
    ag.reset(1)
    acts = run_agent(ag, obs, rew)
    mean, std = hopper_stats
    S = torch.as_tensor((obs[:, 0] - mean) / std)[None]
    rtg = torch.as_tensor(3.6 - np.concatenate([[0], np.cumsum(rew[:-1, 0])]) / 1000.0, dtype=torch.float32)
    A = torch.as_tensor(acts[:, 0])[None]
    t = 9
    with torch.no_grad():
        w = slice(t - 3, t + 1)  # the last K = 4 steps
        pred, _ = m(Batch(S[:, w], A[:, w], rtg[None, w, None], torch.arange(t - 3, t + 1)[None]))
    np.testing.assert_allclose(acts[t, 0], pred[0, -1].numpy(), atol=1e-5, rtol=0)
