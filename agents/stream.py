"""The streaming inference engine: one Decision-Transformer action per environment step from
per-layer recurrent states, at a cost that does not grow with the episode.

Every environment step feeds ONE chunk of three tokens through the stack,

    (a_{t-1}, R_t, s_t)          (at t = 0 the action slot is padding: masked, invisible),

and only the state token s_t's top-layer output reaches the action head; at the top layer the
other two tokens only update the layer's running statistics. Rows (episodes) advance in lock
step but restart independently (``reset_rows``): each row has its own statistics, timestep and
validity flags.

What a streamed token sees, per layer kind (the *stream semantics*):

- ``primal`` without a window: the running means of q and k over every real token of the episode
  so far (O(H d) state). This is exactly ``model.forward`` over the whole episode.
- ``primal`` / ``softmax`` with ``window=w``: the last w token positions (its own included),
  exactly as ``model.forward`` over the whole episode computes it (a ring of w slots for primal,
  of w + 2 key/value slots for softmax).
- ``softmax`` without a window: a rolling key/value cache, treated as ``window = 3K - 1`` tokens
  (K = the model's context length). At the top layer the state token s_t then attends to exactly the
  tokens the recompute engine shows it (R, s, a of the K - 1 previous steps, then R_t, s_t); lower
  layers' outputs inside that window were themselves computed from their own windows, so the
  receptive field reaches further back than recompute's K steps. Equivalently: the stream equals
  ``model.forward`` over the whole episode on a copy of the model whose unwindowed softmax layers
  get ``window = 3K - 1`` (``streamed_model_equivalent``).
- linear-attention family (linear, performer, cosformer, kerformer, flowformer): their own
  recurrent state (prefix sums over the whole episode, constant size), i.e. ``model.forward`` over
  the episode.
- ``kernel-*`` and ``svr-*``: their recurrent state is a cache of every real token of the episode
  (it grows with the episode, and so does a step's cost), i.e. ``model.forward`` over the episode.

So for every model, stream == ``streamed_model_equivalent(model).forward`` over the episode so far;
``agents.stream_training`` trains models whose training segments see the same thing.

How: the model embeds the step (``DecisionTransformer.embed_step``), the stack streams it
(``Stack.stream_step``: each pre-norm block around its mechanism's ``stream_step``, the top block
on the state token only), and the action head reads the state token. Each mechanism owns its
stream form (primal_dt/attention: fused weights for primal, a preallocated ring KV cache for
softmax, its own recurrent ``step`` for the others) and declares which parts of its state are per
row; the engine never looks at a layer's type. Stream states snapshot the weights they fuse:
build a new engine (or agent) after the model changes.

``precision="bf16"`` runs the weight matmuls of the stack in bfloat16 (primal_dt/attention/precision.py:
states, residuals, norms, embeddings and the head stay in the model's dtype); it is not exact, and
opt-in: at batch 100 on a CPU with AVX512-BF16 it halves the step.
"""

from __future__ import annotations

import copy

import torch

CHUNK = 3  # tokens per environment step: (a_{t-1}, R_t, s_t)


def softmax_stream_window(model) -> int:
    """Window used by the stream engine for a softmax layer built without one: 3K - 1 tokens."""
    return max(1, 3 * model.cfg.K - 1)


def check_streamable(model) -> None:
    """A clear error when the model has a layer without a causal recurrent form."""
    bad = [f"layer {i} ({spec.attention})" for i, (spec, b) in enumerate(zip(model.stack.specs, model.stack.blocks))
           if not (b.attn.causal and b.attn.supports_step)]
    if bad:
        raise ValueError(f"engine='stream' needs every attention layer to have a causal recurrent form; "
                         f"{', '.join(bad)} has none. Use engine='recompute' or train a model whose layers "
                         f"stream (softmax, primal, linear, performer, cosformer, ...)")
    if any(b.norm != "pre" for b in model.stack.blocks):
        raise ValueError("engine='stream' supports pre-norm blocks (the Decision Transformer's); "
                         "this stack is post-norm")


def streamed_model_equivalent(model):
    """A copy of ``model`` whose full-sequence ``forward`` equals what the stream engine computes:
    every layer adopts the window the engine streams it with (unwindowed softmax: 3K - 1 tokens)."""
    twin = copy.deepcopy(model).eval()
    w = softmax_stream_window(model)
    for b in twin.stack.blocks:
        b.attn.adopt_stream_window(w)
    return twin


class StreamEngine:
    """Recurrent DT inference for ``batch`` lock-stepped rows (see the module docstring)."""

    def __init__(self, model, batch: int, precision: str = "fp32"):
        check_streamable(model)
        if model.training:
            raise ValueError("StreamEngine needs the model in eval mode (model.eval())")
        self.model = model
        p = next(model.parameters())
        self.batch = int(batch)
        self.precision = precision
        #: one stream state per layer (primal_dt.attention.State), from the blocks' own stream forms
        self.states = model.stack.init_stream(self.batch, device=p.device, dtype=p.dtype,
                                              window=softmax_stream_window(model), chunk=CHUNK, precision=precision)

    @torch.inference_mode()
    def reset_rows(self, rows: torch.Tensor) -> None:
        """Restart the rows where ``rows`` ([B] bool) is True: fresh states, others untouched."""
        self.model.stack.reset_rows(self.states, rows)

    @torch.inference_mode()
    def keep_rows(self, keep: torch.Tensor) -> None:
        """Continue with the rows where ``keep`` ([B] bool) is True only, in order."""
        self.states = self.model.stack.select_rows(self.states, keep)
        self.batch = int(keep.sum())

    @torch.inference_mode()
    def step(self, rtg, states, prev_actions, timesteps, first):
        """One env step for every row: rtg [B] (scaled), states [B, state_dim] (normalised),
        prev_actions [B, act_dim] (a_{t-1}; ignored where ``first``), timesteps [B] long,
        first [B] bool (rows at t = 0), or ``None`` when no row is at t = 0.
        Returns actions [B, act_dim]."""
        m = self.model
        x, mask = m.embed_step(rtg, states, prev_actions, timesteps, first)
        y, self.states = m.stack.stream_step(x, self.states, mask, last_only=True)
        return m.predict_action(y[:, -1])
