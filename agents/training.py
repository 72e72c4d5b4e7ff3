"""Train a Decision Transformer on an offline dataset: what ``python -m primal_dt.train`` runs, in the order a
run happens (the numbered sections). Bad input fails in setup, as ``SetupError``, before anything is written;
the simulator's evaluation is ``eval``'s code handed in as an ``Evaluator`` (``eval`` sits above ``agents``).
A failed write ends the run with one ``WriteError``; the last checkpoint stays intact. Same seed and config,
same run (on CPU), and a resumed run continues exactly. Beside it, in their own rooms: the summary a run leaves
(``agents.run_summary``, which ``eval.report`` reads) and how long a run takes (``agents.time_projection``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

import envs
from primal_dt.run import checkpoint as ck_io
from primal_dt.run import distributed, errors, lock, outputs, runtime
from agents import train_config
from primal_dt.run.monitor import EpisodeBar, RunMonitor, run_dir
from primal_dt.run.distributed import Dist
from primal_dt.run.interrupts import Interrupts
from primal_dt.run.errors import SetupError, WriteError
from agents.train_config import Built, TrainConfig, model_label

from . import compile_check, dt_checkpoint, run_summary, stream_training, train_step as steps
from .decision_transformer import Batch, DecisionTransformer, DTConfig
from .dt_checkpoint import DataInfo, DTCheckpoint, TrainingState
from .run_summary import target_tag
from .time_projection import Clock


class Diverged(RuntimeError):
    """The loss or gradient became NaN/inf; the last good checkpoint is kept."""


@dataclass(frozen=True)
class Evaluator:
    """``rollout(model, info, episodes, seed, eval_config, on_episode)`` plays ``episodes`` per target and
    returns {target: {"normalized_mean", "return_mean", "length_mean", "returns", ...}}; ``line`` says them."""

    rollout: Callable[..., dict]
    line: Callable[[dict], str]


@dataclass
class Run:
    """A training run: what ``prepare`` built, and the progress the loop advances."""

    cfg: TrainConfig
    built: Built
    data: envs.Trajectories
    """the whole dataset; training samples only the episodes not in ``info.held_out``"""
    info: DataInfo
    sampler: envs.SegmentSampler | stream_training.Carry
    model: DecisionTransformer
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    out: Path | None
    """the run directory (a new run's is claimed when training starts: ``train``)"""
    device: torch.device
    dist: Dist
    validation: Validation | None = None
    """None: val_fraction=0, or not rank 0"""
    compile: str = "eager"
    """``compile=`` resolved for the device"""
    exact_from: int | None = None
    """stream-exact runs counting segment tails (``stream_counts=tail``): the first segment step the loss counts"""
    ema: torch.optim.swa_utils.AveragedModel | None = None
    """the moving average of the weights (``ema_decay``), updated after every step; None: ema_decay=0"""
    step: int = 0
    train_time: float = 0.0
    """seconds inside optimisation steps (no evaluation, no logging)"""
    history: dict = field(default_factory=dict)
    """a resumed run's evaluation curves (from its checkpoint), so it draws them whole"""


# == 1. setup: everything that can fail on bad input ================================================
def prepare(built: Built, d: Dist | None = None) -> Run:
    """The order of random draws is part of the contract. A resumed run's directory is locked before its
    checkpoint is read, so no run continues from a checkpoint another process is about to replace."""
    path = None  # resume='s checkpoint file, its run directory held by rank 0
    with errors.setup_errors():
        if built.cfg.resume:
            path = ck_io.find(built.cfg.resume, dt_checkpoint.FILENAME, "resume")
            if d.main if d is not None else int(os.environ.get("RANK", "0")) == 0:  # torchrun's rank, before joining
                outputs.check_writable(path.parent, "run directory")
                lock.hold(path.parent)
    try:
        return _prepare(built, d, path)
    except BaseException:
        if path is not None:
            lock.release(path.parent)
        raise


def _prepare(built: Built, d: Dist | None, path: Path | None) -> Run:
    with errors.setup_errors():
        ck = None  # a resumed run's checkpoint: its config plus the options given now
        if path is not None:
            ck = dt_checkpoint.load(path)
            if ck.training is None:
                raise SetupError(f"checkpoint {path} holds no training state (optimizer, random streams, step), so "
                                 "it cannot be resumed; start a new run")
            built = train_config.resumed(built, ck.config, str(path))
        cfg = built.cfg
        train_config.check(cfg)
        try:
            spec = envs.get_spec(cfg.env)
        except (KeyError, ValueError) as err:
            raise SetupError(f"env: {err.args[0] if err.args else err}") from err
        if cfg.eval.every > 0 or cfg.eval.final_episodes > 0:  # evaluation will build simulators: fail now, not at it
            envs.check_mujoco_gl()
        d = d or distributed.init_distributed(cfg.device)
        if cfg.batch_size % d.world:
            raise SetupError(f"batch_size={cfg.batch_size} must be divisible by the {d.world} processes")
        device = runtime.pick_device(cfg.device, d)
        mode = steps.resolve(cfg.compile, device, d.world)
        runtime.set_threads(cfg.threads, d)
        runtime.seed_torch(cfg.seed)
        model = build_model(cfg, spec.obs_dim, spec.act_dim)  # bad options raise here
        data = envs.load_dataset(cfg.env, source=cfg.data_source, verbose=d.main, clip_actions=cfg.data_clip_actions)
        if ck is not None:  # the data must be what the checkpoint was trained on
            dt_checkpoint.check_data(ck.data, data, ck.origin)
        dims = (data.observations.shape[1], data.actions.shape[1])
        if dims != (spec.obs_dim, spec.act_dim):  # e.g. Minari (v5) data observing differently
            runtime.seed_torch(cfg.seed)
            model = build_model(cfg, *dims)
        model = model.to(device)
        if d.world > 1:  # same initial weights everywhere (DDP also broadcasts them), own dropout masks per rank
            runtime.seed_torch(cfg.seed + 1000 * d.rank)
        # AdamW (fused for the compiled steps), linear warm-up then constant (the DT recipe) or cosine
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=mode != "eager")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: rate_factor(cfg, s))
        train_eps, held_out = hold_out(cfg, data, ck)
    trained = data.subset(train_eps) if len(held_out) else data  # statistics of the training episodes only
    # returns-to-go are divided by reward_scale, in the sampler as in the checkpoint and the agent
    # stream-exact (stream_window): the first segment step whose reach the segment holds, which the loss counts
    # from (stream_counts=tail) or which each segment starts before its drawn step (protocol: envs.sampler)
    first_exact = stream_training.first_exact_step(model.cfg) if cfg.stream_window else 0
    lead = first_exact if cfg.stream_counts == "protocol" else 0
    sampler = envs.SegmentSampler(trained, cfg.K, cfg.batch_size // d.world, cfg.reward_scale, cfg.max_timestep,
                                  cfg.seed + 1000 * d.rank, device, from_start=cfg.from_start,
                                  top_fraction=cfg.data_top_fraction, lead=lead)
    targets = tuple(float(t) for t in (cfg.eval.targets or spec.targets))
    info = DataInfo(env=cfg.env, state_mean=trained.state_mean, state_std=trained.state_std,
                    reward_scale=cfg.reward_scale, targets=targets, gym_id=getattr(data, "gym_id", spec.gym_id),
                    source=data.source, fingerprint=data.fingerprint, held_out=tuple(held_out.tolist()))
    if cfg.whole_episodes:  # lanes of consecutive chunks, each carrying its episode's recurrent state
        sampler = stream_training.Carry(model, envs.EpisodeChunks.of(sampler, trained.starts, trained.lengths), device)
    exact_from = first_exact if cfg.stream_window and not lead else None
    validation = Validation(data.subset(held_out), info, cfg.K, cfg.max_timestep, cfg.seed, device, exact_from,
                            cfg.from_start, cfg.whole_episodes, lead) if len(held_out) and d.main else None
    ema = moving_average(model, cfg.ema_decay)
    run = Run(cfg, built, data, info, sampler, model, opt, sched, path.parent if path else None, device, d,
              validation, mode, exact_from, ema)
    if ck is not None:
        restore(run, ck)
    return run


