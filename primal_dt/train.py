"""Train a Decision Transformer on an offline MuJoCo dataset, evaluating it in the simulator.

    python -m primal_dt.train env=hopper-medium
    python -m primal_dt.train env=hopper-medium model=dt seed=3 steps=20000
    python -m primal_dt.train preset=smoke
    python -m primal_dt.train resume=runs/hopper-medium/primal+dt/20250101-120000-seed0
    torchrun --nproc_per_node 2 -m primal_dt.train env=hopper-medium      (DistributedDataParallel)

Configuration and its checks live in ``train_config.py`` (``--help`` lists every option). A run
directory ``<out>/<env>/<model>/<time>-seed<k>/`` holds TensorBoard events, ``last.pt`` (written
atomically every ``checkpoint_every`` steps and at the end), ``eval_return.png`` and
``summary.json``. Training is deterministic on CPU for a given seed and config, and a resumed run
continues exactly where the checkpoint left it: the checkpoint holds the optimizer, scheduler,
the sampler's and torch's RNG states, and the dataset's normalisation statistics.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

from agents import stream_training
from agents.decision_transformer import DecisionTransformer, DTConfig, dt_loss

from . import checkpoint, train_config
from .monitor import RunMonitor, run_dir
from .train_config import TrainConfig


class SetupError(ValueError):
    """Bad input found before training: unknown env / preset / model, bad values, foreign checkpoint."""


class Diverged(RuntimeError):
    """The loss or gradient became NaN/inf; the last good checkpoint is kept."""


# -- processes ---------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str) -> Dist:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1): gloo on CPU, nccl on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if not dist.is_initialized():  # ranks > 0 wait at a barrier while rank 0 evaluates: allow long evaluations
        if gpu:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(hours=2))
    return Dist(dist.get_rank(), dist.get_world_size(), local)


def pick_device(name: str, d: Dist) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SetupError(f"device={name} but CUDA is not available; use device=cpu")
        return torch.device(f"cuda:{d.local_rank}" if name == "cuda" else name)
    return torch.device("cpu")


# -- optimisation -------------------------------------------------------------------------------------
def build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """AdamW with linear warm-up to ``lr`` over ``warmup_steps``, then constant (the DT recipe)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    w = cfg.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / w) if w else 1.0)
    return opt, sched


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


# -- setup ---------------------------------------------------------------------------------------------
@dataclass
class Setup:
    cfg: TrainConfig
    built: train_config.Built
    spec: object
    data: object
    sampler: object
    model: DecisionTransformer
    opt: torch.optim.Optimizer
    sched: object
    out: Path
    device: torch.device
    dist: Dist
    step: int = 0
    history: dict | None = None
    train_time: float = 0.0
    targets: tuple = ()


def model_config(cfg: TrainConfig, state_dim: int, act_dim: int) -> DTConfig:
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


def model_label(cfg: TrainConfig) -> str:
    return cfg.model.layers.replace(",", "-") if cfg.model.layers else cfg.model.name


def resume_config(built: train_config.Built, ck: dict, path: str) -> train_config.Built:
    """The checkpoint's config, plus the run-time options (RESUMABLE) given on the command line.

    Any other option given on the command line must agree with the checkpoint: resuming a
    hopper-medium primal+dt run as walker2d-medium or as dt is an error, not a silent mix.
    """
    saved = dataclasses.asdict(train_config.from_dict(ck["config"]))
    saved_flat, asked = train_config.flat(saved), train_config.flat(dataclasses.asdict(built.cfg))
    prov = {k: f"checkpoint {path}" for k in saved_flat}
    for key, where in built.provenance.items():
        if where != "command line":
            continue
        if key.split(".")[0] not in train_config.RESUMABLE:
            if asked[key] != saved_flat.get(key):
                raise SetupError(f"checkpoint {path} was trained with {key}={saved_flat.get(key)!r}, but the "
                                 f"command line asks for {key}={asked[key]!r}; resume without that option, or "
                                 "start a new run")
            continue
        *parents, leaf = key.split(".")
        node = saved
        for p in parents:
            node = node[p]
        node[leaf] = asked[key]
        prov[key] = "command line"
    cfg = train_config.from_dict(saved)
    return train_config.Built(cfg, cfg.preset or None, f"resumed from {path}", prov)


