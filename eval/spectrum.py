"""Spectrum of each layer's attention matrix (Primal-Attention, Figure 1) and head redundancy
(primal-dual SVR framework), for any model built on ``primal_dt.blocks.Stack``.

    python -m eval.spectrum checkpoint=runs/.../best.pt [out=DIR] [n=64] [seed=0] [data_source=...]
    python -m eval.spectrum checkpoint=runs/hopper-medium/primal+dt     # a run, or a directory of runs

The matrix is read from the mechanism's own ``forward``, so no mechanism needs a second implementation: one
that mixes values computes y_i = sum_j A_ij v_j per head, linear in v, so one-hot values read A column by
column; Primal-Attention's scores e = We^T phi(q), r = Wr^T phi(k) are linear in the projection directions,
so one-hot directions read phi(q), phi(k) and A = phi(q) phi(k)^T. Head redundancy is the mean Frobenius
distance between two heads' matrices over sqrt(n) (a row-stochastic n x n matrix has norm <= sqrt(n)).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from primal_dt.blocks import Stack
from primal_dt.run import checkpoint, errors
from primal_dt.run.checkpoint import write_atomic
from primal_dt.run.cli import parse
from primal_dt.run.monitor import save_figure
from primal_dt.run.options import AT_LEAST_1, SEED, check_numbers


@dataclass
class LayerSpectrum:
    name: str
    mechanism: str
    singular_values: list[float]  # mean over examples and heads, normalised by the largest
    explained_variance: list[float]  # cumulative
    rank90: float  # mean number of components reaching 90% of the variance
    redundancy: float | None  # mean pairwise head distance / sqrt(n); None for one head


@dataclass
class SpectrumReport:
    layers: list[LayerSpectrum] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # layers whose mechanism the probe cannot read


def capture_attention_inputs(model: nn.Module, run: Callable[[], object]) -> list[tuple]:
    """Run ``run()`` (which calls the model) and return (layer name, attention module, x, mask) per
    attention call of every block of every Stack inside ``model``."""
    stacks = [(n, m) for n, m in model.named_modules() if isinstance(m, Stack)]
    if not stacks:
        raise ValueError(f"{type(model).__name__} contains no primal_dt.blocks.Stack; nothing to analyse")
    seen = []
    with contextlib.ExitStack() as hooks:  # each hook removed on the way out
        for sname, stack in stacks:
            for i, block in enumerate(stack.blocks):
                name = f"{sname + '.' if sname else ''}layer{i}"

                def hook(mod, args, name=name):  # a Block calls its attention as attn(x, mask)
                    x, mask = args
                    seen.append((name, mod, x.detach(), None if mask is None else mask.detach()))

                hooks.enter_context(block.attn.register_forward_pre_hook(hook))
        with torch.no_grad():
            run()
    return seen


@torch.no_grad()
def attention_matrix(attn, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, H, T, T]: the attention matrix of ``attn`` on its input x [B, T, D] (module docstring), d_head (or
    s) one-hot columns per call; rows and columns of padding are zero."""
    B, T, D = x.shape
    H = attn.n_heads
    if attn.value_projection:  # one-hot values: token start + c's value is e_c in every head
        d, A = attn.d_head, x.new_zeros(B, H, T, T)
        for start in range(0, T, d):
            n = min(d, T - start)
            onehot = x.new_zeros(T, H, d)
            onehot[start + torch.arange(n), :, torch.arange(n)] = 1
            mixed = _mixed_with_values(attn, x, mask, onehot.view(T, D))  # A_h[i, start + c] at (i, h, c)
            A[..., start:start + n] = mixed.view(B, T, H, d)[..., :n].transpose(1, 2)
    else:  # one-hot projection directions: the scores are the features the kernel is built from
        W = getattr(attn, attn.score_directions)
        rows, s = W.shape[2:]
        feats = []
        for start in range(0, rows, s):
            n = min(s, rows - start)
            onehot = torch.zeros_like(W)
            onehot[:, :, start + torch.arange(n), torch.arange(n)] = 1
            _, aux = torch.func.functional_call(attn, {attn.score_directions: onehot}, (x, mask))
            feats.append(torch.stack([aux["e"][..., :n], aux["r"][..., :n]]))
        fq, fk = torch.cat(feats, -1)  # [B, H, T, rows] each
        A = fq @ fk.transpose(-1, -2)
    if mask is not None:
        A = A * (mask[:, None, :, None] & mask[:, None, None, :]).to(A.dtype)
    return A


