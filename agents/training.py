"""Train a Decision Transformer on an offline dataset: what ``python -m primal_dt.train`` runs.

    summary = train(train_config.build(argv), evaluator)

It reads top to bottom: ``prepare`` (config, resume, data, model, optimizer: everything that can
fail on bad input, before the first step and before anything is written), then ``train``: claim
the run directory (created exclusively, so runs started together never share one), the loop
(sample a batch, one optimisation step, log, evaluate, checkpoint), then the summary. Around it:
``training_checkpoint`` (the DT checkpoint through ``agents.dt_checkpoint``, random streams, exact
resume) and ``training_log`` (TensorBoard, progress, summary files).

A write that fails (disk full, a file-size limit, an unwritable directory) ends the run with one
``WriteError`` naming the file, what was not written, and the last checkpoint, which is intact.

Rolling the model out in the simulator is ``eval``'s code, which sits above ``agents``; the entry
point hands it in as an ``Evaluator``. Training is deterministic on CPU for a given seed and config,
and a resumed run continues exactly where its checkpoint left it.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import envs
from primal_dt import checkpoint as ck_io
from primal_dt import lock, runtime, train_config
from primal_dt.monitor import EpisodeBar, RunMonitor, run_dir
from primal_dt.runtime import Dist, SetupError, WriteError
from primal_dt.train_config import Built, TrainConfig

from . import dt_checkpoint, stream_training, training_checkpoint, training_log, training_time
from .decision_transformer import DecisionTransformer, DTConfig, dt_loss
from .dt_checkpoint import DataInfo
from .training_validation import Validation


class Diverged(RuntimeError):
    """The loss or gradient became NaN/inf; the last good checkpoint is kept."""


@dataclass(frozen=True)
class Evaluator:
    """How the trainer rolls its model out in the simulator (the entry point builds it from
    ``eval.rollout``, which ``agents`` may not import).

    ``rollout(model, data, episodes, seed, settings, on_episode)`` plays ``episodes`` episodes per
    target in ``data.targets`` (``data``: the run's ``DataInfo``; ``settings``: its ``EvalConfig``;
    ``on_episode(n)``: called as ``n`` episodes end, for the progress bar) and returns {target:
    {"normalized_mean", "normalized_std", "return_mean", "return_std", "length_mean", "returns", ...}};
    ``line(results)`` says them in one line for the log.
    """

    rollout: Callable[..., dict]
    line: Callable[[dict], str]


@dataclass
class Run:
    """A training run: what ``prepare`` built, and the progress the loop advances."""

    cfg: TrainConfig
    built: Built
    spec: envs.EnvSpec
    data: envs.Trajectories
    """the whole dataset as loaded (its identity); training samples only the episodes not in ``info.held_out``"""
    info: DataInfo
    """what the checkpoint and the evaluator need to know about the data (statistics of the training episodes,
    held-out episodes, targets, scale)"""
    sampler: envs.SegmentSampler
    model: DecisionTransformer
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    out: Path | None
    """the run directory: a resumed run's own; a new run's is claimed when training starts (``open_run_dir``)"""
    device: torch.device
    dist: Dist
    validation: Validation | None = None
    """the held-out episodes' fixed segments (None: val_fraction=0)"""
    step: int = 0
    train_time: float = 0.0
    """seconds inside optimisation steps (no evaluation, no logging)"""
    history: dict = field(default_factory=dict)
    """logged evaluation curves, kept in the checkpoint so a resumed run draws them whole"""