def resolve_checkpoint(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "last.pt"
    if not p.exists():
        raise SetupError(f"resume={path}: no checkpoint at {p}")
    return p


def prepare(argv: list[str], d: Dist | None = None) -> Setup:
    """Everything that can fail on bad input, before the first training step."""
    try:
        built = train_config.build(argv)
        cfg = built.cfg
        ck, ck_path = None, None
        if cfg.resume:
            ck_path = resolve_checkpoint(cfg.resume)
            ck = checkpoint.load(ck_path, expect_kind="dt")
            built = resume_config(built, ck, str(ck_path))
            cfg = built.cfg
        train_config.check(cfg)
        import envs

        try:
            spec = envs.get_spec(cfg.env)
        except (KeyError, ValueError) as err:
            raise SetupError(f"env: {err.args[0] if err.args else err}") from err
        d = d or init_distributed(cfg.device)
        if cfg.batch_size % d.world:
            raise SetupError(f"batch_size={cfg.batch_size} must be divisible by the {d.world} processes")
        device = pick_device(cfg.device, d)
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        model = DecisionTransformer(model_config(cfg, spec.obs_dim, spec.act_dim))  # bad options raise here
        data = envs.load_dataset(cfg.env, source=cfg.data_source, verbose=d.main)
        if ck is not None:
            _check_same_data(ck, data, ck_path)
        dims = (data.observations.shape[1], data.actions.shape[1])
        if dims != (spec.obs_dim, spec.act_dim):  # e.g. Minari (v5) data observing differently
            torch.manual_seed(cfg.seed)
            model = DecisionTransformer(model_config(cfg, *dims))
        model = model.to(device)
        if d.world > 1:  # same initial weights everywhere (DDP also broadcasts them), own dropout masks per rank
            torch.manual_seed(cfg.seed + 1000 * d.rank)
        opt, sched = build_optimizer(model, cfg)
    except (ValueError, FileNotFoundError) as err:
        raise SetupError(str(err)) from err
    # the sampler multiplies returns-to-go by its reward_scale; ours is the divisor (1000)
    sampler = envs.SegmentSampler(data, cfg.K, cfg.batch_size // d.world, 1.0 / cfg.reward_scale,
                                  cfg.max_timestep, cfg.seed + 1000 * d.rank)
    targets = tuple(float(t) for t in (cfg.eval.targets or spec.targets))
    out = Path(ck_path).parent if ck_path else run_dir(cfg.out, cfg.env, model_label(cfg), seed=cfg.seed)
    s = Setup(cfg, built, spec, data, sampler, model, opt, sched, out, device, d, targets=targets)
    if ck is not None:
        restore(s, ck)
    return s


def _check_same_data(ck: dict, data, path) -> None:
    saved = ck["data"]
    same = (np.allclose(np.asarray(saved["state_mean"]), data.state_mean, atol=1e-6)
            and np.allclose(np.asarray(saved["state_std"]), data.state_std, atol=1e-6))
    if not same:
        raise SetupError(f"checkpoint {path} was trained on data with other normalisation statistics "
                         f"(source {saved.get('source')!r}, now {data.source!r}); resume with the same dataset "
                         f"(data_source={saved.get('source')})")


# -- checkpoints ---------------------------------------------------------------------------------------
def rank_rng(s: Setup) -> dict:
    """This process's random streams: torch (dropout), numpy, the batch sampler (and CUDA's)."""
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "sampler": s.sampler.state_dict()}
    if s.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(s.device)
    return rng


def gather_rng(s: Setup) -> list[dict]:
    """Every process's random streams, rank order (a collective: all processes call it)."""
    mine = rank_rng(s)
    if s.dist.world == 1:
        return [mine]
    out = [None] * s.dist.world
    dist.all_gather_object(out, mine)
    return out


def state(s: Setup, rngs: list[dict]) -> dict:
    return {
        "kind": "dt",
        "config": dataclasses.asdict(s.cfg),
        "model_config": s.model.cfg.to_dict(),
        "model": s.model.state_dict(),
        "optimizer": s.opt.state_dict(),
        "scheduler": s.sched.state_dict(),
        "rng": rngs,  # one entry per process
        "step": s.step,
        "train_time": s.train_time,
        "history": s.history or {},
        "data": {"env": s.cfg.env, "gym_id": getattr(s.data, "gym_id", s.spec.gym_id), "source": s.data.source,
                 "state_mean": torch.as_tensor(np.asarray(s.data.state_mean, dtype=np.float32)),
                 "state_std": torch.as_tensor(np.asarray(s.data.state_std, dtype=np.float32)),
                 "reward_scale": s.cfg.reward_scale, "targets": list(s.targets), "K": s.cfg.K,
                 "max_timestep": s.cfg.max_timestep},
    }


