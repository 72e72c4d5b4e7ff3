"""Train a Decision Transformer on an offline MuJoCo dataset, evaluating it in the simulator.

    python -m primal_dt.train env=hopper-medium
    python -m primal_dt.train env=hopper-medium model=dt seed=3 steps=20000
    python -m primal_dt.train preset=smoke
    python -m primal_dt.train resume=runs/hopper-medium/primal+dt/20250101-120000-seed0
    torchrun --nproc_per_node 2 -m primal_dt.train env=hopper-medium      (DistributedDataParallel)

Configuration and its checks live in ``agents/train_config.py`` (``--help`` lists every option); the
trainer is ``agents.training``; what every entry point shares is ``errors`` (how a command fails),
``runtime`` (device, threads, seeds), ``distributed`` (DDP) and ``checkpoint`` (``resume=`` paths). This module only wires them, and hands the trainer the
simulator evaluation (``eval.rollout``), which the trainer's package may not import. A run
directory ``<out>/<env>/<model>/<time>-seed<k>/`` holds TensorBoard events, ``last.pt`` (written
atomically every ``checkpoint_every`` steps, by wall time and at the end), ``eval_return.png`` and
``summary.json``. Training is deterministic on CPU for a given seed and config, and a resumed run
continues exactly where the checkpoint left it.
"""

from __future__ import annotations

from agents.dt_checkpoint import DataInfo
from agents.training import Diverged, Evaluator, train

from agents import train_config

from .run import errors
from .run.distributed import Dist
from .run.errors import SetupError
from agents.train_config import EvalConfig

__all__ = ["Diverged", "SetupError", "main", "rollout", "run"]


def rollout(model, data: DataInfo, episodes: int, seed: int, settings: EvalConfig, on_episode=None) -> dict:
    """The trainer's simulator evaluation: ``episodes`` episodes per target of ``data.targets`` on
    vectorised simulators, with the run's data statistics and return-to-go scale; ``on_episode(n)``
    as ``n`` episodes end."""
    from eval.rollout import evaluate

    return evaluate(model, episodes, seed, settings, data=data, on_episode=on_episode)


def _line(results: dict) -> str:
    from eval.rollout import summary_line

    return summary_line(results)


EVALUATOR = Evaluator(rollout=rollout, line=_line)


def run(argv: list[str], d: Dist | None = None) -> dict:
    """Train as the command line ``argv`` says; returns the run's summary. Bad input: SetupError."""
    with errors.setup_errors():
        built = train_config.build(argv)
    return train(built, EVALUATOR, d)


def main(argv: list[str] | None = None) -> None:
    errors.main(run, argv, expected=(Diverged,))


if __name__ == "__main__":
    main()
