"""Configuration of ``python -m primal_dt.classify``: dataclasses, task presets, checks.

``task`` names a preset (configs/uea/*.yaml, configs/lra/*.yaml), ``model`` a layout or any attention mechanism
(``attention=NAME`` is short for ``model=NAME``). Precedence: defaults < preset < the preset's ``by_model.<model>``
section < command line; a resumed run starts from its checkpoint's config instead. Everything that can be
wrong with the input is checked here, before any data is loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from .run import cli, presets
from .run.errors import did_you_mean
from .run.options import AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, RunOptions, check_numbers, check_size
from .run.options import as_words, attention_options as parse_attention_options
from .tasks import DataConfig

GROUPS = ("uea", "lra")
SELECTIONS = {  # train.selection: which accuracy a run reports
    "val": "test accuracy of the checkpoint with the best validation accuracy (ties: lower validation loss)",
    "test": "best test accuracy during training (the reference code's protocol: selection on test)",
    "last": "test accuracy of the final model",
}
SHORTHANDS = {"attention": "model"}
PROG = "python -m primal_dt.classify"
DESCRIPTION = "Train and evaluate a sequence classifier (UEA time series, LRA) on the attention core."


@dataclass
class ArchConfig:
    """The classifier's transformer."""

    d_model: int = 64
    """width of every token embedding and layer"""
    n_heads: int = 2
    """attention heads per layer (d_model must be divisible by it)"""
    layers: int = 2
    """transformer blocks"""
    d_ff: int = 128
    """MLP hidden width"""
    dropout: float = 0.1
    """dropout of embeddings, attention outputs and MLPs"""
    norm: Literal["pre", "post"] = "pre"
    """layer norm placement"""
    activation: Literal["relu", "gelu"] = "gelu"
    """MLP activation"""
    head: Literal["auto", "flatten", "mean", "pair"] = "auto"
    """auto: flatten for UEA, pair for Retrieval, mean otherwise"""


@dataclass
class PrimalConfig:
    """Options of the primal layers, and the KSVD weight eta (used when the stack has any)."""

    s: int = 20
    """projection directions per head"""
    eta: float = 0.1
    """weight of the KSVD regulariser"""
    data_dependent: bool = True
    """projection weights built from a subset of the input rows (the paper's PrimalFormer) rather than learned"""
    rank_multi: int = 10
    """data-dependent form: rows used = min(s * rank_multi, sequence length)"""


@dataclass
class OptimConfig:
    """Optimisation and model selection (``train.*``)."""

    epochs: int = 0
    """passes over the training set (UEA); exactly one of epochs / steps must be > 0"""
    steps: int = 0
    """optimizer steps (LRA)"""
    batch_size: int = 32
    """examples per optimizer step"""
    eval_batch_size: int = 0
    """0: same as batch_size"""
    optimizer: Literal["adamw", "adam", "radam"] = "adamw"
    """the optimizer"""
    lr: float = 1e-4
    """learning rate (peak, for onecycle-linear)"""
    weight_decay: float = 0.0
    """decoupled weight decay (adamw) or L2 (adam, radam)"""
    schedule: Literal["constant", "onecycle-linear"] = "constant"
    """onecycle-linear: linear warm-up over `warmup` steps, then linear decay to 0"""
    warmup: int = 0
    """warm-up steps of onecycle-linear"""
    grad_clip: float = 0.0
    """max gradient norm (0: off)"""
    eval_every: int = 0
    """evaluate every this many steps (0: once per epoch)"""
    selection: Literal["val", "test", "last"] = "val"
    """which accuracy is reported: val (test accuracy of the best validation checkpoint) | test (best test
    accuracy, the reference code's protocol) | last (the final model's)"""


@dataclass
class ClassifyConfig(RunOptions):
    task: str = "uea/JapaneseVowels-fast"
    """preset name: uea/<Set>[-fast] or lra/<task>[-fast]"""
    model: str = "transformer"
    """transformer | primalformer | primal+trans | primal+<mechanism> | any attention mechanism"""
    data: DataConfig = field(default_factory=DataConfig)
    arch: ArchConfig = field(default_factory=ArchConfig)
    primal: PrimalConfig = field(default_factory=PrimalConfig)
    attention_options: tuple[str, ...] = ()
    """mechanism constructor options as mechanism.option=value, e.g. softmax.window=64,linear.chunk=32"""
    train: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self):
        self.attention_options = as_words(self.attention_options)


