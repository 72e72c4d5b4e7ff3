"""The Decision-Transformer checkpoint: one schema (``DTCheckpoint``), one writer (``save``), one reader
(``load``). On disk, a dict of tensors and plain data (``DTCheckpoint.to_dict``), the ``TrainingState``
fields absent in inference-only files. Every field is checked when read: a damaged or crafted file is one
ValueError naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import envs
from primal_dt.run import checkpoint as ck_io, presets
from primal_dt.run.json_reader import MAX_MAGNITUDE
from primal_dt.run.options import check_size

from . import stream_training
from .decision_transformer import DecisionTransformer, DTConfig

KIND = "dt"
SCHEMA_VERSION = 1
FILENAME = "last.pt"
WEIGHTS = ("model", "ema")
"""the weights a checkpoint may hold: the last step's, and their moving average (``DTCheckpoint.ema``)"""
_RESUME_KEYS = ("optimizer", "scheduler", "rng", "step")
"""what a resume needs (``train_time`` and ``history`` have defaults)"""


@dataclass
class DataInfo:
    """The dataset a model was trained on, and the bookkeeping an agent must repeat at inference."""

    env: str
    """dataset name (D4RL naming, e.g. hopper-medium); envs.get_spec(env) gives its simulator"""
    state_mean: np.ndarray
    """[state_dim] float32: observations are normalised as (obs - state_mean) / state_std"""
    state_std: np.ndarray
    reward_scale: float
    """returns-to-go are *divided* by this, everywhere in the package (the DT papers: 1000)"""
    targets: tuple[float, ...] = ()
    """return-to-go targets (raw returns) the run evaluated; the first is an agent's default"""
    gym_id: str | None = None
    """the simulator id the data was recorded with (None: the env spec's own)"""
    source: str = ""
    """where the data came from (file path, Minari id, replica), as printed by envs.load_dataset"""
    fingerprint: str = ""
    """content hash of the arrays trained on (``envs.Trajectories.fingerprint``); '' only if made in code"""
    held_out: tuple[int, ...] = ()
    """episodes (indices in the dataset's order) held out for validation; the statistics are the others'"""

    def __post_init__(self):
        self.state_mean = np.asarray(self.state_mean, dtype=np.float32).reshape(-1)
        self.state_std = np.asarray(self.state_std, dtype=np.float32).reshape(-1)
        self.reward_scale = float(self.reward_scale)
        self.targets = tuple(float(t) for t in self.targets)
        self.held_out = tuple(int(e) for e in self.held_out)
        if self.state_mean.shape != self.state_std.shape:
            raise ValueError(f"state_mean {self.state_mean.shape} and state_std {self.state_std.shape} differ in shape")
        if not self.reward_scale > 0:
            raise ValueError(f"reward_scale must be > 0 (returns-to-go are divided by it), got {self.reward_scale}")

    @property
    def eval_targets(self) -> tuple[float, ...]:
        """The return-to-go targets to act for: the run's own, else the DT papers' for its environment."""
        if self.targets:
            return self.targets
        return tuple(float(t) for t in envs.get_spec(self.env).targets)


@dataclass
class TrainingState:
    """What resuming a run needs beyond the weights: optimizer, schedule, random streams, progress."""

    optimizer: dict
    scheduler: dict
    rng: list
    """one dict of random-stream states per training process, rank order"""
    step: int
    train_time: float = 0.0
    history: dict = field(default_factory=dict)
    """logged evaluation curves (tag -> [(step, value), ...]) so a resumed run keeps drawing them"""


