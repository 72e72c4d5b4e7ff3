"""The Decision-Transformer checkpoint: one schema (``DTCheckpoint``, ``DataInfo``, ``TrainingState``), one
writer (``save``), one reader (``load``). Each stored field declares itself once, beside its annotation
(``stored``): the check that reads it back, and the key it has in an exported policy's metadata if any; the
writer (``to_dict``), the reader (``from_dict``) and the export metadata (``exported``) are walks over those
declarations, so a new field is one line here. On disk, a dict of tensors and plain data, the ``TrainingState``
fields at its top level and absent in inference-only files. Every field is checked when read: a damaged or
crafted file, one lacking a field or holding one this release does not know, is one ValueError naming the file
and the field.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import MISSING, dataclass, field
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
ENVELOPE = ("kind", "schema")
"""the keys that say what a file is, read before its fields"""
WEIGHTS = ("model", "ema")
"""the weights a checkpoint may hold: the last step's, and their moving average (``DTCheckpoint.ema``)"""


def stored(check: str = "", *, record: type | None = None, flat: bool = False, omitted_when_none: bool = False,
           then: str = "", export: str = "", exported=None, default=MISSING, default_factory=MISSING,
           **options) -> dataclasses.Field:
    """A checkpoint field, declared once: ``check`` names the ``_Reader`` method that reads its stored value back
    (``options`` are that method's own: ``low=0.0``, ``empty=True`` ...); ``record``: the field is a dataclass of
    stored fields, read by its own declarations (``flat``: its fields stand at this level of the file, not under
    the field's name), then ``then`` (a ``_Reader`` method over the values read: checks across fields);
    ``omitted_when_none``: the writer leaves a None value out, so absence reads back as None (any other field a
    file lacks is an error); ``export``: the key it has in an exported policy's metadata, with the value
    ``exported(owner)`` (default: the field's stored form)."""
    if bool(check) == (record is not None):
        raise TypeError("a stored field has either a check or a record")
    meta = {"check": check, "options": options, "record": record, "flat": flat, "omitted_when_none": omitted_when_none,
            "then": then, "export": export, "exported": exported}
    return field(default=default, default_factory=default_factory, metadata={"stored": meta})


def stored_fields(cls: type) -> list[tuple[str, dict]]:
    """``cls``'s stored fields in declaration order (the order they are read: later checks use earlier fields),
    as (name, declaration); a field of a stored record that declares none would be written by no writer and
    read by no reader: a TypeError at the first save or load."""
    out = []
    for f in dataclasses.fields(cls):
        if "stored" in f.metadata:
            out.append((f.name, f.metadata["stored"]))
        elif f.init and f.compare:  # (``origin``: how errors name it, never stored)
            raise TypeError(f"{cls.__name__}.{f.name} declares no check: declare it with stored(...)")
    return out


def _keys(cls: type) -> list[str]:
    """The keys ``cls``'s fields take at its level of the file (a flat record's, its own fields')."""
    return [k for name, m in stored_fields(cls) for k in (_keys(m["record"]) if m["flat"] else [name])]


def _disk(v):
    """A value as the file holds it: tensors and plain data only."""
    if isinstance(v, np.ndarray):
        return torch.as_tensor(v)
    if isinstance(v, tuple):
        return list(v)
    if dataclasses.is_dataclass(v):
        return dataclasses.asdict(v)
    return v


def _plain(v):
    """A value as JSON holds it (an exported policy's metadata)."""
    return v.tolist() if isinstance(v, np.ndarray) else list(v) if isinstance(v, tuple) else v


def _to_disk(obj, cls: type) -> dict:
    """``obj`` (a ``cls``) as the file holds it, field by declared field."""
    d = {}
    for name, m in stored_fields(cls):
        v = getattr(obj, name)
        if v is None and m["omitted_when_none"]:
            continue
        if m["record"] is None:
            d[name] = _disk(v)
        elif m["flat"]:
            d.update(_to_disk(v, m["record"]))
        else:
            d[name] = _to_disk(v, m["record"])
    return d


def _layout(cls: type, d: dict, prefix: str = "") -> tuple[list[str], list[str]]:
    """The fields ``d`` (the level ``prefix`` of a file) lacks and those it holds that ``cls`` does not declare,
    through its records: (missing, unknown), each named by its path (``data.env``)."""
    missing: list[str] = []
    unknown = [f"{prefix}{k}" for k in d if k not in _keys(cls) and not (k in ENVELOPE and not prefix)]
    for name, m in stored_fields(cls):
        rec = m["record"]
        if rec is not None and m["flat"]:
            if m["omitted_when_none"] and not any(k in d for k in _keys(rec)):
                continue  # an inference-only file: all of a resume's state or none
            missing += _layout(rec, d, prefix)[0]  # (what else this level holds is judged here, above)
        elif name not in d:
            if not m["omitted_when_none"]:
                missing.append(prefix + name)
                if rec is not None:  # all of it, so the message says what a whole file holds
                    missing += _layout(rec, {}, f"{prefix}{name}.")[0]
        elif rec is not None and isinstance(d[name], dict):
            lacks, extra = _layout(rec, d[name], f"{prefix}{name}.")
            missing, unknown = missing + lacks, unknown + extra
    return missing, unknown