# -- prepare: everything that can fail on bad input -------------------------------------------------
def prepare(built: Built, d: Dist | None = None) -> Run:
    """Config (resumed or new), data, model and optimizer; bad input raises ``SetupError`` before a
    file is written. The order of random draws is part of the contract: same seed, same run."""
    with runtime.setup_errors():
        built, resume = resumed_config(built)
        cfg = built.cfg
        train_config.check(cfg)
        spec = env_spec(cfg.env)
        if cfg.eval.every > 0 or cfg.eval.final_episodes > 0:  # evaluation will build simulators: fail now, not at it
            envs.check_mujoco_gl()
        d = d or runtime.init_distributed(cfg.device)
        if cfg.batch_size % d.world:
            raise SetupError(f"batch_size={cfg.batch_size} must be divisible by the {d.world} processes")
        device = runtime.pick_device(cfg.device, d)
        runtime.set_threads(cfg.threads)
        runtime.seed_torch(cfg.seed)
        model = build_model(cfg, spec.obs_dim, spec.act_dim)  # bad options raise here
        data = envs.load_dataset(cfg.env, source=cfg.data_source, verbose=d.main, clip_actions=cfg.data_clip_actions)
        if resume is not None:  # the data must be what the checkpoint was trained on
            dt_checkpoint.check_data(resume[1].data, data, resume[1].origin)
        dims = (data.observations.shape[1], data.actions.shape[1])
        if dims != (spec.obs_dim, spec.act_dim):  # e.g. Minari (v5) data observing differently
            runtime.seed_torch(cfg.seed)
            model = build_model(cfg, *dims)
        model = model.to(device)
        if d.world > 1:  # same initial weights everywhere (DDP also broadcasts them), own dropout masks per rank
            runtime.seed_torch(cfg.seed + 1000 * d.rank)
        opt, sched = build_optimizer(model, cfg)
        train_eps, held_out = hold_out(cfg, data, resume[1] if resume else None)
    trained = data.subset(train_eps) if len(held_out) else data  # statistics of the training episodes only
    # returns-to-go are divided by reward_scale, in the sampler as in the checkpoint and the agent
    sampler = envs.SegmentSampler(trained, cfg.K, cfg.batch_size // d.world, cfg.reward_scale, cfg.max_timestep,
                                  cfg.seed + 1000 * d.rank)
    targets = tuple(float(t) for t in (cfg.eval.targets or spec.targets))
    info = DataInfo(env=cfg.env, state_mean=trained.state_mean, state_std=trained.state_std,
                    reward_scale=cfg.reward_scale, targets=targets, gym_id=getattr(data, "gym_id", spec.gym_id),
                    source=data.source, fingerprint=data.fingerprint, held_out=tuple(held_out.tolist()))
    validation = None
    if len(held_out) and d.main:
        reach = stream_training.receptive_field(model.cfg) if cfg.stream_window else None
        validation = Validation(data.subset(held_out), info, cfg.K, cfg.max_timestep, cfg.seed, device, reach)
    run = Run(cfg, built, spec, data, info, sampler, model, opt, sched, resume[0].parent if resume else None, device, d,
              validation)
    if resume is not None:
        training_checkpoint.restore(run, resume[1])
    return run


def resumed_config(built: Built) -> tuple[Built, tuple[Path, dt_checkpoint.DTCheckpoint] | None]:
    """With ``resume=``: the checkpoint's config plus the run-time options given now, and (path,
    checkpoint); otherwise the config as built and None."""
    if not built.cfg.resume:
        return built, None
    path = runtime.resume_checkpoint(built.cfg.resume, dt_checkpoint.FILENAME)
    ck = dt_checkpoint.load(path)
    if ck.training is None:
        raise SetupError(f"checkpoint {path} holds no training state (optimizer, random streams, step), so it "
                         "cannot be resumed; start a new run")
    # a run from before validation existed trained on every episode: it continues so
    saved = {"val_fraction": 0.0, **ck.config}
    return train_config.resumed(built, saved, str(path)), (path, ck)


def hold_out(cfg: TrainConfig, data: envs.Trajectories, resumed: dt_checkpoint.DTCheckpoint | None):
    """(training episodes, held-out episodes) for ``val_fraction``, drawn by the run's seed; a resumed
    run recomputes its split and checks it against the one its checkpoint recorded."""
    if cfg.val_fraction == 0:
        train, held = np.arange(len(data)), np.zeros(0, dtype=np.int64)
    else:
        try:
            train, held = data.hold_out(cfg.val_fraction, cfg.seed)
        except envs.DatasetError as err:
            raise ValueError(f"val_fraction={cfg.val_fraction:g} holds out whole episodes for validation: {err}. Set "
                             "val_fraction=0 to train on every episode (no validation)") from err
    if resumed is not None and tuple(held.tolist()) != resumed.data.held_out:
        raise ValueError(f"{resumed.origin} held out episodes {_few(resumed.data.held_out)} for validation, but the "
                         f"split recomputed from seed={cfg.seed} and val_fraction={cfg.val_fraction:g} holds out "
                         f"{_few(held.tolist())}: this release splits differently, so the run cannot continue "
                         "exactly; start a new run")
    return train, held


def _few(xs) -> str:
    xs = list(xs)
    return f"[{', '.join(map(str, xs[:8]))}{', ...' if len(xs) > 8 else ''}] ({len(xs)})"