def rate_factor(cfg: TrainConfig, step: int) -> float:
    """The learning rate of 0-based step ``step`` as a fraction of ``cfg.lr``: a linear warm-up over ``warmup_steps``,
    then 1, or for ``lr_schedule=cosine`` a half cosine from 1 (at the warm-up's last step) to ``lr_min`` (at the run's
    last step, ``steps`` - 1)."""
    w = cfg.warmup_steps
    if step + 1 < w:
        return (step + 1) / w
    if cfg.lr_schedule == "constant":
        return 1.0
    done = min(1.0, max(0, step + 1 - w) / max(1, cfg.steps - w))
    return cfg.lr_min + (1.0 - cfg.lr_min) * 0.5 * (1.0 + math.cos(math.pi * done))


def moving_average(model: DecisionTransformer, decay: float) -> torch.optim.swa_utils.AveragedModel | None:
    """torch's exponential moving average of ``model``'s weights (None for ``decay`` 0). It starts from the weights
    after the first step it sees (a resumed run: from its checkpoint's average, ``restore``)."""
    if not decay:
        return None
    swa = torch.optim.swa_utils
    return swa.AveragedModel(model, multi_avg_fn=swa.get_ema_multi_avg_fn(decay)).eval()


def hold_out(cfg: TrainConfig, data: envs.Trajectories, resumed: DTCheckpoint | None):
    """(training episodes, held-out episodes) for ``val_fraction``, drawn by the seed; checked on resume."""
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