def exported(ck: DTCheckpoint) -> dict:
    """The exported policy's metadata drawn from the checkpoint: every stored field that declares ``export``,
    by its key (``agents.export.metadata`` adds the graph's own description)."""
    out = {}

    def walk(obj, cls):
        for name, m in stored_fields(cls):
            v = getattr(obj, name)
            if m["export"]:
                out[m["export"]] = m["exported"](obj) if m["exported"] else _plain(v)
            if m["record"] is not None and v is not None:
                walk(v, m["record"])

    walk(ck, DTCheckpoint)
    return out


@dataclass
class DataInfo:
    """The dataset a model was trained on, and the bookkeeping an agent must repeat at inference."""

    env: str = stored("text", export="env")
    """dataset name (D4RL naming, e.g. hopper-medium); envs.get_spec(env) gives its simulator"""
    state_mean: np.ndarray = stored("vector")
    """[state_dim] float32: observations are normalised as (obs - state_mean) / state_std"""
    state_std: np.ndarray = stored("vector", positive=True)
    reward_scale: float = stored("number", low=0.0, strict=True, export="reward_scale")
    """returns-to-go are *divided* by this, everywhere in the package (the DT papers: 1000)"""
    targets: tuple[float, ...] = stored("numbers", default=(), export="targets",
                                        exported=lambda info: list(info.eval_targets))
    """return-to-go targets (raw returns) the run evaluated; the first is an agent's default"""
    gym_id: str | None = stored("text", none=True, default=None, export="gym_id")
    """the simulator id the data was recorded with (None: the env spec's own)"""
    source: str = stored("text", empty=True, default="", export="data_source")
    """where the data came from (file path, Minari id, replica), as printed by envs.load_dataset"""
    fingerprint: str = stored("text", empty=True, default="", export="data_fingerprint",
                              exported=lambda info: info.fingerprint or None)
    """content hash of the arrays trained on (``envs.Trajectories.fingerprint``); '' only if made in code"""
    held_out: tuple[int, ...] = stored("counts", default=())
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

    optimizer: dict = stored("optimizer")
    scheduler: dict = stored("scheduler")
    rng: list = stored("rng")
    """one dict of random-stream states per training process, rank order"""
    step: int = stored("step")
    train_time: float = stored("number", low=0.0, default=0.0)
    history: dict = stored("history", default_factory=dict)
    """logged evaluation curves (tag -> [(step, value), ...]) so a resumed run keeps drawing them"""


@dataclass
class DTCheckpoint:
    """A DT checkpoint in memory (nothing else indexes the dict on disk: ``to_dict``, ``from_dict``). Its fields
    are read in this order: the weights are checked against ``model_config``, the optimizer's state against the
    weights' shapes."""

    model_config: DTConfig = stored("model_config")
    model: dict = stored("weights")
    """the network's state_dict"""
    data: DataInfo = stored(record=DataInfo, then="statistics")
    config: dict = stored("config", default_factory=dict)
    """the run's TrainConfig as a plain dict (empty for checkpoints not written by training)"""
    training: TrainingState | None = stored(record=TrainingState, flat=True, omitted_when_none=True, default=None,
                                            export="train_step", exported=lambda ck: ck.step)
    ema: dict | None = stored("weights", omitted_when_none=True, default=None)
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
        """The dict ``save`` writes: every stored field (arrays become tensors), under the envelope."""
        return {"kind": KIND, "schema": SCHEMA_VERSION, **_to_disk(self, DTCheckpoint)}

    @classmethod
    def from_dict(cls, d: dict, where: str = "checkpoint") -> "DTCheckpoint":
        """Parse a checkpoint dict, every field checked by its declaration (``stored``), ``where`` naming it in
        errors."""
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
        missing, unknown = _layout(cls, d)
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}: it was not written by primal_dt.train of this "
                             "release (an older one wrote it, or it was altered); use a checkpoint this release wrote, "
                             "or train again")
        if unknown:
            raise ValueError(f"{where} holds field{'s' * (len(unknown) > 1)} {', '.join(map(str, unknown))} that this "
                             "release of primal-dt does not read (a newer one wrote it, or it was altered); read it "
                             "with the release that wrote it, or use another checkpoint")
        return cls(**_Reader(where, _reach(d)).values(cls, d, ""), origin=where)


