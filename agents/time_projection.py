"""How long a DT training run takes, measured on the run itself, never assumed; and, for a recipe of hours on a
CPU, the command line that runs the CPU recipe instead.

The trainer prints the projection once, when its pace is first known, and shows the time left on its progress
bar; both come from ``Clock``. The rebuilt command keeps the options the user typed (``Built.provenance``) and
leaves those the recipe sets to it, so the line can be pasted as it is.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import time

import torch

from primal_dt.run import presets

from . import train_config
from .train_config import Built

SKIP, MEASURE_STEPS, MEASURE_S = 5, 20, 30.0
"""the first steps are slow (allocation, caches, kernel choice) and not timed; the pace is known after
MEASURE_STEPS timed steps, or MEASURE_S seconds of at least 3"""
LONG_S = 3600.0
"""a run whose training alone takes longer is told so"""


class Clock:
    """A run's pace (seconds per step after ``SKIP`` steps, evaluations excluded) and the last evaluation's
    time: what the projection and the bar's time left use. ``built``: the run's options (resumed: as
    resumed); ``targets``: how many return targets each evaluation plays; ``step``: the step the run starts at;
    ``main``: whether this process says the projection (rank 0)."""

    def __init__(self, built: Built, device: torch.device, targets: int, step: int, main: bool = True):
        self.built, self.device, self.targets, self.main = built, device, targets, main
        self.start = step + SKIP
        self.t0, self.excluded, self.step_s, self.eval_s = None, 0.0, None, 0.0

    def exclude(self, seconds: float) -> None:  # an evaluation (and validation): not training, the next one's time
        self.excluded, self.eval_s = self.excluded + seconds, seconds

    def tick(self, step: int) -> str | None:
        """After each step (``step``: the steps taken); returns the projection once, when the pace is first known
        (``main`` only). On a GPU the first measurement waits for the device at both ends: a step is queued, not
        run, when the host returns (later, the periodic read-backs keep the host's pace that of the device)."""
        n, first = step - self.start, self.step_s is None
        if n == 0:
            self.t0, self.excluded = self._now(), 0.0
        if self.t0 is None or n <= 0:
            return None
        seconds = time.perf_counter() - self.t0 - self.excluded
        if first and n < MEASURE_STEPS and not (n >= 3 and seconds >= MEASURE_S):
            return None
        self.step_s = ((self._now() - self.t0 - self.excluded) if first else seconds) / n
        return projection(self.built, self.device, self.step_s, self.start - SKIP, n) if first and self.main else None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def eta(self, step: int) -> str | None:
        """Time left after ``step`` steps: the steps at the pace, and the evaluations still due at the last one's
        time."""
        if self.step_s is None:
            return None
        cfg, e = self.built.cfg, self.built.cfg.eval
        due = 0 if e.every <= 0 else (cfg.steps - 1) // e.every - step // e.every
        rounds = [math.ceil(n * self.targets / e.num_envs) for n in (e.final_episodes, e.episodes)]
        return duration((cfg.steps - step) * self.step_s + self.eval_s * (due + rounds[0] / rounds[1]))


def projection(built: Built, device: torch.device, step_s: float, start: int, measured: int) -> str:
    """The training time left at the measured pace (``step_s`` seconds a step over ``measured`` steps, the run
    having started at step ``start``); a recipe of hours is told so (on a CPU: the CPU recipe)."""
    cfg, threads, left = built.cfg, torch.get_num_threads(), built.cfg.steps - start
    where = f"{device}" + (f", {threads} thread{'s' * (threads > 1)}" if device.type == "cpu" else "")
    text = (f"time on {where}, measured over {measured} steps: {left:,} {'remaining ' if start else ''}steps x "
            f"{step_s * 1e3:.1f} ms = {duration(left * step_s)} of training; evaluations and validations are "
            "timed as they run (the progress bar's eta includes them)")
    if left * step_s > LONG_S:
        text += (f"\nnote: this recipe takes about {duration(left * step_s)} on this device, hours, not minutes. "
                 "Ctrl-C stops it with a checkpoint (and prints the resume= command that continues it).")
        if device.type == "cpu" and not cfg.resume and cfg.recipe != "cpu":
            text += (" To learn in minutes on a CPU, stop it and run the CPU recipe instead (configs/dt/recipes/"
                     f"cpu.yaml; its time per kind of CPU: docs/cpu.md#the-cpu-recipe):\n  {cpu_recipe_command(built)}")
    return text


def duration(seconds: float) -> str:
    """45s, 4m05s, 11h52m; <1s for what is more than nothing."""
    s = round(max(seconds, 0.0))
    if s == 0 and seconds > 0:
        return "<1s"
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def cpu_recipe_command(built: Built) -> str:
    """The command of the run ``built`` describes with ``recipe=cpu``: its command line's options kept, except
    those the recipe sets."""
    values = train_config.flat(dataclasses.asdict(built.cfg))
    recipe = train_config.load_recipe("cpu")
    laid = train_config.flat({k: v for k, v in recipe.items() if k not in (*presets.META_KEYS, "models")})
    laid |= train_config.flat(train_config.model_section(recipe, built.cfg.model.name, bool(built.cfg.model.layers)))
    given = {k: values[k] for k, where in built.provenance.items()
             if where == "command line" and k in values and k not in laid} | {"recipe": "cpu"}

    def text(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (tuple, list)):
            return ",".join(text(x) for x in v)
        return repr(v) if isinstance(v, float) else str(v)

    return " ".join(["python -m primal_dt.train", *(shlex.quote(f"{k}={text(v)}") for k, v in given.items())])