@dataclass
class DTCheckpoint:
    """A DT checkpoint in memory (nothing else indexes the dict on disk: ``to_dict``, ``from_dict``)."""

    model_config: DTConfig
    model: dict
    """the network's state_dict"""
    data: DataInfo
    config: dict = field(default_factory=dict)
    """the run's TrainConfig as a plain dict (empty for checkpoints not written by training)"""
    training: TrainingState | None = None
    ema: dict | None = None
    """the exponential moving average of the weights (a state_dict like ``model``; ``TrainConfig.ema_decay``), None
    when the run kept none: a second policy from the same training, evaluated by ``weights="ema"``"""
    origin: str = field(default="checkpoint", compare=False)
    """how errors name it; not stored"""

    @property
    def step(self) -> int:
        return self.training.step if self.training is not None else 0

    def fidelity(self, engine: str):
        """Whether ``engine``'s actions are the policy this checkpoint was trained as."""
        return stream_training.fidelity(engine, self.config)

    def build_model(self, device: str | torch.device = "cpu", weights: str = "model") -> DecisionTransformer:
        """The trained network, on ``device``, in eval mode; ``weights="ema"``: with the moving average's weights."""
        state = self.weights(weights)
        try:  # a layer's own checks (s beyond d_model) come when it is built
            model = DecisionTransformer(self.model_config)
        except ValueError as err:
            raise ValueError(f"{self.origin}: its model_config does not build a network ({err})") from err
        try:
            model.load_state_dict(state)
        except RuntimeError as err:  # torch lists every missing / unexpected / mis-shaped tensor
            raise ValueError(f"{self.origin}: its weights do not fit its model_config (layers {model.layer_names}, "
                             f"d_model {self.model_config.d_model}): {err}") from err
        return model.to(device).eval()

    def weights(self, which: str = "model") -> dict:
        """The state_dict of ``which`` weights: ``model`` (the last step's) or ``ema`` (their moving average)."""
        if which not in WEIGHTS:
            raise ValueError(f"weights={which!r}: choose one of {', '.join(WEIGHTS)}")
        if which == "ema" and self.ema is None:
            raise ValueError(f"{self.origin} holds no moving average of its weights (its run kept none: ema_decay=0, "
                             "or it was written before runs kept one); use weights=model")
        return self.model if which == "model" else self.ema

    def to_dict(self) -> dict:
        """The dict ``save`` writes: tensors and plain data only (arrays become tensors)."""
        info = self.data
        d = {"kind": KIND, "schema": SCHEMA_VERSION, "config": self.config,
             "model_config": dataclasses.asdict(self.model_config), "model": self.model,
             "data": {**vars(info), "state_mean": torch.as_tensor(info.state_mean), "targets": list(info.targets),
                      "state_std": torch.as_tensor(info.state_std), "held_out": list(info.held_out)}}
        if self.ema is not None:
            d["ema"] = self.ema
        if self.training is not None:
            d.update(dataclasses.asdict(self.training))
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = "checkpoint") -> "DTCheckpoint":
        """Parse a checkpoint dict, every field checked (``_Fields``), ``where`` naming it in errors."""
        if not isinstance(d, dict):
            raise ValueError(f"{where} is not a primal-dt checkpoint (expected a dict, got {type(d).__name__})")
        if d.get("kind") != KIND:
            raise ValueError(f"{where} holds a {d.get('kind')!r} model, expected {KIND!r}")
        schema = d.get("schema")
        if type(schema) is int and schema > SCHEMA_VERSION:
            raise ValueError(f"{where} was written by a newer primal-dt (checkpoint schema {schema}, this release "
                             f"reads {SCHEMA_VERSION}); upgrade primal-dt to read it")
        if type(schema) is not int or schema != SCHEMA_VERSION:
            raise ValueError(f"{where} has checkpoint schema {schema!r}, not {SCHEMA_VERSION}: it was not written by "
                             "primal-dt's agents.dt_checkpoint.save")
        missing = [k for k in ("model_config", "model", "data") if k not in d]
        data = d.get("data") if isinstance(d.get("data"), dict) else {}
        missing += [f"data.{k}" for k in ("env", "state_mean", "state_std", "reward_scale") if k not in data]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}: it was not written by primal_dt.train")
        f = _Fields(where)
        mc = f.model_config(d.get("model_config"))
        info = f.data_info(data, mc.state_dim)
        f.weights(d.get("model"), mc)
        ema = d.get("ema")
        if ema is not None:
            f.weights(ema, mc, "ema")
        config = d.get("config", {})
        if not (isinstance(config, dict) and all(isinstance(k, str) for k in config)):
            raise f.bad("config", "a mapping of option: value (the run's TrainConfig)", config)
        return cls(model_config=mc, model=d["model"], data=info, config=dict(config), training=f.training(d),
                   ema=ema, origin=where)


DAMAGED = "the file is damaged or was altered: resume from another checkpoint or start a new run"
"""what a checkpoint of the right kind and schema holding a malformed field is"""