def restore(s: Setup, ck: dict) -> None:
    """Continue exactly where the checkpoint stopped (per process: each rank gets its own streams).

    With another number of processes than the run that wrote it, training continues but cannot
    repeat the uninterrupted run bit for bit; the samplers are then reseeded per rank and step.
    """
    s.model.load_state_dict(ck["model"])
    s.opt.load_state_dict(ck["optimizer"])
    s.sched.load_state_dict(ck["scheduler"])
    rngs, rank = ck["rng"], s.dist.rank
    mine = rngs[rank] if len(rngs) == s.dist.world else rngs[0]
    torch.set_rng_state(mine["torch"])
    np.random.set_state(mine["numpy"])
    if "cuda" in mine and s.device.type == "cuda":
        torch.cuda.set_rng_state(mine["cuda"], s.device)
    if len(rngs) == s.dist.world:
        s.sampler.load_state_dict(mine["sampler"])
    else:
        if s.dist.main:
            print(f"note: the checkpoint was written by {len(rngs)} process(es), this run has {s.dist.world}; "
                  "batches are reseeded, so results will differ from an uninterrupted run", flush=True)
        fresh = np.random.default_rng([s.cfg.seed, rank, ck["step"]]).bit_generator.state
        s.sampler.load_state_dict({**mine["sampler"], "bit_generator": fresh})
    s.step, s.train_time, s.history = ck["step"], ck.get("train_time", 0.0), ck.get("history", {})


# -- evaluation ----------------------------------------------------------------------------------------
def evaluate(s: Setup, episodes: int, seed: int) -> dict:
    """Simulator rollouts of the current model with the vectorised evaluator (eval.rollout)."""
    from eval.rollout import evaluate as rollout_evaluate

    e = s.cfg.eval
    bar = None
    if s.cfg.progress:
        from tqdm import tqdm

        bar = tqdm(desc=f"eval {episodes} episodes x {len(s.targets)} targets", unit=" env steps", leave=False,
                   dynamic_ncols=True, mininterval=1.0)
    try:
        with torch.random.fork_rng(devices=[]):  # evaluation never moves the training RNG
            return rollout_evaluate(s.model, s.spec, s.targets, episodes, seed, state_mean=s.data.state_mean,
                                    state_std=s.data.state_std, reward_scale=s.cfg.reward_scale,
                                    num_envs=e.num_envs, max_steps=e.max_steps or None, engine=e.engine,
                                    on_step=bar.update if bar is not None else None, gym_id=s.data.gym_id)
    finally:
        if bar is not None:
            bar.close()


def eval_scalars(results: dict, prefix: str = "eval") -> dict:
    out = {}
    for t, r in results.items():
        tag = _target_tag(t)
        out[f"{prefix}/normalized/{tag}"] = r["normalized_mean"]
        out[f"{prefix}/return/{tag}"] = r["return_mean"]
        out[f"{prefix}/length/{tag}"] = r["length_mean"]
    return out


def _target_tag(t: float) -> str:
    return f"target{int(t)}" if float(t).is_integer() else f"target{t:g}"