def _mixed_with_values(attn, x, mask, values):
    """The input of ``attn.proj`` (the heads' outputs, merged) when ``forward(x, mask)`` runs with its
    values, the last d_model outputs of ``attn.value_projection``, replaced by ``values`` [T, D] in every row."""
    seen = []

    def substitute(module, args, out):
        out = out.clone()
        out[..., -values.shape[-1]:] = values
        return out

    with (getattr(attn, attn.value_projection).register_forward_hook(substitute),
          attn.proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))):
        attn(x, mask)
    return seen[-1]


def _examples(A: torch.Tensor, mask: torch.Tensor | None):
    """Each example's [H, n, n] matrices over its n real tokens (float64, CPU); examples without one skipped."""
    for b in range(A.shape[0]):
        idx = torch.arange(A.shape[-1]) if mask is None else mask[b].nonzero().squeeze(-1).cpu()
        if idx.numel():
            yield A[b][:, idx][:, :, idx].double().cpu()


def singular_spectrum(A: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [B, H, T, T] -> (normalised singular values [T], cumulative explained variance [T], rank90 [])
    averaged over examples and heads (shorter examples padded with zeros / ones on the index axis)."""
    T = A.shape[-1]
    svs, cevs, r90 = [], [], []
    for sub in _examples(A, mask):
        s = torch.linalg.svdvals(sub)  # [H, n], descending
        energy = s.pow(2)
        cev = energy.cumsum(-1) / energy.sum(-1, keepdim=True).clamp(min=1e-300)
        r90.append(((cev < 0.9).sum(-1) + 1).double())
        pad = T - s.shape[-1]
        svs.append(torch.nn.functional.pad(s / s[:, :1].clamp(min=1e-300), (0, pad)))
        cevs.append(torch.nn.functional.pad(cev, (0, pad), value=1.0))
    if not svs:
        raise ValueError("no example has a real token")
    return torch.cat(svs).mean(0), torch.cat(cevs).mean(0), torch.cat(r90).mean()


def head_redundancy(A: torch.Tensor, mask: torch.Tensor | None) -> float | None:
    """Mean over examples and head pairs of ||A_h - A_h'||_F / sqrt(n) (real tokens only)."""
    H = A.shape[1]
    if H < 2:
        return None
    iu, vals = torch.triu_indices(H, H, 1), []
    for sub in _examples(A, mask):
        d = torch.cdist(sub.flatten(1)[None], sub.flatten(1)[None])[0]
        vals.append(d[iu[0], iu[1]].mean() / sub.shape[-1] ** 0.5)
    return float(torch.stack(vals).mean())


def analyse(model: nn.Module, run: Callable[[], object]) -> SpectrumReport:
    """Spectrum and head redundancy of every attention layer while ``run()`` feeds the model."""
    was_training = model.training
    model.eval()
    try:
        report = SpectrumReport()
        for name, attn, x, mask in capture_attention_inputs(model, run):
            mech = type(attn).__name__
            if not (attn.value_projection or attn.score_directions):
                report.skipped.append(f"{name} ({mech})")
                continue
            A = attention_matrix(attn, x, mask)
            sv, cev, r90 = singular_spectrum(A, mask)
            report.layers.append(LayerSpectrum(name, mech, sv.tolist(), cev.tolist(), float(r90),
                                               head_redundancy(A, mask)))
        return report
    finally:
        model.train(was_training)


def plot(report: SpectrumReport, path: Path):
    """Figure 1 style: singular values (left, log scale) and cumulative explained variance (right)."""
    from matplotlib.figure import Figure  # not pyplot: no backend, no figure to close

    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    for layer in report.layers:
        k = range(1, len(layer.singular_values) + 1)
        label = f"{layer.name} ({layer.mechanism}, rank90={layer.rank90:.1f})"
        ax1.semilogy(k, [max(v, 1e-12) for v in layer.singular_values], label=label)
        ax2.plot(k, layer.explained_variance, label=label)
    ax1.set(xlabel="index k", ylabel="singular value / largest", title="Singular values")
    ax2.set(xlabel="number of components", ylabel="cumulative explained variance", title="Explained variance",
            ylim=(0, 1.02))
    ax2.axhline(0.9, color="grey", lw=0.8, ls="--")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, "spectrum plot", dpi=120)
    return fig


