"""How long a training run takes on this device, said early and kept honest.

The paper's hopper-medium recipe (100,000 steps) took 23.5 s per 1,000 steps on the paper's GPU (40
minutes), and measured 1.1 s per step with one thread on this project's shared 2-core CPU (30
hours); a newcomer who types the README's command deserves to know which before waiting. So after
its first steps the trainer measures its own pace here (wall time per step, after ``SKIP`` slow
first steps: allocation, caches, kernel choice), adds what its evaluations will cost (a timed action
of the evaluator's agent at its batch, plus the simulators' steps), prints the projection, and when
the whole recipe would take longer than ``LONG_S`` prints a command with the user's own options that
fits ``BUDGET_S`` at the measured pace. The progress bar's ETA is the same projection, refined by
each evaluation's measured time.

Nothing here draws a random number or changes what the run computes: the timed forward passes run in
eval mode under ``no_grad`` with the random streams forked, and the model's mode is restored.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from primal_dt import presets, train_config

if TYPE_CHECKING:
    from .training import Run

SKIP = 5
"""first steps not timed (allocator, caches, cuDNN/kernel selection make them slow)"""
MEASURE_STEPS, MEASURE_S = 20, 30.0
"""the pace is projected after this many timed steps, or this many seconds of them (at least 3 steps)"""
LONG_S = 3600.0
"""a recipe longer than this here gets the plain warning and a budget command"""
BUDGET_S = 1800.0
"""what the budget command aims at"""
SIM_STEP_S = 1e-4
"""seconds per simulator step of the MuJoCo locomotion tasks: 40-110 us measured for hopper, halfcheetah and
walker2d in a SyncVectorEnv of 20 (one thread, 2-core machine, 2026-11-23); an upper figure"""
EVAL_START_S = 0.7
"""seconds an evaluation spends before its first step (the evaluator's simulator processes): 0.6-0.7 s measured
for hopper evaluations of 1-20 simulators (one thread, 2-core machine, 2026-11-23)"""


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


def periodic_evaluations(first: int, last: int, every: int) -> int:
    """Periodic evaluations at steps in (first, last): the final one covers ``last`` itself."""
    return 0 if every <= 0 or last <= first else (last - 1) // every - first // every


@dataclass
class Costs:
    """Seconds the parts of a run take here: a training step, a simulator evaluation of ``episodes``
    per target, a validation."""

    step_s: float
    act_s: dict[int, float]
    """seconds of one action of the evaluator's agent for that many rows (measured batches)"""
    targets: int
    episode_steps: int
    num_envs: int
    validation_s: float = 0.0
    calibration: float = 1.0
    """measured / estimated seconds of the last simulator evaluation (1 until one has run)"""

    def rollout_s(self, episodes: int) -> float:
        """An evaluation of ``episodes`` per target: the evaluator plays all targets' episodes on
        min(num_envs, jobs) simulators, so ceil(jobs / lanes) rounds of up to ``episode_steps``."""
        if episodes <= 0:
            return 0.0
        jobs = episodes * self.targets
        b = max(1, min(self.num_envs, jobs))
        step_s = self.batch_act_s(b) + b * SIM_STEP_S  # one step of b simulators side by side
        return self.calibration * (EVAL_START_S + math.ceil(jobs / b) * self.episode_steps * step_s)

    def batch_act_s(self, b: int) -> float:
        """An action for ``b`` rows: measured, or the next larger measured batch's (an upper figure:
        an action costs more for more rows), or the largest measured."""
        larger = [k for k in self.act_s if k >= b]
        return self.act_s[min(larger)] if larger else self.act_s[max(self.act_s)]


class Pace:
    """Wall seconds per training step, evaluations excluded, after the first ``SKIP`` steps."""

    def __init__(self, step: int):
        self.start = step + SKIP
        self.t0 = self.last = None
        self.excluded = 0.0
        self.steps = 0

    def tick(self, step: int) -> None:
        """Call after step ``step`` is done (checkpoints and logging included)."""
        now = time.perf_counter()
        if step == self.start:
            self.t0, self.excluded = now, 0.0
        elif self.t0 is not None:
            self.steps, self.last = step - self.start, now

    def exclude(self, seconds: float) -> None:
        """Time the loop spent on something projected separately (evaluation, validation)."""
        if self.t0 is not None:
            self.excluded += seconds

    @property
    def seconds(self) -> float:
        return 0.0 if self.last is None else self.last - self.t0 - self.excluded

    @property
    def ready(self) -> bool:
        return self.steps >= MEASURE_STEPS or (self.steps >= 3 and self.seconds >= MEASURE_S)

    @property
    def step_s(self) -> float:
        return self.seconds / max(self.steps, 1)


def _best_of(fn, repeat: int, warmup: int = 1) -> float:
    """The fastest of ``repeat`` timed calls after ``warmup`` untimed ones."""
    best = math.inf
    for i in range(warmup + repeat):
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            best = min(best, time.perf_counter() - t0)
    return best


def forward_s(model: torch.nn.Module, batch: int, K: int, device: torch.device) -> float:
    """Seconds of one forward pass over ``batch`` segments of K steps (what a validation chunk costs)."""
    cfg = model.cfg
    states = torch.zeros(batch, K, cfg.state_dim, device=device)
    actions = torch.zeros(batch, K, cfg.act_dim, device=device)
    rtg = torch.zeros(batch, K, 1, device=device)
    ts = torch.zeros(batch, K, dtype=torch.long, device=device)
    mask = torch.ones(batch, K, dtype=torch.bool, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            # reading the result back waits for the device
            return _best_of(lambda: float(model(states, actions, rtg, ts, mask)[0].sum()), repeat=2)
    finally:
        model.train(was_training)


def act_s(run: Run, batch: int) -> float:
    """Seconds of one action for ``batch`` rows by the agent the evaluator builds (its engine, after
    K steps of context): what an evaluation pays per environment step besides the simulators."""
    from .agent import Agent

    model, info = run.model, run.info
    was_training = model.training
    try:
        agent = Agent(model, state_mean=info.state_mean, state_std=info.state_std, reward_scale=info.reward_scale,
                      target=info.eval_targets[0], engine=run.cfg.eval.engine)
    except ValueError:  # a model this engine cannot run: the evaluation will say so; time a forward pass
        model.train(was_training)
        return forward_s(model, batch, run.cfg.K, run.device)
    obs, reward = np.zeros((batch, model.cfg.state_dim), np.float32), np.zeros(batch, np.float32)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            agent.reset(batch)
            return _best_of(lambda: agent.act(obs, reward), repeat=3, warmup=run.cfg.K)
    finally:
        model.train(was_training)


def costs(run: Run, step_s: float) -> Costs:
    """The run's costs at the measured training pace: the evaluator's agent timed at each batch its
    evaluations use, a forward pass at the validation's chunk."""
    from .training_validation import CHUNK

    e = run.cfg.eval
    targets = len(run.info.targets)
    c = Costs(step_s=step_s, act_s={}, targets=targets, episode_steps=e.max_steps or run.spec.max_episode_steps,
              num_envs=e.num_envs)
    for episodes in {e.episodes, e.final_episodes} - {0}:
        b = max(1, min(e.num_envs, episodes * targets))
        if b not in c.act_s:
            c.act_s[b] = act_s(run, b)
    if run.validation is not None:
        n = run.validation.segments
        c.validation_s = math.ceil(n / CHUNK) * forward_s(run.model, min(n, CHUNK), run.cfg.K, run.device)
    return c


def remaining_s(run: Run, c: Costs) -> float:
    """Seconds left: training steps, the periodic evaluations and validations still due, the final ones."""
    cfg = run.cfg
    n = periodic_evaluations(run.step, cfg.steps, cfg.eval.every)
    val = c.validation_s if run.validation is not None else 0.0
    return ((cfg.steps - run.step) * c.step_s + n * (c.rollout_s(cfg.eval.episodes) + val)
            + c.rollout_s(cfg.eval.final_episodes) + val)


# -- the budget command ---------------------------------------------------------------------------------
def nice(x: float) -> int:
    """``x`` rounded down to two significant digits (4237 -> 4200), at least 1."""
    if x < 1:
        return 1
    p = 10 ** max(int(math.log10(x)) - 1, 0)
    return max(1, int(x // p) * p)


def budget(run: Run, c: Costs, budget_s: float = BUDGET_S) -> dict:
    """Options that make the run fit ``budget_s`` at the measured costs, as dotted option -> value.

    Training gets what evaluation leaves; evaluation may take at most half: the number of periodic
    evaluations is kept if it fits (their cadence scaled with the steps), else fewer, and the final
    evaluation's episodes are cut only when it alone would take more than half. The warm-up and the
    step checkpoints keep their share of the run."""
    cfg, e = run.cfg, run.cfg.eval
    val = c.validation_s if run.validation is not None else 0.0
    final = e.final_episodes
    while final > 1 and c.rollout_s(final) + val > budget_s / 2:
        final = max(1, final // 2)
    final_s = c.rollout_s(final) + val
    each = c.rollout_s(e.episodes) + val
    n = periodic_evaluations(0, cfg.steps, e.every)
    if each > 0:
        n = min(n, max(0, int((budget_s / 2 - final_s) // each)))
    steps = min(cfg.steps, nice(max(budget_s - final_s - n * each, 0.0) / max(c.step_s, 1e-9)))
    out = {"steps": steps, "warmup_steps": round(cfg.warmup_steps * steps / cfg.steps)}
    if e.every > 0:
        out["eval.every"] = max(1, steps // (n + 1)) if n else 0
    if cfg.checkpoint_every > 0:
        out["checkpoint_every"] = max(1, round(cfg.checkpoint_every * steps / cfg.steps))
    if final != e.final_episodes:
        out["eval.final_episodes"] = final
    return out


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (tuple, list)):
        return ",".join(_value(x) for x in v)
    return repr(v) if isinstance(v, float) else str(v)


def cpu_recipe(run: Run) -> str | None:
    """The CPU preset of the run's dataset (``configs/dt/<env>-cpu.yaml``) for a new run on a CPU that is
    not already using it; None otherwise."""
    name = f"{run.cfg.env}-cpu"
    if run.device.type != "cpu" or run.cfg.resume or run.cfg.preset == name:
        return None
    return name if name in presets.list_presets(train_config.GROUP) else None


def command(run: Run, options: dict, preset: str | None = None) -> str:
    """The command that ran this run, with ``options`` in place of its own values: the options the
    user gave (on the command line) are kept, defaults and the preset's stay implicit (a resumed run's
    are ``resume=`` and the run-time options given with it). With ``preset``, the options that preset
    sets are left to it."""
    launcher = (f"torchrun --nproc_per_node {run.dist.world} -m primal_dt.train" if run.dist.world > 1
                else "python -m primal_dt.train")
    values = train_config.flat(dataclasses.asdict(run.cfg))
    recipe = train_config.flat({k: v for k, v in presets.load_preset(train_config.GROUP, preset).items()
                                if k not in presets.META_KEYS}) if preset else {}
    given = {k: values[k] for k, where in run.built.provenance.items()
             if where == "command line" and k in values and k not in recipe}
    given.update(options)
    return " ".join([launcher, *(shlex.quote(f"{k}={_value(v)}") for k, v in given.items())])


# -- what the run says ------------------------------------------------------------------------------------
def projection(run: Run, c: Costs, start: int) -> str:
    """The projection of the run from step ``start`` (where this process began it) to its end, and for
    a recipe longer than ``LONG_S`` here, the plain warning and a budget command."""
    cfg, e = run.cfg, run.cfg.eval
    left = cfg.steps - start
    train_s = left * c.step_s
    n = periodic_evaluations(start, cfg.steps, e.every)
    sim_s = n * c.rollout_s(e.episodes) + c.rollout_s(e.final_episodes)
    val_s = (n + 1) * c.validation_s if run.validation is not None else 0.0
    total = train_s + sim_s + val_s
    threads = torch.get_num_threads()
    where = f"{run.device}" + (f", {threads} thread{'s' * (threads > 1)}" if run.device.type == "cpu" else "")
    parts = [f"{left:,} {'remaining ' if start else ''}steps x {c.step_s * 1e3:.1f} ms = {duration(train_s)}"]
    if sim_s:
        parts.append(f"simulator evaluation up to {duration(sim_s)} ({n} x {e.episodes} + {e.final_episodes} episodes "
                     f"per target, {c.targets} targets, up to {c.episode_steps} steps each)")
    if val_s:
        parts.append(f"validation {duration(val_s)}")
    lines = [f"time on {where}, measured over {run.step - start - SKIP} steps: " + ", ".join(parts)
             + f"; about {duration(total)} in all"]
    cpu = cpu_recipe(run)
    if total > LONG_S and cpu:
        lines.append(f"note: this recipe takes about {duration(total)} on this device, hours, not minutes. The "
                     f"CPU recipe for {cfg.env} (configs/dt/{cpu}.yaml, chosen to learn in one run of at most "
                     f"{BUDGET_S / 60:.0f} minutes on one core) is:\n  {command(run, {'preset': cpu}, cpu)}")
    elif total > LONG_S:
        fit = budget(run, c)
        if cfg.resume:  # a resumed run can change its steps only: it stops after the budget's worth more
            fit = {"steps": start + fit["steps"]}
        lines.append(f"note: this recipe takes about {duration(total)} on this device, hours, not minutes. To see "
                     f"results in about {BUDGET_S / 60:.0f} minutes here, run it shorter (same options, steps and cadences "
                     f"scaled):\n  {command(run, fit)}")
        if cfg.checkpoint_minutes > 0:
            lines.append(f"  This run writes last.pt every {cfg.checkpoint_minutes:g} minutes: once it has, stop it "
                         f"any time and continue with: python -m primal_dt.train resume={run.out}")
    return "\n".join(lines)


class Timer:
    """The trainer's clock: its pace, the costs measured once the pace is known (rank 0), and each
    evaluation's and validation's measured time, which replace the estimates as they come."""

    def __init__(self, run: Run):
        self.run = run
        self.pace = Pace(run.step)
        self.costs: Costs | None = None
        self.measured_eval: tuple[float, int] | None = None
        self.measured_val: float | None = None

    def tick(self) -> str | None:
        """After each step: the projection, once, when the pace is first known (rank 0), else None."""
        self.pace.tick(self.run.step)
        if self.costs is not None:
            self.costs.step_s = self.pace.step_s
            return None
        if not (self.pace.ready and self.run.dist.main):
            return None
        t0 = time.perf_counter()
        self.costs = costs(self.run, self.pace.step_s)
        self._apply_measurements()
        self.pace.exclude(time.perf_counter() - t0)
        return projection(self.run, self.costs, self.pace.start - SKIP)

    def exclude(self, seconds: float) -> None:
        self.pace.exclude(seconds)

    def evaluated(self, seconds: float, episodes: int) -> None:
        """A simulator evaluation of ``episodes`` per target took ``seconds``."""
        self.measured_eval = (seconds, episodes)
        self._apply_measurements()

    def validated(self, seconds: float) -> None:
        self.measured_val = seconds
        self._apply_measurements()

    def _apply_measurements(self) -> None:
        c = self.costs
        if c is None:
            return
        if self.measured_eval is not None:
            seconds, episodes = self.measured_eval
            estimate = c.rollout_s(episodes) / c.calibration
            c.calibration = seconds / estimate if estimate > 0 else 1.0
        if self.measured_val is not None:
            c.validation_s = self.measured_val

    def eta(self) -> str | None:
        """Time left (training, evaluations and validations still due), once the pace is known."""
        return None if self.costs is None else duration(remaining_s(self.run, self.costs))