def env_spec(name: str) -> envs.EnvSpec:
    try:
        return envs.get_spec(name)
    except (KeyError, ValueError) as err:
        raise SetupError(f"env: {err.args[0] if err.args else err}") from err


def model_config(cfg: TrainConfig, state_dim: int, act_dim: int) -> DTConfig:
    """The network ``cfg`` describes, for data with these dimensions (stream-exact: every layer windowed)."""
    m = cfg.model
    mc = DTConfig(state_dim=state_dim, act_dim=act_dim, K=cfg.K, d_model=m.d_model, n_heads=m.n_heads,
                  n_layers=m.n_layers, layout=m.name, layers=train_config.layer_names(m),
                  options=train_config.attention_options(m), dropout=m.dropout, activation=m.activation,
                  mlp_ratio=m.mlp_ratio, max_timestep=cfg.max_timestep)
    if cfg.stream_window:
        mc = stream_training.stream_exact_config(mc, cfg.stream_window)
        need = stream_training.min_segment_steps(mc)
        if cfg.K < need:
            raise ValueError(f"stream_window={cfg.stream_window} over {len(mc.layer_specs())} layers reaches "
                             f"{stream_training.receptive_field(mc)} tokens back, so K must be >= {need} for any "
                             f"step of a segment to count; got K={cfg.K}. Raise K or lower stream_window")
    return mc