# -- the run -------------------------------------------------------------------------------------------
def run(argv: list[str], d: Dist | None = None) -> dict:
    s = prepare(argv, d)
    cfg, d = s.cfg, s.dist
    params = [p for p in s.model.parameters()]
    net = s.model
    if d.world > 1:
        net = torch.nn.parallel.DistributedDataParallel(
            s.model, device_ids=[s.device.index] if s.device.type == "cuda" else None)
    if d.main:
        print(_announcement(s), flush=True)
    mon = RunMonitor(s.out, enabled=cfg.tensorboard and d.main, progress_total=cfg.steps,
                     progress=cfg.progress and d.main, progress_desc=f"{cfg.env} {model_label(cfg)}",
                     initial=min(s.step, cfg.steps), purge_step=s.step + 1 if s.step else None)
    for tag, pts in (s.history or {}).items():
        mon.history[tag] = [tuple(p) for p in pts]
    if d.main and s.step == 0:
        mon.text("config", "```\n" + yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False) + "\n```")
        mon.text("config/provenance", "```\n" + train_config.describe(s.built) + "\n```")
        mon.text("data/source", f"{s.data.source} ({cfg.env}, {len(s.data.episodes)} episodes, "
                                f"{s.data.num_steps} steps)")
    last_eval = _last_eval(mon)
    reach = stream_training.receptive_field(s.model.cfg) if cfg.stream_window else None
    window = {"t": 0.0, "steps": 0, "tokens": 0}
    try:
        while s.step < cfg.steps:
            logging = _due(s.step + 1, cfg.log_every)
            batch = {k: v.to(s.device, non_blocking=True) for k, v in s.sampler.sample().items()}
            if reach is not None:
                batch["loss_mask"] = stream_training.stream_exact_loss_mask(batch["timesteps"], batch["mask"], reach)
            t0 = time.perf_counter()
            loss, gn, parts = train_step(net, params, s.opt, s.sched, batch, cfg.eta, cfg.grad_clip, logging, d.world)
            dt = time.perf_counter() - t0  # train_step reads the loss back, so the device is synchronised
            if not (math.isfinite(loss) and math.isfinite(gn)):
                _diverged(s, mon, loss, gn, parts)
            s.step += 1
            s.train_time += dt
            window["t"] += dt
            window["steps"] += 1
            window["tokens"] += 3 * int(batch["mask"].sum()) * d.world
            if logging:
                _log_step(s, mon, loss, gn, parts, window)
                window = {"t": 0.0, "steps": 0, "tokens": 0}
            if _due(s.step, cfg.eval.every) and s.step < cfg.steps:  # the final evaluation covers the last step
                last_eval = _periodic_eval(s, mon) if d.main else last_eval
                _barrier(d)
            if _due(s.step, cfg.checkpoint_every) or s.step == cfg.steps:
                _save(s, mon)
            mon.progress(1, loss=f"{loss:.4f}", **({"eval": f"{last_eval:.1f}"} if last_eval is not None else {}))
    except KeyboardInterrupt:
        mon.print(f"interrupted at step {s.step}; continue with: python -m primal_dt.train resume={s.out}")
        mon.close()
        raise
    summary = _finish(s, mon)
    _check_replicas(s)
    return summary


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _announcement(s: Setup) -> str:
    cfg = s.cfg
    n_params = sum(p.numel() for p in s.model.parameters())
    return "\n".join([
        train_config.describe(s.built),
        f"data {cfg.env}: {len(s.data.episodes)} episodes, {s.data.num_steps:,} steps, source: {s.data.source}",
        f"model {model_label(cfg)}: layers {s.model.layer_names}, {n_params:,} parameters, device {s.device}"
        + (f", {s.dist.world} processes (DDP)" if s.dist.world > 1 else ""),
        f"eval targets {list(s.targets)}; run directory {s.out}" + (f"; resuming at step {s.step}" if s.step else ""),
    ])


def _last_eval(mon: RunMonitor) -> float | None:
    tags = sorted(t for t in mon.history if t.startswith("eval/normalized/"))
    return mon.history[tags[0]][-1][1] if tags else None


def _log_step(s: Setup, mon: RunMonitor, loss, gn, parts, window) -> None:
    vals = {"loss/total": loss, "loss/action_mse": float(parts["mse"]), "loss/ksvd": float(parts["ksvd"]),
            "train/lr": s.sched.get_last_lr()[0], "train/grad_norm": gn,
            "throughput/steps_per_s": window["steps"] / max(window["t"], 1e-9),
            "throughput/tokens_per_s": window["tokens"] / max(window["t"], 1e-9)}
    vals.update({f"ksvd/J_{k.split('/')[1]}": float(v) for k, v in parts.items() if k.startswith("J/")})
    for i, attn in s.model.primal_layers().items():
        lam = attn.Lambda.detach()
        vals.update({f"lambda/layer{i}_mean": float(lam.mean()), f"lambda/layer{i}_min": float(lam.min()),
                     f"lambda/layer{i}_max": float(lam.max())})
        mon.histogram(f"lambda/layer{i}", lam.cpu(), s.step)
    mon.scalars(vals, s.step)


def _periodic_eval(s: Setup, mon: RunMonitor) -> float:
    t0 = time.perf_counter()
    res = evaluate(s, s.cfg.eval.episodes, s.cfg.seed + 10_000)
    mon.scalars(eval_scalars(res), s.step)
    from eval.rollout import summary_line

    mon.print(f"step {s.step}: eval ({s.cfg.eval.episodes} episodes/target, {time.perf_counter() - t0:.0f}s) "
              f"normalized {summary_line(res)}")
    s.history = {k: v for k, v in mon.history.items() if k.startswith("eval/")}
    return next(iter(res.values()))["normalized_mean"]