class _Fields:
    """A file read without running code may still hold strings where numbers belong, or sizes no machine
    can allocate."""

    def __init__(self, where: str):
        self.where = where

    def bad(self, field_: str, want: str, got) -> ValueError:
        shown = f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else repr(got)[:60]
        return ValueError(f"{self.where}: {field_} must be {want}, got {shown}; {DAMAGED}")

    def text(self, v, field_: str, none: bool = False, empty: bool = False):
        if v is None and (none or empty):
            return None if none else ""
        if not isinstance(v, str) or not (v or empty):
            raise self.bad(field_, "a string" if empty else "a non-empty string" + (" or None" if none else ""), v)
        return v

    def number(self, v, field_: str, low: float = float("-inf"), strict: bool = False) -> float:
        """Finite and at most ``MAX_MAGNITUDE`` in size: float32, in which acting computes, holds it."""
        ok = presets.fits(v, float) and math.isfinite(v)
        if not ok or v < low or (strict and v == low):
            raise self.bad(field_, f"a finite number {'>' if strict else '>='} {low:g}" if low > float("-inf")
                           else "a finite number", v)
        if abs(v) > MAX_MAGNITUDE:
            raise self.bad(field_, f"a number of at most {MAX_MAGNITUDE:g} in size", v)
        return float(v)

    def numbers(self, v, field_: str) -> tuple[float, ...]:
        if not isinstance(v, (list, tuple, type(None))):
            raise self.bad(field_, "a list of finite numbers", v)
        return tuple(self.number(x, field_) for x in v or ())

    def counts(self, v, field_: str) -> tuple[int, ...]:
        if not isinstance(v, (list, tuple, type(None))) or not all(_integer(x, 0) for x in v or ()):
            raise self.bad(field_, "a list of integers >= 0", v)
        return tuple(v or ())

    def vector(self, v, field_: str, positive: bool = False) -> np.ndarray:
        try:
            a = np.asarray(v, dtype=np.float64)
        except (TypeError, ValueError, RuntimeError):  # (RuntimeError: a tensor that requires grad)
            a = None
        if a is None or a.ndim != 1 or not a.size or not (np.abs(a) < 1e30).all() or (positive and not (a > 0).all()):
            raise self.bad(field_, "a vector of finite numbers" + (" > 0" if positive else ""), v)
        return a.astype(np.float32)

    def data_info(self, data: dict, state_dim: int) -> DataInfo:
        """Every field checked here, so ``DataInfo``'s own checks pass."""
        g = data.get
        mean = self.vector(g("state_mean"), "data.state_mean")
        std = self.vector(g("state_std"), "data.state_std", positive=True)
        if mean.shape != (state_dim,) or std.shape != (state_dim,):
            raise ValueError(f"{self.where}: data.state_mean and data.state_std have {mean.size} and {std.size} entries "
                             f"but the model observes state_dim={state_dim}")
        env, gym_id = self.text(g("env"), "data.env"), self.text(g("gym_id"), "data.gym_id", none=True)
        try:
            simulators = envs.get_spec(env).simulators
        except (KeyError, ValueError):  # an unknown name is refused, by name, where the simulator is built
            simulators = (gym_id,)
        if gym_id is not None and gym_id not in simulators:
            raise self.bad("data.gym_id", f"the simulator of {env} ({' or '.join(simulators)})", gym_id)
        return DataInfo(env=env, state_mean=mean, state_std=std,
                        reward_scale=self.number(g("reward_scale"), "data.reward_scale", low=0.0, strict=True),
                        targets=self.numbers(g("targets"), "data.targets"),
                        gym_id=gym_id,
                        source=self.text(g("source"), "data.source", empty=True),
                        fingerprint=self.text(g("fingerprint"), "data.fingerprint", empty=True),
                        held_out=self.counts(g("held_out"), "data.held_out"))

    def model_config(self, v) -> DTConfig:
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise self.bad("model_config", "a mapping (DTConfig's fields)", v)
        hints = typing.get_type_hints(DTConfig)
        try:  # a field missing, unknown, of the wrong kind or out of range, or sizes no machine allocates
            for k, x in v.items():
                if k in hints and not presets.fits(x, hints[k]):
                    raise ValueError(f"model_config.{k} must be {presets.kind(hints[k])}, got {repr(x)[:40]}")
            mc = DTConfig(**v)
            mc.check()
            # what acting allocates per row beyond the weights (K steps of activations), as training bounds it
            layers = len(mc.layer_names()) or mc.n_layers
            check_size(mc.K * mc.tokens.per_step * mc.d_model * layers * 8,
                       f"model_config K={mc.K}, d_model={mc.d_model} and "
                       f"{layers} layers", "activation values per row")
        except (TypeError, ValueError) as err:
            raise ValueError(f"{self.where}: model_config is not a valid DTConfig ({err})") from None
        return mc

    def weights(self, v, mc: DTConfig, field_: str = "model") -> None:
        """Every tensor the network ``mc`` keeps, of its dtype and shape, checked before anything is allocated:
        the network is built on the meta device (shapes only), so a config asking for a network larger than the
        file's weights, or a crafted tensor viewing a few bytes as terabytes, is refused by name."""
        if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in v.items()):
            raise self.bad(field_, "a state_dict (parameter name -> tensor)", v)
        # even on the meta device, building a million layers takes minutes: first the sizes, against what the file
        # holds (the bytes of its storages: a stride-0 view counts for what it holds, not what it claims)
        layers = len(mc.layer_names()) or mc.n_layers
        want = layers * mc.d_model ** 2 * (4 + 2 * mc.mlp_ratio) + mc.max_timestep * mc.d_model
        held = sum(min(t.numel(), t.untyped_storage().nbytes() // t.element_size()) for t in v.values()
                   if t.layout == torch.strided)
        if want > 2 * held + 100_000:
            raise ValueError(f"{self.where}: model_config (d_model {mc.d_model}, {layers} layers, max_timestep "
                             f"{mc.max_timestep}) describes a network of about {want:.3g} parameters, but the file "
                             f"holds {held:,} weights; {DAMAGED}")
        try:
            with torch.device("meta"):
                expected = DecisionTransformer(mc).state_dict()
        except ValueError as err:  # a layer's own checks (s beyond d_model)
            raise ValueError(f"{self.where}: its model_config does not build a network ({err})") from err
        ck_io.check_state_dict(v, expected, self.where, field_)
        self.shapes = {tuple(t.shape) for t in expected.values()}

    def optimizer_values(self, opt: dict) -> None:
        """The optimizer's hyper-parameters finite (a NaN lr diverges at the first step resumed) and its state
        tensors shaped like weights, dense and finite, before ``load_state_dict`` casts (allocates) them."""
        for i, g in enumerate(opt["param_groups"]):
            for k, x in g.items():
                # finite, not bounded: training accepts any finite lr (a huge one diverges, and says so)
                if k != "params" and any(presets.fits(y, float) and not math.isfinite(y)
                                         for y in (x if isinstance(x, (list, tuple)) else (x,))):
                    raise self.bad(f"optimizer.param_groups[{i}].{k}", "finite", x)
        for i, st in opt["state"].items():
            for k, t in (st.items() if isinstance(st, dict) else ()):
                if isinstance(t, torch.Tensor) and not (
                        ck_io.holds_its_elements(t) and t.is_floating_point()
                        and (t.numel() == 1 or tuple(t.shape) in self.shapes) and bool(torch.isfinite(t).all())):
                    raise self.bad(f"optimizer.state[{i}].{k}", "a dense tensor of finite numbers shaped like a weight",
                                   t)

    def training(self, d: dict) -> TrainingState | None:
        """All of a resume's state or none (an inference-only file)."""
        present = [k for k in _RESUME_KEYS if k in d]
        if not present:
            return None
        if len(present) < 4:
            lacks = [k for k in _RESUME_KEYS if k not in d]
            raise ValueError(f"{self.where} holds {', '.join(present)} but lacks {', '.join(lacks)}: the file is "
                             "damaged or was not written by primal_dt.train")
        opt, sched, rng, step = (d[k] for k in _RESUME_KEYS)
        if not (isinstance(opt, dict) and isinstance(opt.get("state"), dict) and isinstance(opt.get("param_groups"), list)
                and opt["param_groups"] and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                for g in opt["param_groups"])):
            lacks = [k for k in ("state", "param_groups") if isinstance(opt, dict) and k not in opt]
            if lacks:
                raise ValueError(f"{self.where}: optimizer lacks {' and '.join(lacks)} (an optimizer state_dict holds "
                                 f"state and param_groups); {DAMAGED}")
            raise self.bad("optimizer", "an optimizer state_dict (state, param_groups)", opt)
        self.optimizer_values(opt)
        if not (isinstance(sched, dict) and _integer(sched.get("last_epoch"), -1)):
            raise self.bad("scheduler", "a scheduler state_dict (with last_epoch)", sched)
        if not (isinstance(rng, list) and rng):
            raise self.bad("rng", "a list of random-stream states (torch, numpy, sampler) per process", rng)
        fault = next(((i, f) for i, r in enumerate(rng) if (f := _rng_fault(r))), None)
        if fault is not None:
            raise ValueError(f"{self.where}: rng[{fault[0]}] (process {fault[0]}'s random streams): {fault[1]}; "
                             f"{DAMAGED}")
        if not (_integer(step, 0) and step <= MAX_MAGNITUDE):
            raise self.bad("step", f"an integer >= 0 and at most {MAX_MAGNITUDE:g}", step)
        history = d.get("history", {})
        if not (isinstance(history, dict) and all(isinstance(k, str) and _curve(c) for k, c in history.items())):
            raise self.bad("history", "a mapping of tag -> [(step, value), ...]", history)
        return TrainingState(opt, sched, rng, step, self.number(d.get("train_time", 0.0), "train_time", low=0.0),
                             {k: [(int(s), float(x)) for s, x in c] for k, c in history.items()})


