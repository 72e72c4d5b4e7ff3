"""The compile check: before a run trains in a compiled form (``compile=compile`` or ``cudagraphs``), its first
steps in that form are compared with the eager step's on the same batches, and a form that departs from it by
more than float rounding explains is not trained in.

Why: the compiled forms are compared with the eager one (the reference) only where the tests ran. On other
hardware a kernel, a graph capture or a library setting can compute a wrong step without any error, and a wrong
step trains a wrong model for hours (a primal+dt run on a GPU trained to a validation MSE four times dt's:
docs/results/gpu-h200-recipe-bf16.md). A few steps on copies catch a step that is wrong from the start.

How: three trajectories from copies of the run's model and optimizer state, over the run's next ``STEPS``
batches and learning rates, with dropout off (compiled dropout draws its masks from a stream of its own, so with
dropout the forms differ by design):

- ``eager``: the eager step at the run's precision, the reference;
- ``yardstick``: the eager step one precision higher (float64 for a float32 run, float32 for bf16 autocast),
  which measures how far rounding alone moves the reference on this device;
- ``form``: the run's form (its compilation included, the cost of the check).

After each step, the relative parameter distance of a trajectory from the reference is
||theta - theta_eager|| / ||theta_eager - theta_start|| over all parameters: how far apart they are, as a share
of how far the reference moved. The form passes when at every step its distance is at most ``FACTOR`` times the
yardstick's (and never fails under ``FLOOR``). Why ``FACTOR`` = 4: a form as accurate as the eager step, its
rounding errors independent of the reference's, lies about sqrt(2) times the yardstick from the reference (at
most twice it, by the triangle inequality); 4 leaves room for a form twice as inexact as the eager step. A wrong
step (a wrong loss or gradient, a stale learning rate or input in a captured graph, a skipped step) moves the
parameters elsewhere by about as much as the step moves them, a distance near 1, far above float32's rounding and
above bf16's. The batches, rates and numbers of the run are untouched: its random generators are forked around
the check and its sampler's stream is put back (``upcoming_batches`` in ``agents.training``), so a checked run
trains bitwise as an unchecked one.

``STEPPER`` is the class the check builds the form's step from: a test puts a deliberately wrong one there.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .decision_transformer import Batch
from .train_step import GRAPH_WARMUP, Stepper

STEPS = GRAPH_WARMUP + 2
"""steps compared: under ``cudagraphs`` the warm-up steps, the capture and a replay of the captured graph"""
FACTOR = 4.0
"""how many times the yardstick's distance a right form may lie from the reference (module docstring)"""
FLOOR = 1e-6
"""a distance never called a departure (where the yardstick happens to be 0)"""
STEPPER = Stepper
"""what the form's step is built from (a test hook: a Stepper subclass with a deliberate fault)"""


@dataclasses.dataclass
class Verdict:
    """What the check found: ``ok`` (the form may train), the worst step and its distances, the parameter farthest
    from the reference there, the check's seconds (the run's cost at start), and ``note`` (why nothing was
    compared, when nothing was)."""

    mode: str
    ok: bool
    steps: int
    step: int = 0
    distance: float = 0.0
    tolerance: float = 0.0
    farthest: str = ""
    seconds: float = 0.0
    note: str = ""

    def line(self) -> str:
        """One line for the run's log."""
        head = f"compile check ({self.seconds:.1f}s): compile={self.mode}"
        if self.note and self.ok:
            return f"{head} not checked: {self.note}"
        measure = (f"relative parameter distance {self.distance:.2g}, float rounding explains up to "
                   f"{self.tolerance:.2g}")
        if self.ok:
            return f"{head} agrees with the eager step over {self.steps} steps ({measure})"
        where = self.note or f"at step {self.step} of {self.steps} ({measure}; farthest: {self.farthest})"
        return (f"{head} departs from the eager step {where}: this run trains in the eager step instead (slower); "
                f"compile_check=false trains in compile={self.mode} anyway (docs/gpu.md#the-compile-check)")