DAMAGED = "the file is damaged or was altered: resume from another checkpoint or start a new run"
"""what a checkpoint of the right kind and schema holding a malformed field is"""


def _reach(d: dict) -> float | None:
    """How far the file's own training could have moved a weight (None: it records no training): AdamW moves
    each by at most a few learning rates per step, so weights beyond ``ck_io.WEIGHT_LIMIT`` within this reach
    are a run that diverged, not a damaged file."""
    opt, step = d.get("optimizer"), d.get("step")
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if not (isinstance(groups, list) and _integer(step, 1)):
        return None
    lrs = [abs(x) for g in groups if isinstance(g, dict) for k in ("lr", "initial_lr")
           if presets.fits(x := g.get(k), float) and math.isfinite(x)]
    return 10 * max(lrs) * step if lrs else None


class _Reader:
    """Reads stored fields back by their declarations. A file read without running code may still hold strings
    where numbers belong, or sizes no machine can allocate: each check method returns the value read or raises
    one ValueError naming the file (``where``) and the field. Checks that need an earlier field read it from
    here (``mc``: the model config; ``shapes``: its weights')."""

    def __init__(self, where: str, reach: float | None = None):
        self.where = where
        self.reach = reach
        self.mc: DTConfig | None = None
        self.shapes: set[tuple[int, ...]] = set()

    def values(self, cls: type, d, path: str) -> dict:
        """``cls``'s fields read from ``d`` (the file's level ``path``), each by its declaration; ``_layout`` has
        already refused what is missing or unknown."""
        if not isinstance(d, dict):
            raise self.bad(path.rstrip("."), f"a mapping ({cls.__name__}'s fields)", d)
        values = {}
        for name, m in stored_fields(cls):
            rec = m["record"]
            if rec is not None and m["flat"]:
                present = any(k in d for k in _keys(rec))
                values[name] = self.record(rec, d, path, m["then"]) if present or not m["omitted_when_none"] else None
            elif name not in d:  # left out by the writer (``omitted_when_none``)
                values[name] = None
            elif rec is not None:
                values[name] = self.record(rec, d[name], f"{path}{name}.", m["then"])
            else:
                values[name] = getattr(self, m["check"])(d[name], path + name, **m["options"])
        return values

    def record(self, cls: type, d, path: str, then: str = ""):
        """A stored record read, its checks across fields (``then``) passed before it is built, so its own
        ``__post_init__`` checks cannot fire with a message that names no file."""
        values = self.values(cls, d, path)
        if then:
            getattr(self, then)(values, path)
        return cls(**values)

    def bad(self, field_: str, want: str, got) -> ValueError:
        shown = f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else repr(got)[:60]
        return ValueError(f"{self.where}: {field_} must be {want}, got {shown}; {DAMAGED}")

    # -- the checks a field names (``stored("number", low=0.0)``): each (value, field name, options) -> value ------
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

    def config(self, v, field_: str) -> dict:
        if not (isinstance(v, dict) and all(isinstance(k, str) for k in v)):
            raise self.bad(field_, "a mapping of option: value (the run's TrainConfig)", v)
        return dict(v)

    def model_config(self, v, field_: str) -> DTConfig:
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise self.bad(field_, "a mapping (DTConfig's fields)", v)
        hints = typing.get_type_hints(DTConfig)
        try:  # a field missing, unknown, of the wrong kind or out of range, or sizes no machine allocates
            names = [f.name for f in dataclasses.fields(DTConfig) if f.init]
            lacks, unknown = [k for k in names if k not in v], [k for k in v if k not in names]
            if lacks or unknown:  # the writer saves every field: one left out would come back as its default
                raise ValueError("; ".join([f"it lacks {', '.join(lacks)}"] * bool(lacks) + [
                    f"it holds {', '.join(unknown)}, which DTConfig has not"] * bool(unknown)))
            for k, x in v.items():
                if k in hints and not presets.fits(x, hints[k]):
                    raise ValueError(f"{field_}.{k} must be {presets.kind(hints[k])}, got {repr(x)[:40]}")
            mc = DTConfig(**v)
            mc.check()
            # what acting allocates per row beyond the weights (K steps of activations), as training bounds it
            layers = len(mc.layer_names()) or mc.n_layers
            check_size(mc.K * mc.tokens.per_step * mc.d_model * layers * 8, f"{field_} K={mc.K}, d_model={mc.d_model} and "
                       f"{layers} layers", "activation values per row")
        except (TypeError, ValueError) as err:
            raise ValueError(f"{self.where}: {field_} is not a valid DTConfig ({err})") from None
        self.mc = mc
        return mc

    def weights(self, v, field_: str) -> dict:
        """Every tensor the network ``self.mc`` keeps, of its dtype and shape, checked before anything is allocated:
        the network is built on the meta device (shapes only), so a config asking for a network larger than the
        file's weights, or a crafted tensor viewing a few bytes as terabytes, is refused by name."""
        mc = self.mc
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
        ck_io.check_state_dict(v, expected, self.where, field_, reach=self.reach)
        self.shapes = {tuple(t.shape) for t in expected.values()}
        return v

    def statistics(self, data: dict, path: str) -> None:
        """Across ``DataInfo``'s fields: the statistics as long as the model's observations (so ``DataInfo``'s own
        checks pass), the simulator one of the dataset's."""
        mean, std, state_dim = data["state_mean"], data["state_std"], self.mc.state_dim
        if mean.shape != (state_dim,) or std.shape != (state_dim,):
            raise ValueError(f"{self.where}: {path}state_mean and {path}state_std have {mean.size} and {std.size} "
                             f"entries but the model observes state_dim={state_dim}")
        env, gym_id = data["env"], data["gym_id"]
        try:
            simulators = envs.get_spec(env).simulators
        except (KeyError, ValueError):  # an unknown name is refused, by name, where the simulator is built
            simulators = (gym_id,)
        if gym_id is not None and gym_id not in simulators:
            raise self.bad(f"{path}gym_id", f"the simulator of {env} ({' or '.join(simulators)})", gym_id)

    def optimizer(self, opt, field_: str) -> dict:
        """An optimizer state_dict: its hyper-parameters finite (a NaN lr diverges at the first step resumed) and
        its state tensors shaped like weights, dense and finite, before ``load_state_dict`` casts (allocates)
        them."""
        if not (isinstance(opt, dict) and isinstance(opt.get("state"), dict) and isinstance(opt.get("param_groups"), list)
                and opt["param_groups"] and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                for g in opt["param_groups"])):
            lacks = [k for k in ("state", "param_groups") if isinstance(opt, dict) and k not in opt]
            if lacks:
                raise ValueError(f"{self.where}: {field_} lacks {' and '.join(lacks)} (an optimizer state_dict holds "
                                 f"state and param_groups); {DAMAGED}")
            raise self.bad(field_, "an optimizer state_dict (state, param_groups)", opt)
        for i, g in enumerate(opt["param_groups"]):
            for k, x in g.items():
                # finite, not bounded: training accepts any finite lr (a huge one diverges, and says so)
                if k != "params" and any(presets.fits(y, float) and not math.isfinite(y)
                                         for y in (x if isinstance(x, (list, tuple)) else (x,))):
                    raise self.bad(f"{field_}.param_groups[{i}].{k}", "finite", x)
        for i, st in opt["state"].items():
            for k, t in (st.items() if isinstance(st, dict) else ()):
                if isinstance(t, torch.Tensor) and not (
                        ck_io.holds_its_elements(t) and t.is_floating_point()
                        and (t.numel() == 1 or tuple(t.shape) in self.shapes) and bool(torch.isfinite(t).all())):
                    raise self.bad(f"{field_}.state[{i}].{k}", "a dense tensor of finite numbers shaped like a weight",
                                   t)
        return opt

    def scheduler(self, sched, field_: str) -> dict:
        if not (isinstance(sched, dict) and _integer(sched.get("last_epoch"), -1)):
            raise self.bad(field_, "a scheduler state_dict (with last_epoch)", sched)
        return sched

    def rng(self, rng, field_: str) -> list:
        if not (isinstance(rng, list) and rng):
            raise self.bad(field_, "a list of random-stream states (torch, numpy, sampler) per process", rng)
        fault = next(((i, f) for i, r in enumerate(rng) if (f := _rng_fault(r))), None)
        if fault is not None:
            raise ValueError(f"{self.where}: {field_}[{fault[0]}] (process {fault[0]}'s random streams): {fault[1]}; "
                             f"{DAMAGED}")
        return rng

    def step(self, step, field_: str) -> int:
        if not (_integer(step, 0) and step <= MAX_MAGNITUDE):
            raise self.bad(field_, f"an integer >= 0 and at most {MAX_MAGNITUDE:g}", step)
        return step

    def history(self, history, field_: str) -> dict:
        if not (isinstance(history, dict) and all(isinstance(k, str) and _curve(c) for k, c in history.items())):
            raise self.bad(field_, "a mapping of tag -> [(step, value), ...]", history)
        return {k: [(int(s), float(x)) for s, x in c] for k, c in history.items()}


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
