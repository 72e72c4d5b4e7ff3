"""The compiled training step against the eager one (the reference): same losses, gradients and
weights to float32 rounding, and a failed step skipped on the device exactly as the eager step skips it."""

import copy

import pytest
import torch

from agents.decision_transformer import DecisionTransformer, DTConfig
from agents.train_step import Stepper, align, resolve
from eval.bench.train import batches

LAYOUTS = ("dt", "primal+dt", "primalformer-dt")


def tiny(layout: str) -> DecisionTransformer:
    torch.manual_seed(0)
    cfg = DTConfig(state_dim=11, act_dim=3, K=5, d_model=16, n_heads=2, n_layers=2, name=layout, s=4, dropout=0.0)
    return DecisionTransformer(cfg).train()


def steps(model, mode: str, data: list[dict], backend: str = "inductor", lr: float = 1e-3):
    """(losses, gradients after the first step, weights after all) of ``data`` in form ``mode``."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4, fused=mode != "eager")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    stepper = Stepper(mode, model, params, opt, sched, eta=0.05, grad_clip=0.25, backend=backend)
    losses, grads = [], None
    for b in data:
        losses.append(float(stepper.step(b)[0]))
        if grads is None:
            grads = [p.grad.clone() for p in params]
    return losses, grads, [p.detach().clone() for p in params], stepper


def assert_same(a, b, tol=1e-5):
    (la, ga, wa, _), (lb, gb, wb, _) = a, b
    assert la == pytest.approx(lb, rel=tol, abs=tol)
    for x, y in [*zip(ga, gb), *zip(wa, wb)]:
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def test_compiled_step_equals_eager_and_skips_a_failed_step_on_the_device():
    """The compiled form's own logic (no read-back; fused AdamW skipping by ``found_inf``), compiled by
    torch.compile's cheapest backend so the default run stays fast; inductor is the slow tests'. A
    poisoned second batch: both forms stop there with the first step's weights; the compiled one finds
    out only when asked, and says which step it was."""
    model, data = tiny("primal+dt"), batches(3, 4, 5)
    data[1] = data[1]._replace(rtg=data[1].rtg * float("nan"))
    eager = steps(model, "eager", data[:2])
    compiled = steps(model, "compile", data, backend="eager")
    assert compiled[0][0] == pytest.approx(eager[0][0], rel=1e-6)
    for x, y in [*zip(eager[1], compiled[1]), *zip(eager[2], compiled[2])]:
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    failed = compiled[3].failure()
    assert failed is not None and failed.step == 2 and failed.loss != failed.loss  # NaN
    assert eager[3].failure().step == 2
    assert compiled[3].opt.state[compiled[3].params[0]]["step"].item() == 1  # skipped steps are not counted


def test_graphs_need_cuda_and_one_process():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve("cudagraphs", torch.device("cpu"))
    assert resolve("auto", torch.device("cpu")) == "eager"
    assert resolve("auto", torch.device("cuda"), world=2) == "compile"


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_inductor_step_equals_eager(layout):
    """Three steps of the inductor-compiled step: losses, first gradients and final weights as eager's."""
    model, data = tiny(layout), batches(3, 4, 5)
    assert_same(steps(model, "compile", data), steps(model, "eager", data), tol=1e-4)


def test_a_restored_optimizer_runs_as_the_form_it_resumes_in():
    """Loading a state dict brings back the saved run's flags: an eager run's checkpoint resumed compiled
    must still skip a failed step on the device (fused), and the other way round be the eager reference."""
    p = [torch.nn.Parameter(torch.ones(3))]
    p[0].grad = torch.ones(3)
    eager = torch.optim.AdamW(p, lr=0.1)
    eager.step()
    fused = torch.optim.AdamW(p, lr=0.1, fused=True)
    fused.load_state_dict(eager.state_dict())
    assert not fused.param_groups[0]["fused"]  # what loading did
    align(fused, "compile")
    assert fused.param_groups[0]["fused"]
    fused.found_inf, before = torch.ones(()), p[0].detach().clone()
    fused.step()
    assert torch.equal(before, p[0]) and fused.state[p[0]]["step"].item() == 1
    align(fused, "eager")
    assert not fused.param_groups[0]["fused"] and fused.state[p[0]]["step"].device.type == "cpu"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_part_of_the_loss_lives_on_the_models_device(layout):
    """A CUDA graph cannot capture a step that copies a host tensor: dt's KSVD term (0, no primal layer) once
    was one. The meta device stands in for a GPU here: any host tensor in the loss shows as ``cpu``."""
    from agents.decision_transformer import dt_loss

    model = tiny(layout).to("meta")
    loss, parts = dt_loss(model, batches(1, 4, 5)[0].to("meta"), eta=0.05, detail=True)
    assert {loss.device.type} | {v.device.type for v in parts.values()} == {"meta"}


def test_bf16_autocast_runs_the_forward_in_bf16_and_keeps_the_weights_float32():
    """``amp=bf16``: the step's losses differ from float32 by bf16 rounding only; weights stay float32."""
    model, data = tiny("primal+dt"), batches(3, 8, 5)
    full = steps(model, "eager", data)
    m = copy.deepcopy(model)
    params = list(m.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    mixed = Stepper("eager", m, params, opt, sched, eta=0.05, grad_clip=0.25, autocast=torch.bfloat16)
    losses = [mixed.step(b)[0] for b in data]
    assert losses != full[0] and losses == pytest.approx(full[0], rel=0.05)
    assert {p.dtype for p in m.parameters()} == {torch.float32}