def _save(s: Setup, mon: RunMonitor) -> None:
    rngs = gather_rng(s)
    if s.dist.main:
        s.history = {k: v for k, v in mon.history.items() if k.startswith("eval/")}
        mon.flush()  # events up to the checkpoint are on disk: a resume purges only later ones
        checkpoint.save_atomic(state(s, rngs), s.out / "last.pt")
    _barrier(s.dist)


def _barrier(d: Dist) -> None:
    if d.world > 1:
        dist.barrier()


def _diverged(s: Setup, mon: RunMonitor, loss, gn, parts) -> None:
    last = s.out / "last.pt"
    kept = (f"the last good checkpoint is {last} (step {checkpoint.load(last)['step']}); it was not overwritten"
            if s.dist.main and last.exists() else "no checkpoint had been written yet")
    msg = (f"training diverged at step {s.step + 1}: loss={loss}, grad norm={gn}, action mse={float(parts['mse'])}, "
           f"ksvd={float(parts['ksvd'])}. The optimizer step was not taken; {kept}. Try a lower lr "
           f"(now {s.cfg.lr}), a smaller eta (now {s.cfg.eta}) or grad_clip > 0 (now {s.cfg.grad_clip}).")
    mon.print(msg)
    mon.close()
    raise Diverged(msg)


def _finish(s: Setup, mon: RunMonitor) -> dict:
    cfg = s.cfg
    final = None
    if s.dist.main and cfg.eval.final_episodes > 0:
        t0 = time.perf_counter()
        final = evaluate(s, cfg.eval.final_episodes, cfg.seed + 20_000)
        mon.scalars(eval_scalars(final), s.step)
        mon.scalars(eval_scalars(final, "eval_final"), s.step)
        from eval.rollout import summary_line

        mon.print(f"final eval ({cfg.eval.final_episodes} episodes/target, {time.perf_counter() - t0:.0f}s): "
                  f"normalized {summary_line(final)}")
    _barrier(s.dist)
    summary = {
        "env": cfg.env, "model": model_label(cfg), "layers": s.model.layer_names, "seed": cfg.seed, "steps": s.step,
        "data_source": s.data.source, "train_s": round(s.train_time, 2),
        "s_per_1k_steps": round(1000 * s.train_time / max(s.step, 1), 2), "processes": s.dist.world,
        "final": ({_target_tag(t): {k: r[k] for k in ("normalized_mean", "normalized_std", "return_mean",
                                                        "return_std", "length_mean")} | {"episodes": len(r["returns"])}
                   for t, r in final.items()} if final else None),
        "run_dir": str(s.out),
    }
    if s.dist.main:
        metrics = {f"normalized_{_target_tag(t)}": r["normalized_mean"] for t, r in (final or {}).items()}
        mon.hparams({"env": cfg.env, "model": model_label(cfg), "data_source": s.data.source,
                     **{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("env", "resume", "out")}},
                    metrics or {"steps": s.step})
        tags = sorted(t for t in mon.history if t.startswith("eval/normalized/"))
        png = mon.plot(tags, s.out / "eval_return.png", title=f"{cfg.env} {model_label(cfg)} seed {cfg.seed}",
                       ylabel="normalized return")
        summary["plot"] = str(png) if png else None
        (s.out / "summary.json").write_text(json.dumps(summary, indent=2))
        mon.print(json.dumps(summary, indent=2))
    mon.close()
    return summary


def _check_replicas(s: Setup) -> None:
    """Under DDP, confirm every process ends with the same parameters (they should, bit for bit)."""
    if s.dist.world <= 1:
        return
    flat = torch.cat([p.detach().reshape(-1).double().cpu() for p in s.model.parameters()])
    sums = torch.stack([flat.sum(), (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum()])
    gathered = [torch.zeros_like(sums) for _ in range(s.dist.world)]
    dist.all_gather(gathered, sums)
    if s.dist.main:
        same = all(torch.equal(g, gathered[0]) for g in gathered)
        print(f"DDP: parameters {'identical' if same else 'DIFFERENT'} on {s.dist.world} processes", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        run(argv)
    except (SetupError, Diverged) as err:  # bad input, or a run that diverged: a message, not a traceback
        sys.exit(f"error: {err}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