def build_model(cfg: TrainConfig, state_dim: int, act_dim: int) -> DecisionTransformer:
    """The network ``cfg`` describes for data of these dimensions (stream-exact: every layer windowed), or a
    ValueError naming the options (a mechanism's own check names its arguments)."""
    try:
        mc = DTConfig(**dataclasses.asdict(cfg.model), state_dim=state_dim, act_dim=act_dim, K=cfg.K,
                      max_timestep=cfg.max_timestep)
        if cfg.whole_episodes and (cfg.stream_window or cfg.from_start):
            raise ValueError("whole_episodes=true is the third way to an exact stream: use it without stream_window "
                             "and from_start")
        if cfg.from_start and (cfg.stream_window or cfg.K < cfg.max_timestep):
            raise ValueError(f"from_start=true trains on whole episodes from their first step: it needs K >= "
                             f"max_timestep (K={cfg.K}, max_timestep={cfg.max_timestep}; e.g. K={cfg.max_timestep}) "
                             "and no stream_window (the two are alternative ways to an exact stream)")
        if cfg.stream_counts == "tail" and not cfg.stream_window:
            raise ValueError("stream_counts=tail says which steps a windowed run counts: give it with stream_window=W "
                             "(or leave it out)")
        if cfg.stream_window:
            mc = stream_training.stream_exact_config(mc, cfg.stream_window)
            need = stream_training.first_exact_step(mc) + 1
            if cfg.K < need:
                raise ValueError(f"stream_window={cfg.stream_window} over {len(mc.layer_specs())} layers reaches "
                                 f"{stream_training.receptive_field(mc)} tokens back, so K must be >= {need} for "
                                 f"any step of a segment to count; got K={cfg.K}. Raise K or lower stream_window")
        model = DecisionTransformer(mc)
        if cfg.whole_episodes:  # every layer must stream: the error names those that cannot
            model.chunk_form()
        return model
    except ValueError as err:
        m = cfg.model
        raise ValueError(f"model options (model.name={m.name}, model.layers={m.layers or '-'}, "
                         f"model.d_model={m.d_model}, model.n_heads={m.n_heads}, model.s={m.s}, "
                         f"model.attention_options={','.join(m.attention_options) or '-'}, K={cfg.K}, "
                         f"stream_window={cfg.stream_window}, from_start={str(cfg.from_start).lower()}): "
                         f"{err}") from err


# == 2. the loop ========================================================================================
def train(built: Built, evaluator: Evaluator, d: Dist | None = None) -> dict:
    """Prepare, claim a new run's directory (rank 0, locked) before any step so an unwritable ``out`` costs
    nothing, train, evaluate at the end; returns the summary (also in ``summary.json``)."""
    run = prepare(built, d)
    cfg, d = run.cfg, run.dist
    resumed = run.out is not None  # its directory held since ``prepare``
    if not resumed:
        name = [str(run_dir(cfg.out, cfg.env, model_label(cfg), seed=cfg.seed)) if d.main else None]
        if d.world > 1:
            torch.distributed.broadcast_object_list(name, src=0)
        run.out = Path(name[0])
    with ck_io.run_directory(run.out, resumed, lambda: kept(run), "primal_dt.train", main=d.main):
        return _train(run, evaluator)