def check(mode: str, model: torch.nn.Module, opt: torch.optim.Optimizer, sched, batches: Sequence[Batch], eta: float,
          grad_clip: float, autocast: torch.dtype | None = None, first_step: int = 0, world: int = 1,
          backend: str = "inductor") -> Verdict:
    """The form ``mode``'s first ``len(batches)`` steps against the eager step's (module docstring), on copies of
    ``model`` (in eval mode: dropout off) and ``opt``'s state, at the learning rates ``sched`` would set; nothing
    of the run is changed. Under DDP (``world`` > 1) every process checks on its own batches and the form passes
    only where it passes in all."""
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    rates = upcoming_rates(sched, len(batches))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        start = [p.detach().double().clone() for p in model.parameters()]
        names = [n for n, _ in model.named_parameters()]
        eager, failed = _trajectory("eager", model, opt, rates, batches, eta, grad_clip, autocast, first_step, Stepper)
        verdict = Verdict(mode, True, len(batches))
        if failed is not None:
            verdict.note = f"the eager step itself failed at step {failed} of the check"
        else:
            higher = torch.float64 if autocast is None else torch.float32
            yard, _ = _trajectory("eager", model, opt, rates, batches, eta, grad_clip, None, first_step, Stepper,
                                  dtype=higher)
            form, _ = _trajectory(mode, model, opt, rates, batches, eta, grad_clip, autocast, first_step, STEPPER,
                                  backend=backend)
            gaps = [(distance(f, e, start), max(FACTOR * distance(y, e, start), FLOOR))
                    for e, y, f in zip(eager, yard, form)]
            bad = [i for i, (d, tol) in enumerate(gaps) if not d <= tol]  # a NaN departs too
            i = bad[0] if bad else max(range(len(gaps)), key=lambda j: gaps[j][0] / gaps[j][1])
            verdict.ok, verdict.step, (verdict.distance, verdict.tolerance) = not bad, i + 1, gaps[i]
            if bad:
                verdict.farthest = names[max(range(len(start)), key=lambda j: _gap(form[i][j], eager[i][j], start[j]))]
    if world > 1 and dist.is_available() and dist.is_initialized():
        ok = torch.tensor(float(verdict.ok), device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if verdict.ok and not float(ok):
            verdict.ok, verdict.note = False, "it departs from the eager step in another process"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    verdict.seconds = time.perf_counter() - t0
    return verdict


def upcoming_rates(sched, n: int) -> list[list[float]]:
    """The learning rates of each parameter group ``sched`` sets after each of its next ``n`` steps, without
    stepping it: a LambdaLR's (every run's) from its functions; any other scheduler's held at its last rates."""
    if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        return [[base * f(sched.last_epoch + i) for base, f in zip(sched.base_lrs, sched.lr_lambdas)]
                for i in range(1, n + 1)]
    return [list(sched.get_last_lr())] * n


class _Rates:
    """The scheduler of a copy: sets the run's upcoming rates (``upcoming_rates``) one step at a time."""

    def __init__(self, opt: torch.optim.Optimizer, rates: list[list[float]]):
        self.opt, self.rates, self.i = opt, rates, 0

    def step(self) -> None:
        for g, lr in zip(self.opt.param_groups, self.rates[self.i]):
            g["lr"] = lr
        self.i += 1


def _trajectory(mode, model, opt, rates, batches, eta, grad_clip, autocast, first_step, stepper_cls,
                dtype: torch.dtype = torch.float32, backend: str = "inductor"):
    """(the parameters after each step, in float64; the first failed step or None) of ``mode`` on a copy."""
    # eval mode is dropout off (the package's layers change nothing else in it), and it changes no number the
    # compiled graph reads, so the run's own compilation after the check's compiles the graph an unchecked run does
    twin = copy.deepcopy(model).to(dtype).eval()
    params = list(twin.parameters())
    accepted = inspect.signature(type(opt)).parameters  # defaults may hold more than the constructor takes
    hyper = {k: v for k, v in opt.defaults.items() if k in accepted}
    twin_opt = type(opt)(params, **{**hyper, "fused": mode != "eager"})
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # loading alone would share the state's tensors
    kw = {} if mode == "eager" else {"backend": backend}
    step = stepper_cls(mode, twin, params, twin_opt, _Rates(twin_opt, rates), eta, grad_clip, 1, first_step,
                       autocast=autocast, **kw)
    out = []
    for i, b in enumerate(batches, 1):
        if dtype != torch.float32:
            b = _cast(b, dtype)
        step.step(b)
        if step.eager and step.failure() is not None:
            return out, i
        out.append([p.detach().double().clone() for p in params])
    return out, None


def _cast(batch: Batch, dtype: torch.dtype) -> Batch:
    """``batch`` with its floating tensors in ``dtype``, those of a carried recurrent state included."""
    cast = lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
    return Batch(*(tuple(map(cast, v)) if isinstance(v, tuple) else cast(v) for v in batch))


def distance(a: list[torch.Tensor], ref: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """||a - ref|| / ||ref - start|| over all parameters (float64): the distance as a share of the reference's
    movement from ``start``."""
    num = sum(float((x - y).square().sum()) for x, y in zip(a, ref))
    den = sum(float((y - z).square().sum()) for y, z in zip(ref, start))
    return math.sqrt(num) / max(math.sqrt(den), 1e-300)


def _gap(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> float:
    """One parameter's distance from the reference, as a share of its movement."""
    return float((x - y).norm() / (y - z).norm().clamp_min(1e-300))
