"""eval.bench.diagnose's CPU rehearsal (the tiny size, the compiled arms on torch.compile's cheap backends, the
bundled hopper-medium replica): every arm that exists on a CPU takes its steps from the one initialisation and is
measured against eager fp32 and its parent, the CUDA-only arms are listed as skipped, and an arm whose step is
wrong is named as the one that departs first, with the part it adds."""

import json

import pytest

from agents.decision_transformer import dt_loss
from agents.train_step import Stepper
from eval.bench import diagnose

REHEARSAL = ["--size", "tiny", "--steps", "12", "--warmup", "4", "--backend", "eager", "--threads", "1"]


def test_the_rehearsal_runs_every_cpu_arm_and_names_no_departure(tmp_path):
    out = diagnose.main([*REHEARSAL, "--json", str(tmp_path / "d.json"), "--markdown", str(tmp_path / "d.md")])
    assert json.loads((tmp_path / "d.json").read_text()) == json.loads(json.dumps(out))
    cpu_arms = [a.name for a in diagnose.ARMS if a.mode != "cudagraphs"]
    assert list(out["arms"]) == cpu_arms
    assert out["skipped"] == [f"{a.name} (needs CUDA)" for a in diagnose.ARMS if a.mode == "cudagraphs"]
    for name, arm in out["arms"].items():
        assert arm["taken"] == arm["applied"] == 12 and arm["failed"] is None, name
        assert set(arm["loss"]) >= {1, 10, 12} and all(v > 0 for v in arm["loss"].values())
        assert set(arm["distance"]["eager fp32"]) == {1, 10, 12} and arm["val_mse"] > 0
    assert out["arms"]["eager fp32"]["distance"]["eager fp32"] == {1: 0.0, 10: 0.0, 12: 0.0}
    fp32 = out["arms"]["compile fp32"]["distance"]["parent"]
    assert 0 <= fp32[1] <= 4 * out["yardstick"]["fp32"][1]  # compiled float32 within float32's rounding
    assert out["first"] is None and out["verdict"].startswith("no arm departs from its parent")
    page = (tmp_path / "d.md").read_text()
    assert "| compile bf16 | aot_eager bf16 |" in page and "skipped: cudagraphs bf16 (needs CUDA)" in page


class WrongWhenCompiled(Stepper):
    """The compiled forms' loss on negated actions: what a wrong kernel would do."""

    def _loss(self, batch):
        return dt_loss(self.net, batch._replace(actions=-batch.actions), self.eta, True)


def test_a_wrong_compiled_step_is_named_with_the_part_it_adds(monkeypatch):
    monkeypatch.setattr(diagnose, "Stepper", WrongWhenCompiled)
    out = diagnose.main([*REHEARSAL, "--steps", "10", "--arms", "eager bf16", "aot_eager bf16", "compile fp32"])
    assert list(out["arms"]) == ["eager fp32", "eager bf16", "aot_eager bf16", "compile fp32"]
    assert set(out["departs"]) == {"aot_eager bf16", "compile fp32"}  # eager bf16 is the eager step
    assert out["first"] == "aot_eager bf16"  # both at step 1; it adds less
    assert out["verdict"].startswith("departs first: aot_eager bf16 (at step 1: distance")
    assert "the part it adds to eager bf16: torch.compile's traced step" in out["verdict"]


@pytest.mark.parametrize("args, why", [(["--arms", "compile fp16"], "--arms: no arm named 'compile fp16'"),
                                        (["--steps", "0"], "--steps"),
                                        (["--device", "cuda:7"], "--device")])
def test_a_bad_option_is_one_error_line_before_any_work(args, why, run_cli, one_line_error):
    one_line_error(run_cli("eval.bench.diagnose", *args, timeout=120), why)