def _integer(v, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _curve(c) -> bool:
    """(step, value) pairs; values may be NaN (an evaluation that diverged is logged as such)."""
    return isinstance(c, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and _integer(p[0], 0) and presets.fits(p[1], float) for p in c)


def _rng_fault(r) -> str | None:
    """What is wrong with one process's random streams as ``agents.training`` saves them (torch's, numpy's, the
    sampler's), or None."""
    if not isinstance(r, dict):
        return "is not a mapping of random streams"
    if not (isinstance(r.get("torch"), torch.Tensor) and r["torch"].dtype == torch.uint8):
        return "torch is not torch's random state (a uint8 tensor)"
    n = r.get("numpy")
    if not (isinstance(n, dict) and isinstance(n.get("name"), str) and isinstance(n.get("keys"), torch.Tensor)
            and n["keys"].shape == (624,) and _integer(n.get("pos"), 0) and n["pos"] <= 624
            and n.get("has_gauss") in (0, 1) and isinstance(n.get("cached_gaussian"), (int, float))):
        return "numpy is not numpy's random state (name, 624 keys, pos <= 624, has_gauss, cached_gaussian)"
    if not isinstance(r.get("sampler"), dict) or not _sampler_state(r["sampler"]):
        return ("sampler is not the sampler's generator state (PCG64: state and inc below 2**128, has_uint32 0 or 1, "
                "uinteger below 2**32)")
    return None


def _sampler_state(s: dict) -> bool:
    """The sampler's numpy bit generator (PCG64: 128-bit state and increment, a cached 32-bit word), each number
    in its range: numpy takes a larger one only to raise OverflowError."""
    g = s.get("bit_generator")
    st = g.get("state") if isinstance(g, dict) else None
    return (isinstance(g, dict) and isinstance(g.get("bit_generator"), str) and isinstance(st, dict)
            and all(_integer(st.get(k), 0) and st[k] < 2 ** 128 for k in ("state", "inc"))
            and g.get("has_uint32") in (0, 1) and _integer(g.get("uinteger"), 0) and g["uinteger"] < 2 ** 32)


def numpy_state() -> dict:
    """numpy's global stream as what ``torch.load(weights_only=True)`` reads."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def set_numpy_state(state: dict) -> None:
    keys = state["keys"].numpy().astype(np.uint32)
    np.random.set_state((state["name"], keys, state["pos"], state["has_gauss"], state["cached_gaussian"]))


def resolve(path: str | Path, option: str = "checkpoint") -> Path:
    """A checkpoint file, a run directory's last.pt, or the newest run's of a directory of runs."""
    return ck_io.find(path, FILENAME, option)


def save(ck: DTCheckpoint, path: str | Path) -> Path:
    """Write ``ck`` atomically (a failed write is a ``WriteError``)."""
    return ck_io.save_atomic(ck.to_dict(), path, what=f"checkpoint (step {ck.step})")


def check_data(info: DataInfo, data, where: str = "checkpoint") -> None:
    """Refuse data (``envs.Trajectories``) other than what the checkpoint was trained on: the content
    fingerprint decides (the same data moved passes; a file changed under its path does not)."""
    if not info.fingerprint:
        raise ValueError(f"{where} records no dataset fingerprint (it was not written by primal_dt.train), so no data "
                         "can be checked against it; train the model with primal_dt.train")
    if data.fingerprint != info.fingerprint:
        raise ValueError(
            f"{where} was trained on {info.source or 'an unrecorded source'} (dataset fingerprint "
            f"{info.fingerprint[:19]}), but the data read now from {data.source} differs (fingerprint "
            f"{data.fingerprint[:19]}): the file was changed or replaced, or it is another dataset. Use the data "
            "the run was trained on, or start a new run")


def training_data(ck: DTCheckpoint, source: str | None = None, verbose: bool = True):
    """The dataset ``ck`` was trained on, read the way its run read it (``source`` overrides where from)."""
    ds = envs.load_dataset(ck.data.env, source=source or ck.config.get("data_source") or "auto", verbose=verbose,
                           clip_actions=bool(ck.config.get("data_clip_actions", False)))
    check_data(ck.data, ds, ck.origin)
    return ds


def load(path: str | Path | dict) -> DTCheckpoint:
    """Read a checkpoint file or run directory (or parse an already-loaded dict)."""
    if isinstance(path, DTCheckpoint):
        return path
    if isinstance(path, dict):
        return DTCheckpoint.from_dict(path)
    p = resolve(path)
    return DTCheckpoint.from_dict(ck_io.load(p), where=f"checkpoint {p}")
