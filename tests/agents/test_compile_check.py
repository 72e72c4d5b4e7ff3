"""The compile check (agents.compile_check): a compiled step that departs from the eager one is caught in its first
steps and the run trains in the eager step instead; a right one passes; the run itself is left as it was, so a
checked run trains as an unchecked one would. The compiled forms are built by torch.compile's cheap backends
(``eager``, ``aot_eager``) here; inductor is the slow tests'."""

import copy
import types

import pytest
import torch

from agents import compile_check, dt_checkpoint
from agents.decision_transformer import DecisionTransformer, DTConfig, dt_loss
from agents.train_step import Stepper
from eval.bench.train import batches
from primal_dt.train import run


class Cheap(Stepper):
    """A right compiled step, compiled by ``aot_eager`` (autograd traced, no inductor kernels: seconds on a CPU)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **{**kw, "backend": "aot_eager"})


class WrongLoss(Cheap):
    """A deliberately wrong compiled step: its loss is on the negated actions."""

    def _loss(self, batch):
        return dt_loss(self.net, batch._replace(actions=-batch.actions), self.eta, True)


class StaleRate(Cheap):
    """A deliberately wrong compiled step: the learning rate of its first step kept, as a CUDA graph that captured it
    by value would."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sched = types.SimpleNamespace(step=lambda: None)


def setup(layout="primal+dt", dropout=0.1):
    torch.manual_seed(0)
    cfg = DTConfig(state_dim=11, act_dim=3, K=5, d_model=16, n_heads=2, n_layers=2, name=layout, s=4, dropout=dropout)
    model = DecisionTransformer(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))  # warm-up: rates change
    return model, opt, sched, batches(compile_check.STEPS, 8, 5)


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("layout", ["dt", "primal+dt"])
def test_a_right_compiled_step_passes_and_wrong_ones_are_caught_at_their_first_step(monkeypatch, layout, amp):
    model, opt, sched, data = setup(layout)
    monkeypatch.setattr(compile_check, "STEPPER", Cheap)
    right = compile_check.check("compile", model, opt, sched, data, 0.05, 0.25, amp)
    assert right.ok and right.distance <= right.tolerance and right.tolerance < 1, right.line()
    assert "agrees with the eager step over 5 steps" in right.line()
    for wrong, first in ((WrongLoss, 1), (StaleRate, 2)):  # the stale rate is right at step 1, wrong from step 2
        monkeypatch.setattr(compile_check, "STEPPER", wrong)
        v = compile_check.check("compile", model, opt, sched, data, 0.05, 0.25, amp)
        line = v.line()
        assert not v.ok and v.step == first and v.distance > v.tolerance, line
        assert f"compile=compile departs from the eager step at step {first} of 5" in line and "\n" not in line
        assert "trains in the eager step instead" in line and "compile_check=false" in line


def test_the_check_leaves_the_run_as_it_was(monkeypatch):
    """Model, optimizer state, scheduler and torch's generator: a checked run trains bitwise as an unchecked one."""
    model, opt, sched, data = setup()
    Stepper("eager", model, list(model.parameters()), opt, sched, 0.05, 0.25).step(data[0])  # some optimizer state
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), sched.state_dict(),
              torch.get_rng_state())
    monkeypatch.setattr(compile_check, "STEPPER", WrongLoss)
    v = compile_check.check("compile", model, opt, sched, data, 0.05, 0.25, None, first_step=1)
    assert not v.ok and v.seconds > 0
    weights, state, sch, rng = before
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    now = opt.state_dict()
    assert now["param_groups"] == state["param_groups"]
    assert all(torch.equal(state["state"][i][k], now["state"][i][k]) for i in state["state"] for k in state["state"][i])
    assert sched.state_dict() == sch and torch.equal(torch.get_rng_state(), rng)


def test_upcoming_rates_are_the_schedulers_without_stepping_it():
    model, opt, sched, _ = setup()
    rates = compile_check.upcoming_rates(sched, 3)
    assert sched.last_epoch == 0
    seen = []
    for _ in range(3):
        opt.step()
        sched.step()
        seen.append(sched.get_last_lr())
    assert [r[0] for r in rates] == pytest.approx([s[0] for s in seen], rel=1e-12)


def test_an_eager_failure_in_the_checked_steps_is_no_verdict():
    """Divergence is the loop's to report (at its step, with the last good checkpoint), not the check's."""
    model, opt, sched, data = setup()
    data[1] = data[1]._replace(rtg=data[1].rtg * float("nan"))
    v = compile_check.check("compile", model, opt, sched, data, 0.05, 0.25)
    assert v.ok and "not checked: the eager step itself failed at step 2" in v.line()


def test_a_run_whose_compiled_step_is_wrong_says_so_and_trains_as_the_eager_run(monkeypatch, hopper_file, tmp_path,
                                                                               tiny_train, capsys):
    """compile=compile with a wrong compiled step (the test hook): one line, then the eager step, weight for weight
    the run compile=eager trains (the check moved none of the run's random streams)."""
    monkeypatch.setattr(compile_check, "STEPPER", WrongLoss)
    common = tiny_train.args(hopper_file, tmp_path, "steps=6", *tiny_train.QUIET)
    checked = run(common + ["compile=compile", "out=" + str(tmp_path / "checked")])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("compile check")]
    assert len(lines) == 1 and "compile=compile departs from the eager step at step 1 of 5" in lines[0]
    eager = run(common + ["compile=eager", "out=" + str(tmp_path / "eager")])
    assert not [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("compile check")]
    a, b = (dt_checkpoint.load(s["run_dir"]).model for s in (checked, eager))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_checked_compiled_run_trains_bitwise_as_an_unchecked_one(monkeypatch, hopper_file, tmp_path, tiny_train,
                                                                   capsys):
    """The run's own step compiled by inductor (minutes on a CPU); the check's by aot_eager (the test hook)."""
    monkeypatch.setattr(compile_check, "STEPPER", Cheap)
    common = tiny_train.args(hopper_file, tmp_path, "steps=6", "compile=compile", *tiny_train.QUIET)
    checked = run(common + ["out=" + str(tmp_path / "checked")])
    assert "compile=compile agrees with the eager step over 5 steps" in capsys.readouterr().out
    unchecked = run(common + ["compile_check=false", "out=" + str(tmp_path / "unchecked")])
    assert "compile check" not in capsys.readouterr().out
    a, b = (dt_checkpoint.load(s["run_dir"]).model for s in (checked, unchecked))
    assert all(torch.equal(a[k], b[k]) for k in a)