def build_model(cfg: TrainConfig, state_dim: int, act_dim: int) -> DecisionTransformer:
    """The network, or a ValueError that names the model options: a mechanism's own check speaks of
    its constructor arguments (``s=40 ... exceed d_model=32``), which the user wrote as ``model.*``."""
    try:
        return DecisionTransformer(model_config(cfg, state_dim, act_dim))
    except ValueError as err:
        m = cfg.model
        raise ValueError(f"model options (model.name={m.name}, model.layers={m.layers or '-'}, "
                         f"model.d_model={m.d_model}, model.n_heads={m.n_heads}, model.s={m.s}, model.attention_options="
                         f"{m.attention_options or '-'}, K={cfg.K}, stream_window={cfg.stream_window}): {err}") from err


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """AdamW with linear warm-up to ``lr`` over ``warmup_steps``, then constant (the DT recipe)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    w = cfg.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / w) if w else 1.0)
    return opt, sched


# -- one step -----------------------------------------------------------------------------------------
def train_step(net, params, opt, sched, batch: dict, eta: float, grad_clip: float, detail: bool = False,
               world: int = 1):
    """One optimisation step; returns (loss, grad norm, parts) without stepping on NaN/inf.

    The finiteness check uses the loss (averaged over processes under DDP, so every process takes
    the same decision) and the gradient norm (identical on every process after DDP's all-reduce).
    """
    loss, parts = dt_loss(net, batch, eta, detail)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    stat = loss.detach().reshape(1)
    if world > 1:
        stat = stat.clone()
        dist.all_reduce(stat)
        stat /= world
    loss_value = float(stat)
    if not (math.isfinite(loss_value) and math.isfinite(float(gn))):
        return loss_value, float(gn), parts
    opt.step()
    sched.step()
    return loss_value, float(gn), parts


def next_batch(run: Run, reach: int | None) -> dict:
    """The sampler's next batch on the run's device; stream-exact runs count only the steps whose
    ``reach`` tokens of history lie inside their segment."""
    batch = {k: v.to(run.device, non_blocking=True) for k, v in run.sampler.sample().items()}
    if reach is not None:
        batch["loss_mask"] = stream_training.stream_exact_loss_mask(batch["timesteps"], batch["mask"], reach)
    return batch


# -- the run directory --------------------------------------------------------------------------------
def open_run_dir(run: Run) -> None:
    """Give a new run its directory (rank 0 creates it exclusively, the others learn its name), or
    check a resumed run's is writable; rank 0 holds it (``lock``: a second process resuming the same
    run is refused, naming this one); then remove temporary files that killed writes (checkpoints,
    summaries, plots) left behind (in a resumed run's directory, or its siblings' for a new run), so
    they do not pile up. Before any training step, so an unwritable ``out`` costs nothing."""
    cfg, d = run.cfg, run.dist
    if run.out is None:
        name = [str(run_dir(cfg.out, cfg.env, training_log.model_label(cfg), seed=cfg.seed)) if d.main else None]
        if d.world > 1:
            torch.distributed.broadcast_object_list(name, src=0)
        run.out = Path(name[0])
        if d.main:
            lock.hold(run.out)
        stale = ck_io.remove_stale_temps(*run.out.parent.iterdir()) if d.main else []
    else:
        if d.main:
            runtime.check_writable(run.out, "run directory")
            lock.hold(run.out)
        stale = ck_io.remove_stale_temps(run.out, own=True) if d.main else []
    if stale:
        print(f"removed {len(stale)} temporary file(s) of interrupted writes: "
              f"{', '.join(map(str, stale))}", file=sys.stderr, flush=True)


def kept(run: Run) -> str:
    """What survives a failure: the last checkpoint (never overwritten by a failed write) and how to go on."""
    last = run.out / dt_checkpoint.FILENAME
    if not last.exists():
        return "no checkpoint had been written yet"
    try:
        return f"the last good checkpoint {last} (step {dt_checkpoint.load(last).step}) is intact"
    except (ValueError, FileNotFoundError) as err:
        return f"the last checkpoint {last} cannot be read ({err})"


# -- the run ------------------------------------------------------------------------------------------
def train(built: Built, evaluator: Evaluator, d: Dist | None = None) -> dict:
    """Prepare, train to ``cfg.steps`` (evaluating and checkpointing on the way), evaluate at the
    end; returns the summary (also in ``summary.json``)."""
    run = prepare(built, d)
    open_run_dir(run)
    try:
        return _train(run, evaluator)
    except WriteError as err:
        raise WriteError(f"{err}. Nothing else was lost: {kept(run)}; make room (or fix the permissions) and "
                         f"continue with: python -m primal_dt.train resume={run.out}") from err
    finally:
        lock.release(run.out)


def _train(run: Run, evaluator: Evaluator) -> dict:
    cfg, d = run.cfg, run.dist
    params = list(run.model.parameters())
    net = run.model
    if d.world > 1:
        net = torch.nn.parallel.DistributedDataParallel(
            run.model, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    if d.main:
        print(training_log.announcement(run), flush=True)
    mon = training_log.open_monitor(run)
    last_score, last_val = training_log.last_eval(mon), training_log.last_validation(mon)
    reach = stream_training.receptive_field(run.model.cfg) if cfg.stream_window else None
    speed = training_log.Throughput()
    clock = training_checkpoint.WallClock(cfg.checkpoint_minutes, run)
    timer = training_time.Timer(run)
    try:
        with _terminate_as_interrupt():
            while run.step < cfg.steps:
                logging = _due(run.step + 1, cfg.log_every)
                batch = next_batch(run, reach)
                t0 = time.perf_counter()
                loss, gn, parts = train_step(net, params, run.opt, run.sched, batch, cfg.eta, cfg.grad_clip, logging,
                                             d.world)
                dt = time.perf_counter() - t0  # train_step reads the loss back, so the device is synchronised
                if not (math.isfinite(loss) and math.isfinite(gn)):
                    diverged(run, mon, loss, gn, parts)
                run.step += 1
                run.train_time += dt
                speed.add(dt, 3 * int(batch["mask"].sum()) * d.world)
                if logging:
                    training_log.log_step(run, mon, loss, gn, parts, speed.take())
                if _due(run.step, cfg.eval.every) and run.step < cfg.steps:  # the final one covers the last step
                    t0 = time.perf_counter()
                    if d.main:
                        last_score = periodic_eval(run, mon, evaluator, timer)
                        last_val = validate(run, mon, timer) if run.validation is not None else last_val
                    d.barrier()
                    timer.exclude(time.perf_counter() - t0)
                if _due(run.step, cfg.checkpoint_every) or run.step == cfg.steps or clock.due(run.step):
                    training_checkpoint.save(run, mon)
                    clock.restart()
                note = timer.tick()
                if note:
                    mon.print(note)
                mon.progress(1, **training_log.postfix(loss, last_score, last_val, timer.eta()))
    except KeyboardInterrupt as err:
        why = f" by {err.args[0]}" if err.args else ""
        if (run.out / dt_checkpoint.FILENAME).exists():
            mon.print(f"interrupted{why} at step {run.step}; {kept(run)}; continue with: python -m primal_dt.train "
                      f"resume={run.out}")
        else:
            mon.print(f"interrupted{why} at step {run.step}, before the first checkpoint (checkpoint_every="
                      f"{cfg.checkpoint_every}, checkpoint_minutes={cfg.checkpoint_minutes:g}): nothing to resume")
        mon.close()
        raise
    except WriteError:
        with contextlib.suppress(WriteError):  # the disk may refuse the rest of the log too
            mon.close()
        raise
    final = final_eval(run, mon, evaluator)
    val = validate(run, mon, timer, final=True) if run.validation is not None else None
    d.barrier()
    summary = training_log.finish(run, mon, final, val)
    runtime.check_replicas(run.model, d)
    return summary


@contextlib.contextmanager
def _terminate_as_interrupt():
    """A SIGTERM (a scheduler's preemption or time limit, ``kill``) ends training as Ctrl-C does: the
    run says where it stopped, which checkpoint is kept and how to continue, instead of vanishing.
    Only the main thread can take signals; elsewhere SIGTERM keeps its default."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def diverged(run: Run, mon: RunMonitor, loss, gn, parts) -> None:
    """Stop with a message saying what diverged and what is kept; the step was not taken."""
    msg = (f"training diverged at step {run.step + 1}: loss={loss}, grad norm={gn}, action mse={float(parts['mse'])}, "
           f"ksvd={float(parts['ksvd'])}. The optimizer step was not taken; {kept(run)}. Try a lower lr "
           f"(now {run.cfg.lr}), a smaller eta (now {run.cfg.eta}) or grad_clip > 0 (now {run.cfg.grad_clip}).")
    mon.print(msg)
    mon.close()
    raise Diverged(msg)


# -- evaluation in the simulator -----------------------------------------------------------------------
def evaluate(run: Run, evaluator: Evaluator, episodes: int, seed: int) -> dict:
    """Roll the current model out (``episodes`` per target), leaving the training RNG untouched; the
    bar counts episodes (episodes x targets), ending at 100 % with the evaluation."""
    bar = None
    if run.cfg.progress:
        bar = EpisodeBar(episodes * len(run.info.targets), f"eval at step {run.step}", leave=False)
    try:
        with torch.random.fork_rng(devices=[]):  # evaluation never moves the training RNG
            return evaluator.rollout(run.model, run.info, episodes, seed, run.cfg.eval,
                                     bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()


def periodic_eval(run: Run, mon: RunMonitor, evaluator: Evaluator, timer: training_time.Timer | None = None) -> float:
    """Evaluate every ``eval.every`` steps; returns the first target's normalized score (for the bar)."""
    t0 = time.perf_counter()
    res = evaluate(run, evaluator, run.cfg.eval.episodes, run.cfg.seed + 10_000)
    seconds = time.perf_counter() - t0
    if timer is not None:
        timer.evaluated(seconds, run.cfg.eval.episodes)
    mon.scalars(training_log.eval_scalars(res), run.step)
    mon.print(f"step {run.step}: eval ({run.cfg.eval.episodes} episodes/target, {seconds:.0f}s) "
              f"normalized {evaluator.line(res)}")
    run.history = training_log.eval_history(mon)
    return next(iter(res.values()))["normalized_mean"]


def final_eval(run: Run, mon: RunMonitor, evaluator: Evaluator) -> dict | None:
    """``eval.final_episodes`` per target at the end (rank 0; None when switched off)."""
    e = run.cfg.eval
    if not (run.dist.main and e.final_episodes > 0):
        return None
    t0 = time.perf_counter()
    final = evaluate(run, evaluator, e.final_episodes, run.cfg.seed + 20_000)
    mon.scalars(training_log.eval_scalars(final), run.step)
    mon.scalars(training_log.eval_scalars(final, "eval_final"), run.step)
    mon.print(f"final eval ({e.final_episodes} episodes/target, {time.perf_counter() - t0:.0f}s): "
              f"normalized {evaluator.line(final)}")
    return final


# -- validation on held-out episodes ----------------------------------------------------------------
def validate(run: Run, mon: RunMonitor, timer: training_time.Timer | None = None, final: bool = False) -> float:
    """The held-out episodes' masked action MSE (rank 0), logged as ``val/action_mse`` at this step;
    every ``eval.every`` steps and at the end, with or without the simulator evaluation."""
    t0 = time.perf_counter()
    mse = run.validation.action_mse(run.model)
    if timer is not None:
        timer.validated(time.perf_counter() - t0)
    mon.scalar(training_log.VAL_TAG, mse, run.step)
    v = run.validation
    mon.print(f"{'final' if final else f'step {run.step}:'} validation action MSE {mse:.5f} "
              f"({v.episodes} held-out episode{'s' * (v.episodes > 1)}, {v.segments} segments)")
    run.history = training_log.eval_history(mon)
    return mse