def _train(run: Run, evaluator: Evaluator) -> dict:
    """The loop, top to bottom: a step (and, when due, its log line), an evaluation, a checkpoint, the progress
    bar; then the final evaluation and validation, and the summary. Ctrl-C and SIGTERM end it with a checkpoint
    at the step reached (``interrupted``); a diverged step ends it keeping the last good one (``settle``)."""
    cfg, d = run.cfg, run.dist
    if d.main:
        print(announcement(run), flush=True)
    mon = open_monitor(run)
    score_tag = f"eval/normalized/{target_tag(run.info.targets[0])}"  # the bar's score: the first target's
    by_time = CheckpointClock(cfg.checkpoint_minutes, d, run.device)
    clock = Clock(run.built, run.device, len(run.info.targets), run.step, d.main)
    saved_at = run.step if (run.out / dt_checkpoint.FILENAME).exists() else -1
    stepper = make_stepper(run, mon)
    speed = (0.0, 0, 0)  # seconds, steps and tokens of the optimisation steps since the last logged step
    loss = None
    interrupts = Interrupts()
    try:
        with interrupts.installed():
            while run.step < cfg.steps:
                logging = _due(run.step + 1, cfg.log_every)
                # a step and its log line are whole or not taken: an interrupt waits for their end, so the
                # checkpoint it writes holds every event logged up to its step
                with interrupts.held():
                    out, real, t0 = take_step(run, stepper, logging)
                    # the eager step reads its loss back each step; the compiled ones only here, so the time of
                    # the steps in between is counted at this read (their sum is right, each one is not)
                    if stepper.eager or logging:
                        settle(run, stepper, mon)
                        loss, gn = float(out[0]), float(out[1])  # a read-back in the compiled forms
                    dt = time.perf_counter() - t0
                    run.step += 1
                    run.train_time += dt
                    speed = (speed[0] + dt, speed[1] + 1, speed[2] + run.model.tokens.per_step * real * d.world)
                    if logging:
                        log_step(run, mon, loss, gn, out[2], *speed)
                        speed = (0.0, 0, 0)
                if _due(run.step, cfg.eval.every) and run.step < cfg.steps:  # the final one covers the last step
                    settle(run, stepper, mon)
                    t0 = time.perf_counter()
                    if d.main:
                        evaluate(run, mon, evaluator)
                        if run.validation is not None:
                            validate(run, mon)
                    d.barrier()
                    clock.exclude(time.perf_counter() - t0)
                if _due(run.step, cfg.checkpoint_every) or run.step == cfg.steps or by_time.due(run.step):
                    with interrupts.held():  # whole: an interrupt after its rename would write it again
                        settle(run, stepper, mon)
                        save(run, mon)
                        saved_at = run.step
                    by_time.restart()
                if note := clock.tick(run.step):
                    mon.print(note)
                shown = {"loss": (loss, "{:.4f}"), "score": (_latest(mon, score_tag), "{:.1f}"),
                         "val_mse": (_latest(mon, VAL_TAG), "{:.4f}"), "eta": (clock.eta(run.step), "{}")}
                mon.progress(1, **{k: form.format(v) for k, (v, form) in shown.items() if v is not None})
            # under the same interrupt handling: the last step's checkpoint is written, a resume repeats these
            settle(run, stepper, mon)
            final = evaluate(run, mon, evaluator, final=True) if d.main and cfg.eval.final_episodes > 0 else None
            val = validate(run, mon, final=True) if run.validation is not None else None
    except KeyboardInterrupt as err:
        interrupted(run, mon, stepper, saved_at, err)
        raise
    except WriteError:
        with contextlib.suppress(WriteError):  # the disk may refuse the rest of the log too
            mon.close()
        raise
    d.barrier()
    summary = finish(run, mon, final, val)
    distributed.check_replicas(run.model, d)
    return summary


def take_step(run: Run, stepper: steps.Stepper, logging: bool) -> tuple[tuple, int, float]:
    """One optimisation step on the next batch: where a batch is drawn and its loss taken (another way of training
    changes this function and ``next_batch``). Returns what ``Stepper.step`` returns (loss, grad norm, parts: on
    the device in the compiled forms, read back by the loop when it needs them), the batch's real steps, and when
    the step began (``perf_counter``: the draw is not training time)."""
    batch, real = next_batch(run)
    t0 = time.perf_counter()
    out = stepper.step(batch, logging)
    if "state" in out[2]:  # episode chunks (whole_episodes): the state their lanes carry on
        run.sampler.carry(out[2].pop("state"))
    if run.ema is not None:
        run.ema.update_parameters(run.model)
    return out, real, t0


def next_batch(run: Run) -> tuple[Batch, int]:
    """The sampler's next batch, gathered on the device, and its real steps (counted on the host: no read-back)."""
    idx, mask = run.sampler.indices()
    if getattr(run.sampler, "lead", 0):  # the mask is the steps counted; the context before them is real too
        return run.sampler.batch(idx, mask), int((idx < run.sampler.num_steps).sum())
    batch = run.sampler.batch(idx)
    if run.exact_from is not None:
        batch = stream_training.stream_exact_batch(batch, run.exact_from)
    return batch, int(mask.sum())


def upcoming_batches(run: Run, n: int) -> list[Batch]:
    """The next ``n`` batches the run will train on, its sampler's stream put back (the compile check's data). Episode
    chunks all carry the lanes' present state (no step is taken between draws): inputs the forms compared share."""
    state = run.sampler.state_dict()
    try:
        return [next_batch(run)[0] for _ in range(n)]
    finally:
        run.sampler.load_state_dict(state)