def build_config(argv: list[str], prog: str = PROG) -> tuple[ClassifyConfig, str]:
    """(config, preset source line) from the command line over the preset layers (``prog``: named in errors)."""
    first = cli.peek(ClassifyConfig, argv, SHORTHANDS, prog)
    names = [f"{g}/{n}" for g in GROUPS for n in presets.list_presets(g)]
    if first.task not in names:
        hint = did_you_mean(first.task, names, cutoff=0.5)
        raise ValueError(f"unknown task {first.task!r}.{hint} Available: {', '.join(names)}")
    values = presets.load_preset(*first.task.split("/", 1))
    by_model = values.pop("by_model", {}) or {}
    if not (isinstance(by_model, dict) and all(isinstance(v, dict) for v in by_model.values())):
        raise ValueError(f"preset {first.task}: by_model must map model names to mappings of options, got "
                         f"{repr(by_model)[:60]}")
    cfg = presets.apply_preset(ClassifyConfig(), {**values, "task": first.task}, where=f"preset {first.task}")
    model = first.model if "model" in cli.given(ClassifyConfig, argv, SHORTHANDS) else cfg.model
    if model in by_model:
        cfg = presets.apply_preset(cfg, by_model[model], where=f"preset {first.task} by_model.{model}")
    cfg = cli.parse(ClassifyConfig, argv, default=cfg, prog=prog, description=DESCRIPTION, shorthands=SHORTHANDS)
    return cfg, str(values.get("source", "(no source line)"))


def config_from_dict(d: dict) -> ClassifyConfig:
    return presets.apply_preset(ClassifyConfig(), d, where="checkpoint config")


RESUMABLE = ("threads", "device", "progress", "tensorboard", "resume", "out", "data.path", "data.generate",
             "train.steps", "train.epochs", "train.eval_every", "train.eval_batch_size")
"""what a resumed run may change (moved or generated data; more steps or epochs); the rest comes from the checkpoint"""


def check_resumed(cfg: ClassifyConfig, saved: ClassifyConfig, argv: list[str], where: str, step: int,
                  total: int) -> None:
    """Options the command line changes on resume: ``RESUMABLE`` only, a onecycle schedule's length never (it is laid
    out for the run's steps), and no fewer steps than the checkpoint has taken (``total``: the steps now asked)."""
    asked, was = presets.flat(dataclasses.asdict(cfg)), presets.flat(dataclasses.asdict(saved))
    presets.refuse_changes(asked, was, cli.given(ClassifyConfig, argv, SHORTHANDS), RESUMABLE, where)
    t, s = cfg.train, saved.train
    if t.schedule == "onecycle-linear" and (t.steps, t.epochs) != (s.steps, s.epochs):
        raise ValueError(f"checkpoint {where} follows a onecycle-linear schedule laid out for train.steps={s.steps}, "
                         f"train.epochs={s.epochs}; it cannot be lengthened or shortened: resume without them, or "
                         "start a new run")
    if total < step:
        raise ValueError(f"checkpoint {where} has taken {step} steps, more than the {total} asked for; resume with "
                         "more train.steps / train.epochs")


def attention_options(cfg: ClassifyConfig) -> dict:
    """Per-mechanism constructor options: ``attention_options``, with ``primal.*`` for primal layers."""
    p = cfg.primal
    return parse_attention_options(cfg.attention_options, "attention_options",
                                   {"primal": {"s": p.s, "data_dependent": p.data_dependent,
                                               "rank_multi": p.rank_multi}})


NUMBERS = {
    **dict.fromkeys(("arch.d_model", "arch.n_heads", "arch.layers", "arch.d_ff"), AT_LEAST_1), "arch.dropout": FRACTION,
    "primal.s": AT_LEAST_1, "primal.eta": AT_LEAST_0, "primal.rank_multi": AT_LEAST_1,
    "train.epochs": AT_LEAST_0, "train.steps": AT_LEAST_0, "train.batch_size": AT_LEAST_1,
    "train.eval_batch_size": AT_LEAST_0, "train.lr": POSITIVE, "train.weight_decay": AT_LEAST_0,
    "train.warmup": AT_LEAST_0, "train.grad_clip": AT_LEAST_0, "train.eval_every": AT_LEAST_0,
}
"""numeric options outside ``data.*`` and the run options (their dataclasses' own ``check``)"""


def check_config(cfg: ClassifyConfig) -> None:
    """Raise ValueError naming the option, its value and what is allowed."""
    t, a = cfg.train, cfg.arch
    RunOptions.check(cfg)
    check_numbers(cfg, NUMBERS)
    if a.d_model % a.n_heads:
        raise ValueError(f"arch.d_model={a.d_model} must be divisible by arch.n_heads={a.n_heads}")
    check_size(a.layers * (4 * a.d_model ** 2 + 2 * a.d_model * a.d_ff) + cfg.data.max_len * a.d_model,
               f"arch.layers={a.layers}, arch.d_model={a.d_model}, arch.d_ff={a.d_ff} and "
               f"data.max_len={cfg.data.max_len}")
    check_size(t.batch_size * max(cfg.data.max_len, 1) * a.d_model * a.layers * 8,
               f"train.batch_size={t.batch_size}, data.max_len={cfg.data.max_len}, arch.d_model={a.d_model} and "
               f"arch.layers={a.layers}", "activation values in one training step")
    if (t.epochs > 0) == (t.steps > 0):
        raise ValueError(f"set exactly one of train.epochs / train.steps > 0 (got epochs={t.epochs}, steps={t.steps})")
    attention_options(cfg)
    cfg.data.check()

