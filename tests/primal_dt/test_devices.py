"""Device input on every path (training, rollout, load_agent, sweep): a name that is no device,
CUDA on a machine without it, an index past the machine's GPUs: one clear error before any work."""

import pytest
import torch

from agents.agent import load_agent
from eval import rollout, sweep
from primal_dt.run import runtime
from primal_dt.run.errors import SetupError

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def test_a_missing_cuda_index_names_the_devices_there_are(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SetupError, match=r"device=cuda:7: asks for cuda:7, but this machine has 2 CUDA device\(s\) "
                                         r"\(cuda:0 to cuda:1\)"):
        runtime.pick_device("cuda:7")
    assert runtime.pick_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(SetupError, match="process 3 of this machine's DDP processes needs cuda:3"):
        runtime.pick_device("cuda", runtime.Dist(rank=3, world=4, local_rank=3))


@no_cuda
def test_training_without_cuda_is_one_line_before_any_work(hopper_file, tmp_path, run_cli, one_line_error):
    p = run_cli("primal_dt.train", "env=hopper-medium", f"data_source=d4rl:{hopper_file}", f"out={tmp_path}",
                "device=cuda:1")
    one_line_error(p, "device=cuda:1 but CUDA is not available; use device=cpu")
    assert not list(tmp_path.iterdir())


@no_cuda
@pytest.mark.parametrize("device, message", [("cuda", "CUDA is not available"), ("gpu", "device must be auto, cpu")])
def test_rollout_load_agent_and_sweep_refuse_a_device_they_cannot_use(device, message, tmp_path, tiny_dt,
                                                                      dt_checkpoint_file):
    path = dt_checkpoint_file(tmp_path / "run", tiny_dt())
    with pytest.raises(SetupError, match=message):
        rollout.run([f"checkpoint={path}", f"device={device}", "episodes=1"])
    with pytest.raises(ValueError, match=message):
        load_agent(path, device=device)
    with pytest.raises(ValueError, match=message):
        sweep.plan(["env=hopper-medium", "model=dt", f"device={device}", f"out={tmp_path / 'sweep'}"])