def write(report: SpectrumReport, out_dir: str | Path, tensorboard: bool = True) -> dict[str, Path]:
    """PNG + JSON under out_dir, and TensorBoard events there (via RunMonitor); a failed write is one
    ``WriteError`` naming the file, and no partial file is left."""
    out = Path(out_dir)
    fig = plot(report, out / "spectrum.png")
    write_atomic(out / "spectrum.json", json.dumps(asdict(report), indent=1), "spectrum's values")
    if tensorboard:
        from primal_dt.run.monitor import RunMonitor

        with contextlib.closing(RunMonitor(out, progress=False)) as mon:
            mon.figure("spectrum/figure", fig)
            for layer in report.layers:
                for k, (s, c) in enumerate(zip(layer.singular_values, layer.explained_variance), start=1):
                    mon.scalar(f"spectrum/{layer.name}/singular_value", s, k)
                    mon.scalar(f"spectrum/{layer.name}/explained_variance", c, k)
                mon.scalar(f"spectrum/{layer.name}/rank90", layer.rank90, 0)
                if layer.redundancy is not None:
                    mon.scalar(f"redundancy/{layer.name}", layer.redundancy, 0)
    return {"png": out / "spectrum.png", "json": out / "spectrum.json"}


# -- command line -------------------------------------------------------------------------------
def build_from_checkpoint(ckpt: dict, n: int = 64, seed: int = 0, *, where: str = "checkpoint",
                          data_source: str | None = None) -> tuple[nn.Module, Callable[[], object]]:
    """(model, run) for a checkpoint dict: ``run()`` feeds the model ``n`` real examples: a classifier's test
    split, or a DT's own training segments drawn as its training drew them (the checkpoint's K, max_timestep
    and reward_scale), so the spectrum describes the inputs the model learned from. The DT's data is read
    where its run read it unless ``data_source`` says otherwise; other data than it recorded is refused."""
    kind = ckpt.get("kind")
    if kind == "classifier":
        from primal_dt.classifier_training import build_model
        from primal_dt.classify_config import config_from_dict
        from primal_dt.tasks import load_task

        cfg = config_from_dict(ckpt["config"])
        data = load_task(cfg.data, with_val=False)
        model = build_model(cfg, data)
        model.load_state_dict(ckpt["model"])
        pick = torch.randperm(data.test.y.shape[0], generator=torch.Generator().manual_seed(seed))[:n]
        x, mask = data.test.x[pick], data.test.mask[pick]
        return model, lambda: model(x, mask)
    if kind == "dt":
        from agents.dt_checkpoint import DTCheckpoint, training_data
        from envs import SegmentSampler

        ck = DTCheckpoint.from_dict(ckpt, where)
        model, mc = ck.build_model(), ck.model_config
        b = SegmentSampler(training_data(ck, data_source), K=mc.K, batch_size=n, reward_scale=ck.data.reward_scale,
                           max_timestep=mc.max_timestep, seed=seed).sample()
        return model, lambda: model(b)
    raise ValueError(f"checkpoint kind {kind!r} has no model builder here; known kinds: 'classifier', 'dt'")


@dataclass
class SpectrumConfig:
    checkpoint: str
    """a checkpoint of primal_dt.train (kind dt) or primal_dt.classify"""
    out: str = ""
    """where spectrum.png, spectrum.json and TensorBoard events go ('' : <checkpoint's directory>/spectrum)"""
    n: int = 64
    """examples (dt: K-step training segments) the matrices are averaged over"""
    seed: int = 0
    """which examples are drawn"""
    tensorboard: bool = True
    """also write TensorBoard events"""
    data_source: str = ""
    """dt checkpoints: where their dataset is read from ('' : where the run read it)"""


def run(argv: list[str]) -> int:
    """What ``python -m eval.spectrum`` does; bad input is a ``SetupError`` before any work."""
    with errors.setup_errors():
        o = parse(SpectrumConfig, argv, prog="python -m eval.spectrum", description=__doc__.split("\n\n")[0])
        check_numbers(o, {"n": AT_LEAST_1, "seed": SEED})
        path = Path(o.checkpoint)
        if path.is_dir():  # a run directory (its last.pt) or a directory of runs (the newest), as everywhere
            path = checkpoint.find(path, "last.pt", "checkpoint")
        out = Path(o.out) if o.out else path.parent / "spectrum"
        model, run_model = build_from_checkpoint(checkpoint.load(path), n=o.n, seed=o.seed,
                                                 where=f"checkpoint {path}", data_source=o.data_source or None)
    report = analyse(model, run_model)
    files = write(report, out, tensorboard=o.tensorboard)
    for layer in report.layers:
        red = "n/a" if layer.redundancy is None else f"{layer.redundancy:.3f}"
        print(f"{layer.name:<20} {layer.mechanism:<28} rank90={layer.rank90:6.2f}  head distance={red}")
    for s in report.skipped:
        print(f"{s}: no values or score directions to probe, skipped")
    print(f"wrote {files['png']} and {files['json']} (TensorBoard events in {out})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m eval.spectrum``: 0 when written, else one ``error:`` line (exit status 2)."""
    return errors.main(run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
