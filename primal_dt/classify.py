"""Train and evaluate a sequence classifier (UEA time series, LRA) on the attention core
(``python -m primal_dt.classify task=uea/JapaneseVowels model=primalformer``; docs/classification.md).
Options and their checks: ``classify_config``; the trainer: ``classifier_training``; this module wires them.
"""

from __future__ import annotations

from .classifier_training import KIND, Diverged, Trainer, fit
from .classify_config import DESCRIPTION, PROG, SHORTHANDS, ClassifyConfig, build_config, check_config, check_resumed
from .classify_config import config_from_dict
from .run import checkpoint, cli, errors, lock, outputs, runtime
from .run.errors import SetupError
from .run.monitor import run_dir
from .tasks import load_task

__all__ = ["SetupError", "main", "run"]


def run(argv: list[str]) -> dict:
    """Train as the command line ``argv`` says; returns the summary. Bad input: SetupError, before any write."""
    with errors.setup_errors():
        resume = cli.peek(ClassifyConfig, argv, SHORTHANDS, PROG).resume
        path = checkpoint.find(resume, "last.pt", "resume") if resume else None
        if path is not None:  # held before it is read: no run continues from a checkpoint another is replacing
            outputs.check_writable(path.parent, "run directory")
            lock.hold(path.parent)
    try:
        return _run(argv, path)
    finally:
        if path is not None:
            lock.release(path.parent)


def _run(argv: list[str], path) -> dict:
    with errors.setup_errors(RuntimeError):  # RuntimeError: a task's missing optional dependency
        if path is not None:
            ck = checkpoint.load(path, expect_kind=KIND)
            cfg = cli.parse(ClassifyConfig, argv, default=config_from_dict(ck["config"]), prog=PROG,
                            description=DESCRIPTION, shorthands=SHORTHANDS)  # the checkpoint's, the line on top
            source = f"resumed from {path} at step {ck['step']}"
        else:
            ck, (cfg, source) = None, build_config(argv)
        check_config(cfg)
        device = runtime.pick_device(cfg.device)
        runtime.set_threads(cfg.threads)
        data = load_task(cfg.data, with_val=cfg.train.selection == "val")
        if cfg.train.selection == "val" and data.val is None:
            raise ValueError(f"{data.name} has no validation split; set data.val_fraction > 0 or train.selection=test")
        trainer = Trainer(cfg, data, device)
        if ck is not None:
            check_resumed(cfg, config_from_dict(ck["config"]), argv, str(path), ck["step"], trainer.total_steps)
            try:
                trainer.restore(ck)
            except checkpoint.UNFIT as err:
                raise checkpoint.unfit(f"checkpoint {path}", err) from err
    out = path.parent if ck is not None else run_dir(cfg.out, "classify", cfg.task, cfg.model, seed=cfg.seed)
    last = out / "last.pt"
    kept = lambda: (f"{last} (the last evaluation round's) is intact" if last.exists()
                    else "no checkpoint had been written")
    with checkpoint.run_directory(out, ck is not None, kept, "primal_dt.classify"):
        return fit(trainer, data, out, source, resumed=ck is not None)


def main(argv: list[str] | None = None) -> None:
    errors.main(run, argv, expected=(Diverged,))


if __name__ == "__main__":
    main()