def make_stepper(run: Run, mon: RunMonitor) -> steps.Stepper:
    """The run's training step in its ``compile=`` form; a compiled form is first checked against the eager step
    (``compile_check``) and, wrong, not trained in: the run falls back to eager and says so."""
    cfg, d = run.cfg, run.dist
    net = run.model if d.world == 1 else torch.nn.parallel.DistributedDataParallel(
        run.model, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    autocast = torch.bfloat16 if cfg.amp == "bf16" else None
    if run.compile != "eager" and cfg.compile_check:  # a wrong compiled step is not trained in
        verdict = compile_check.check(run.compile, run.model, run.opt, run.sched,
                                      upcoming_batches(run, compile_check.STEPS), cfg.eta, cfg.grad_clip, autocast,
                                      run.step, d.world)
        mon.print(verdict.line())
        run.compile = run.compile if verdict.ok else "eager"
    return steps.Stepper(run.compile, net, list(run.model.parameters()), run.opt, run.sched, cfg.eta, cfg.grad_clip,
                         d.world, run.step, autocast=autocast)


def settle(run: Run, stepper: steps.Stepper, mon: RunMonitor) -> None:
    """Stop at the first failed step (the compiled forms report it when asked: one read-back), saying what
    diverged and what is kept; the step was not taken."""
    failed = stepper.failure()
    if failed is None:
        return
    cfg = run.cfg
    run.step = failed.step - 1
    msg = (f"training diverged at step {failed.step}: loss={failed.loss}, grad norm={failed.grad_norm}, action "
           f"mse={float(failed.parts['mse'])}, ksvd={float(failed.parts['ksvd'])}. The optimizer step was not "
           f"taken; {kept(run)}. Try a lower lr (now {cfg.lr}), a smaller eta (now {cfg.eta}) or grad_clip > 0 "
           f"(now {cfg.grad_clip}).")
    mon.print(msg)
    mon.close()
    raise Diverged(msg)


def interrupted(run: Run, mon: RunMonitor, stepper: steps.Stepper, saved_at: int, err: KeyboardInterrupt) -> None:
    """After Ctrl-C or SIGTERM (``err``; the caller re-raises it): one process writes a checkpoint at the step
    reached when it is past the last one (``saved_at``; the state is that of a whole number of steps), then the
    run says what is kept and the ``resume=`` command that continues it. A second interrupt while that checkpoint
    is written stops at once, the previous checkpoint kept."""
    cfg, why = run.cfg, f" by {err.args[0]}" if err.args else ""
    if mon.bar is not None:  # the bar ends here: nothing is drawn after the line that says how to continue
        mon.bar.close()
    written, last = False, run.out / dt_checkpoint.FILENAME
    if run.dist.world == 1 and run.step > saved_at:  # the state is that of a whole number of steps: keep it
        try:
            settle(run, stepper, mon)
            save(run, mon)
            written = True
        except KeyboardInterrupt:  # a second interrupt: stop at once, the previous checkpoint kept
            why = f"{why}, then again while its checkpoint was written,"
    resume = f"continue with: python -m primal_dt.train resume={run.out}"
    if written:
        mon.print(f"interrupted{why} at step {run.step}: checkpoint written at this step ({last}); {resume}")
    elif last.exists():
        where = " during the final evaluation" if run.step >= cfg.steps else ""
        mon.print(f"interrupted{why}{where} at step {run.step}; {kept(run)}; {resume}")
    else:
        mon.print(f"interrupted{why} at step {run.step}, before the first checkpoint (checkpoint_every="
                  f"{cfg.checkpoint_every}, checkpoint_minutes={cfg.checkpoint_minutes:g}): nothing to resume")
    mon.close()


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _latest(mon: RunMonitor, tag: str) -> float | None:
    return mon.history[tag][-1][1] if mon.history.get(tag) else None


# == 3. evaluation: in the simulator, and on held-out episodes ==========================================
def evaluate(run: Run, mon: RunMonitor, evaluator: Evaluator, final: bool = False) -> dict:
    """Roll the current model out and log the scores, leaving the training RNG untouched."""
    e, t0 = run.cfg.eval, time.perf_counter()
    episodes = e.final_episodes if final else e.episodes
    bar = EpisodeBar(episodes * len(run.info.targets), f"eval at step {run.step}", leave=False) \
        if run.cfg.progress else contextlib.nullcontext()
    with bar, torch.random.fork_rng(devices=[]):
        res = evaluator.rollout(run.model, run.info, episodes, run.cfg.seed + (20_000 if final else 10_000), e,
                                bar.update if run.cfg.progress else None)
    prefixes = ("eval", "eval_final") if final else ("eval",)
    mon.scalars({f"{prefix}/{k}/{target_tag(t)}": r[f"{k}_mean"] for prefix in prefixes for t, r in res.items()
                 for k in ("normalized", "return", "length")}, run.step)
    took = f"({episodes} episodes/target, {time.perf_counter() - t0:.0f}s)"
    if final:  # the number a user reports: which policy it measured, in eval.rollout's words
        exact = stream_training.fidelity(e.engine, dataclasses.asdict(run.cfg)).exact
        policy = "the trained policy" if exact else "NOT the trained policy"
        mon.print(f"final eval by engine={e.engine} ({policy}) {took}: normalized {evaluator.line(res)}")
    else:
        mon.print(f"step {run.step}: eval {took} normalized {evaluator.line(res)}")
    return res


MAX_SEGMENTS, CHUNK = 2048, 256
"""held-out segments per validation at most (a forward pass over them costs a few training steps), per pass"""
_SAMPLE_STREAM = 0x7661  # keys the fixed sample's generator apart from the split's and the sampler's


class Validation:
    """Validation without a simulator: the masked action MSE on whole episodes the model never trains on,
    cheap and deterministic where a rollout is slow and noisy; it tells over-fitting from under-fitting.
    The segments are fixed once per run (every K-step segment starting in a held-out episode, or a seeded
    sample of ``MAX_SEGMENTS``), so the curve moves only when the model does. ``exact_from``, ``lead`` and
    ``from_start``: the steps counted and the segments, as stream-exact runs train (with ``lead``, the steps
    counted are those a standard run of K - lead steps counts: the two curves compare)."""

    def __init__(self, held_out: envs.Trajectories, info: DataInfo, K: int, max_timestep: int, seed: int,
                 device: torch.device, exact_from: int | None = None, from_start: bool = False,
                 whole_episodes: bool = False, lead: int = 0):
        sampler = envs.SegmentSampler(held_out, K, 1, info.reward_scale, max_timestep, seed=None, device=device,
                                      stats=(info.state_mean, info.state_std), lead=lead)
        self.whole_episodes = whole_episodes
        if whole_episodes:  # every held-out episode, chunk after chunk, as the run trains
            first = held_out.starts
            ends = first + held_out.lengths
            self.batches = []
            for c in range(0, int(held_out.lengths.max()), K):  # chunk c of every episode (padding where it ended)
                idx = first[:, None] + c + np.arange(K)
                idx[idx >= ends[:, None]] = held_out.num_steps
                self.batches.append(sampler.batch(idx))
            self.episodes, self.segments = len(held_out), len(self.batches) * len(first)
            self.counted = int(held_out.num_steps) * held_out.actions.shape[1]
            return
        first = held_out.starts if from_start else np.arange(held_out.num_steps)
        if len(first) > MAX_SEGMENTS:
            rng = np.random.default_rng((int(seed), _SAMPLE_STREAM))
            first = np.sort(rng.choice(len(first), MAX_SEGMENTS, replace=False))
        self.batch = sampler.segments(first)
        if exact_from is not None:
            self.batch = stream_training.stream_exact_batch(self.batch, exact_from)
        self.episodes, self.segments = len(held_out), len(first)
        self.counted = int(self.batch.counted.sum()) * held_out.actions.shape[1]
        """action values the mean runs over"""

    def action_mse(self, model: torch.nn.Module) -> float:
        """One mean over every counted action value (not a mean of chunk means); no random stream moved. Whole
        episodes: each chunk from the state the one before it left, as the stream computes."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        sse = torch.zeros((), dtype=torch.float64, device=device)
        batches = self.batches if self.whole_episodes else [
            Batch(*(v[i:i + CHUNK] if isinstance(v, torch.Tensor) else v for v in self.batch))
            for i in range(0, self.segments, CHUNK)]
        state = None
        if self.whole_episodes:
            state = model.chunk_form().init(self.batches[0].mask.shape[0], device)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                for b in batches:
                    pred, _, *carried = model(b if state is None else b._replace(state=state))
                    state = carried[0] if carried else None
                    m = b.counted.unsqueeze(-1).to(pred.dtype)
                    sse += ((pred - b.actions) ** 2 * m).sum(dtype=torch.float64)
        finally:
            model.train(was_training)
        return float(sse) / max(self.counted, 1)


VAL_TAG = "val/action_mse"


def validate(run: Run, mon: RunMonitor, final: bool = False) -> float:
    v = run.validation
    mse = v.action_mse(run.model)
    mon.scalar(VAL_TAG, mse, run.step)
    mon.print(f"{'final' if final else f'step {run.step}:'} validation action MSE {mse:.5f} "
              f"({v.episodes} held-out episode{'s' * (v.episodes > 1)}, {v.segments} "
              f"{'chunks' if v.whole_episodes else 'segments'})")
    return mse


# == 4. checkpoints, by steps and by wall time ===========================================================
def save(run: Run, mon: RunMonitor) -> None:
    """Write ``last.pt`` (rank 0, atomically) after flushing the logged events, so a resume purges only what
    came after it. A collective: every process sends its random streams."""
    mine = {"torch": torch.get_rng_state(), "numpy": dt_checkpoint.numpy_state(), "sampler": run.sampler.state_dict()}
    if run.device.type == "cuda":
        mine["cuda"] = torch.cuda.get_rng_state(run.device)
    rngs = [mine]
    if run.dist.world > 1:
        rngs = [None] * run.dist.world
        dist.all_gather_object(rngs, mine)
    if run.dist.main:
        mon.flush()
        history = {k: v for k, v in mon.history.items() if k.startswith(("eval/", "val/"))}  # a resume draws them
        state = TrainingState(optimizer=run.opt.state_dict(), scheduler=run.sched.state_dict(), rng=rngs,
                              step=run.step, train_time=run.train_time, history=history)
        ck = DTCheckpoint(model_config=run.model.cfg, model=run.model.state_dict(), data=run.info,
                          config=dataclasses.asdict(run.cfg), training=state,
                          ema=run.ema.module.state_dict() if run.ema is not None and run.step else None)
        dt_checkpoint.save(ck, run.out / dt_checkpoint.FILENAME)
    run.dist.barrier()


def restore(run: Run, ck: DTCheckpoint) -> None:
    """Continue exactly where the checkpoint stopped (each rank its own streams; with another number of
    processes the samplers are reseeded)."""
    t, rank = ck.training, run.dist.rank
    try:  # the schema checked each part's form; whether it fits this model shows only here
        run.model.load_state_dict(ck.model)
        if run.ema is not None and ck.ema is not None:  # (else the average starts at the resumed run's first step)
            run.ema.module.load_state_dict(ck.ema)
            run.ema.n_averaged.fill_(max(t.step, 1))
        run.opt.load_state_dict(t.optimizer)
        for param, state in run.opt.state.items():  # load_state_dict takes any shapes; the first step would not
            for name, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                    raise ValueError(f"optimizer state {name} has shape {tuple(value.shape)}, but its parameter "
                                     f"{tuple(param.shape)}")
        run.sched.load_state_dict(t.scheduler)
        mine = t.rng[rank] if len(t.rng) == run.dist.world else t.rng[0]
        torch.set_rng_state(mine["torch"])
        dt_checkpoint.set_numpy_state(mine["numpy"])
        if "cuda" in mine and run.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"], run.device)
        if len(t.rng) == run.dist.world:
            run.sampler.load_state_dict(mine["sampler"])
        else:
            if run.dist.main:
                print(f"note: the checkpoint was written by {len(t.rng)} process(es), this run has {run.dist.world}; "
                      "batches are reseeded, so results will differ from an uninterrupted run", flush=True)
            fresh = np.random.default_rng([run.cfg.seed, rank, t.step]).bit_generator.state
            run.sampler.load_state_dict({**mine["sampler"], "bit_generator": fresh})
    except ck_io.UNFIT as err:
        raise ck_io.unfit(ck.origin, err) from err
    run.step, run.train_time, run.history = t.step, t.train_time, t.history


class CheckpointClock:
    """Checkpoints by wall time: the first after a minute, then at doubling intervals up to
    ``checkpoint_minutes``, so a stop loses at most about half the time run so far. Under DDP rank 0's
    clock decides, broadcast every ``SYNC_EVERY`` steps (saving is a collective)."""

    SYNC_EVERY = 10
    FIRST_S = 60.0

    def __init__(self, minutes: float, d: Dist, device: torch.device):
        self.cap, self.dist, self.device = 60.0 * minutes, d, device
        self.interval = min(self.FIRST_S, self.cap)
        self.restart()

    def restart(self) -> None:
        self.deadline = time.monotonic() + self.interval
        self.interval = min(2 * self.interval, self.cap)

    def due(self, step: int) -> bool:
        if self.cap <= 0:
            return False
        late = time.monotonic() >= self.deadline
        if self.dist.world == 1:
            return late
        if step % self.SYNC_EVERY:
            return False
        flag = torch.tensor([float(late and self.dist.main)], device=self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())


def kept(run: Run) -> str:
    """What survives a failure: the last checkpoint (never overwritten by a failed write)."""
    last = run.out / dt_checkpoint.FILENAME
    if not last.exists():
        return "no checkpoint had been written yet"
    try:
        return f"the last good checkpoint {last} (step {dt_checkpoint.load(last).step}) is intact"
    except (ValueError, FileNotFoundError) as err:
        return f"the last checkpoint {last} cannot be read ({err})"


# == 5. logging: what a run shows and leaves behind (rank 0 writes; other monitors are off) ============
def announcement(run: Run) -> str:
    cfg = run.cfg
    n_params = sum(p.numel() for p in run.model.parameters())
    return "\n".join([
        train_config.describe(run.built, full=cfg.print_config),
        data_line(run),
        f"model {model_label(cfg)}: layers {run.model.layer_names}, {n_params:,} parameters, device {run.device}, "
        f"training step {run.compile}" + (f" (compile={cfg.compile})" if cfg.compile == "auto" else "")
        + (" in bf16 autocast" if cfg.amp == "bf16" else "")
        + (f", {run.dist.world} processes (DDP)" if run.dist.world > 1 else ""),
        f"eval targets {list(run.info.targets)} by engine={cfg.eval.engine}; run directory {run.out}"
        + (f"; resuming at step {run.step}" if run.step else ""),
        *filter(None, [stream_training.counting_line(cfg, run.model),
                       stream_training.fidelity(cfg.eval.engine, dataclasses.asdict(cfg)).note("this run"),
                       bf16_gpu_note(cfg.amp, run.device, run.model.layer_names)]),
    ])


def bf16_gpu_note(amp: str, device: torch.device, layers: list[str]) -> str:
    """The warning a bf16 run of primal layers on a GPU starts with: on a CPU they train in bf16, and which part of
    the GPU's step is to blame is not yet known (docs/results/gpu-h200-recipe-bf16.md)."""
    if amp != "bf16" or torch.device(device).type != "cuda" or "primal" not in layers:
        return ""
    return ("warning: primal layers did not train in bf16 on a GPU (primal+dt, paper recipe, H200, 3 seeds: "
            "validation action MSE 0.18 against dt's 0.046; docs/results/gpu-h200-recipe-bf16.md); amp=off (float32, "
            "the default) until the cause is found")


def data_line(run: Run) -> str:
    data, n = run.data, len(run.info.held_out)
    held = (f"{n} held out for validation ({int(data.lengths[list(run.info.held_out)].sum()):,} steps, "
            f"val_fraction={run.cfg.val_fraction:g}, drawn by seed {run.cfg.seed}; statistics from the other "
            f"{len(data) - n})") if n else "no episodes held out (val_fraction=0)"
    best = (f"; segments drawn from the {len(run.sampler.episodes)} training episodes of highest return "
            f"(data_top_fraction={run.cfg.data_top_fraction:g})") if run.cfg.data_top_fraction < 1 else ""
    return (f"data {run.cfg.env}: {len(data)} episodes, {data.num_steps:,} steps, source: {data.source} "
            f"({run.info.fingerprint[:19]}); {held}{best}")


def open_monitor(run: Run) -> RunMonitor:
    """The run's monitor, continuing a resumed run's curves (events after its checkpoint purged)."""
    cfg, d = run.cfg, run.dist
    mon = RunMonitor(run.out, enabled=cfg.tensorboard and d.main, progress_total=cfg.steps,
                     progress=cfg.progress and d.main, progress_desc=f"{cfg.env} {model_label(cfg)}",
                     initial=min(run.step, cfg.steps), purge_step=run.step + 1 if run.step else None,
                     lines=d.main)
    if mon.bar is not None:  # tqdm's own "remaining" knows nothing of evaluations: the postfix's eta does
        mon.bar.bar_format = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"
    mon.history.update(run.history)  # (step, value) tuples, as the checkpoint reader gives them
    if d.main and run.step == 0:
        mon.text("config", "```\n" + yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False) + "\n```")
        mon.text("config/provenance", "```\n" + train_config.describe(run.built, full=True) + "\n```")
        mon.text("data/source", data_line(run))
    return mon


