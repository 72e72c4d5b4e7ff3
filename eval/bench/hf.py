"""HuggingFace's Decision Transformer (``transformers.DecisionTransformerModel``, the ``bench`` extra) at our
model's size: the baseline both benchmarks time, the training step (``eval.bench.train``) and acting
(``eval.bench.inference``), configured in one place so the two compare the same network."""

from __future__ import annotations

from primal_dt.run import errors


def hf_config(cfg: dict, K: int, dropout: float):
    """transformers' DecisionTransformerConfig at our size (``cfg``: state_dim, act_dim, d_model, n_heads,
    n_layers; ReLU MLP 4x as our blocks), or a SetupError saying how to install it."""
    try:
        from transformers import DecisionTransformerConfig
        from transformers.utils import logging
    except ImportError as err:
        raise errors.SetupError("the HuggingFace baseline needs `transformers` (a benchmark-only extra): pip install "
                                "'primal-dt[bench]' (keeps torch as it is), or leave HuggingFace out") from err
    logging.set_verbosity_error()
    d = cfg["d_model"]
    return DecisionTransformerConfig(state_dim=cfg["state_dim"], act_dim=cfg["act_dim"], hidden_size=d,
                                     n_layer=cfg["n_layers"], n_head=cfg["n_heads"], n_inner=4 * d,
                                     activation_function="relu", max_ep_len=1000, n_positions=3 * K,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, action_tanh=True)
