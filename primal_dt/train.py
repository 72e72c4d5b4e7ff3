"""Train a Decision Transformer on an offline MuJoCo dataset, evaluating it in the simulator
(``python -m primal_dt.train env=hopper-medium``; docs/training.md). Options and their checks:
``agents.train_config``; the trainer: ``agents.training``. This module only wires them, handing the trainer
the simulator evaluation (``eval.rollout``), which ``agents`` may not import.
"""

from __future__ import annotations

from agents import train_config
from agents.training import Diverged, Evaluator, train

from .run import errors
from .run.distributed import Dist
from .run.errors import SetupError

__all__ = ["Diverged", "SetupError", "main", "run"]


def _rollout(model, data, episodes, seed, settings, on_episode=None) -> dict:
    from eval.rollout import evaluate  # imported on use: --help and bad options stay fast

    return evaluate(model, episodes, seed, settings, data=data, on_episode=on_episode)


def _line(results: dict) -> str:
    from eval.rollout import summary_line

    return summary_line(results)


def run(argv: list[str], d: Dist | None = None) -> dict:
    """Train as the command line ``argv`` says; returns the run's summary. Bad input: SetupError."""
    with errors.setup_errors():
        built = train_config.build(argv)
    return train(built, Evaluator(rollout=_rollout, line=_line), d)


def main(argv: list[str] | None = None) -> None:
    errors.main(run, argv, expected=(Diverged,))


if __name__ == "__main__":
    main()