def log_step(run: Run, mon: RunMonitor, loss: float, gn: float, parts: dict, seconds: float, steps: int,
             tokens: int) -> None:
    t = max(seconds, 1e-9)
    vals = {"loss/total": loss, "loss/action_mse": float(parts["mse"]), "loss/ksvd": float(parts["ksvd"]),
            "train/lr": run.sched.get_last_lr()[0], "train/grad_norm": gn, "throughput/steps_per_s": steps / t,
            "throughput/tokens_per_s": tokens / t}
    vals.update({f"ksvd/J_{k.split('/')[1]}": float(v) for k, v in parts.items() if k.startswith("J/")})
    lambdas = {i: b.attn.Lambda.detach() for i, b in enumerate(run.model.stack.blocks) if hasattr(b.attn, "Lambda")}
    for i, lam in lambdas.items():  # KSVD's Lambda, per primal layer
        vals.update({f"lambda/layer{i}_{stat}": float(getattr(lam, stat)()) for stat in ("mean", "min", "max")})
        mon.histogram(f"lambda/layer{i}", lam.cpu(), run.step)
    mon.scalars(vals, run.step)


def finish(run: Run, mon: RunMonitor, final: dict | None, val: float | None = None) -> dict:
    """The run's summary (``agents.run_summary``; rank 0 writes it, with the plots and the hyper-parameters)."""
    cfg = run.cfg
    held = run_summary.Held(val, run.validation.episodes, run.validation.segments) if val is not None else None
    summary = run_summary.build_summary(cfg, layers=run.model.layer_names, steps=run.step,
                                        data_source=run.data.source, train_time=run.train_time,
                                        processes=run.dist.world, final=final, held=held, run_dir=run.out)
    if run.dist.main:
        metrics = {f"normalized_{target_tag(t)}": r["normalized_mean"] for t, r in (final or {}).items()} | (
            {"val_action_mse": val} if val is not None else {})
        mon.hparams({"env": cfg.env, "model": model_label(cfg), "data_source": run.data.source,
                     **{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("env", "resume", "out")}},
                    metrics or {"steps": run.step})
        title, tags = f"{cfg.env} {model_label(cfg)} seed {cfg.seed}", sorted(mon.history)
        png = mon.plot([t for t in tags if t.startswith("eval/normalized/")], run.out / "eval_return.png", title=title,
                       ylabel="normalized return")
        val_png = mon.plot([VAL_TAG], run.out / "val_action_mse.png", title=f"{title}: held-out episodes",
                           ylabel="masked action MSE")
        summary |= {"plot": str(png) if png else None, "val_plot": str(val_png) if val_png else None}
        path = run_summary.write_summary(summary, run.out)
        mon.print(f"summary: {path}")
    mon.close()
    return summary
