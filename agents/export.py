"""Export a Decision-Transformer checkpoint's stream step as one graph (ONNX or TorchScript).

    python -m agents.export checkpoint=runs/hopper-medium/primal+dt/<run> format=onnx out=policy.onnx

The artefact is ``DTStep.forward``, the one step function the torch agent runs (so actions agree to
1e-5), with explicit state (``state.<name>`` in, ``next_state.<name>`` out) and any batch. Its metadata
travels inside it (``SEMANTICS`` says the rest). ONNX goes through ``torch.export`` (the ``export``
extra); a layer whose state grows with the episode cannot be exported (a ValueError names it).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

import primal_dt
from primal_dt.run import checkpoint as ck_io, errors, json_reader, options

from . import dt_checkpoint
from .decision_transformer import DTStep, softmax_stream_window
from .dt_checkpoint import DataInfo, DTCheckpoint
from .onnx_policy import (FORMAT, INPUTS, METADATA_KEY, SCHEMA, STATE_IN, STATE_OUT, GraphPolicy, OnnxPolicy,
                          StreamNotTrainedWarning, stream_note)
from .ring_writes import onnx_translations, scatter_nd_writes
from .token_layouts import TOKENS

FORMATS = {"onnx": "policy.onnx", "torchscript": "policy.torchscript.pt"}
"""format -> the artefact's default file name (next to the checkpoint)"""
OPSET = 18
"""ONNX opset: LayerNormalization is one operator from 17 on; torch.export's exporter writes 18 and up"""
_BATCH = "batch"


def stream_step(model, data: DataInfo) -> DTStep:
    """The model's ``DTStep``; a ValueError naming every layer whose state cannot be a graph's."""
    step = DTStep(model.eval(), data.state_mean, data.state_std, data.reward_scale)
    grows = [f"layer {i} ({spec.attention}): its recurrent state is a cache of every token of the sequence (it "
             "grows with the episode), which a graph with fixed-size state tensors cannot hold"
             for i, (spec, form) in enumerate(zip(model.stack.specs, step.layers.forms)) if form.grows]
    if grows:
        raise ValueError("this model's stream step cannot be exported: " + "; ".join(grows) + ". Exportable layers "
                         "have a fixed-size recurrent state (softmax, primal, the linear-attention family)")
    return step


SEMANTICS = """\
One call = one environment step for B rows (episodes). Inputs: observation [B, obs_dim] float32 (raw, as the \
simulator returns it), reward [B] float32 (the reward of the previous step; ignored at a row's first step), \
reset [B] bool (True: the row starts a new episode at this step; its state is zeroed first, except the \
entries marked masked_by a flag, which the zeroed flag hides: zeroing them too is equivalent), target [B] \
float32 (the return to aim for, raw units; read at a row's first step only), then the state tensors \
(state.<name>, layout in "state"). Outputs: action [B, act_dim] in [-1, 1], then next_state.<name>, to pass \
back at the next call. A fresh state is all zeros (initial value 0 for every tensor), and a row whose \
timestep t is 0 is at its first step, so the first call for a row needs reset=True or a zero state. \
Bookkeeping inside: R_0 = target / reward_scale, R_t = R_{{t-1}} - reward / reward_scale; observations \
normalised as (obs - state_mean) / state_std; the chunk ({chunk}) enters the stack (at t = 0 the previous \
step's tokens are padding) and the action is read from {predictor}'s top-layer output. Rows never interact: \
they may restart (reset) or leave (drop their rows of every state tensor) independently. What a streamed token \
sees (the stream semantics, agents/decision_transformer.py): primal without a window, running means of q and k \
over the whole episode; primal or softmax with window=w, the last w tokens; softmax without a window, the last \
{window} tokens; the linear family (linear, performer, cosformer, kerformer, flowformer), prefix sums over the \
episode. A cosformer layer returns NaN for a row once its episode passes max_len tokens."""


def semantics(step: DTStep) -> str:
    """``SEMANTICS`` for the step's token layout (its symbols: ``agents.token_layouts.TOKENS``)."""
    tokens = step.model.tokens
    chunk = ", ".join(TOKENS[k].symbol + ("_{t-1}" if dt else "_t") for k, dt in tokens.chunk)
    return SEMANTICS.format(chunk=chunk, predictor=f"{TOKENS[tokens.predict_from].symbol}_t",
                            window=softmax_stream_window(step.model))


def missing_package() -> str | None:
    """The first package of the ``export`` extra that is not installed, or None."""
    import importlib.util

    return next((m for m in ("onnx", "onnxruntime", "onnxscript") if importlib.util.find_spec(m) is None), None)


def package_version() -> str:
    from importlib import metadata

    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version("primal-dt")
    return "unknown"


@functools.cache
def source_digest() -> str:
    """The SHA-256 of this package's own source (every ``.py`` file of ``agents`` and ``primal_dt``): what makes a
    graph, down to how a ring is written. The package version stays the same between development commits, so a
    cached export keyed by it alone would outlive the code that made it (an older, slower graph acting on)."""
    h = hashlib.sha256()
    for root in (Path(__file__).parent, Path(primal_dt.__file__).parent):
        for f in sorted(root.rglob("*.py")):
            h.update(f.relative_to(root.parent).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def metadata(step: DTStep, ck: DTCheckpoint, sha256: str | None, source: str, fmt: str) -> dict:
    """The JSON document stored in the artefact (checked by ``onnx_policy.check_metadata`` when read): the
    graph's own description, and what the checkpoint's fields declare exported (``dt_checkpoint.exported``)."""
    cfg, kinds = ck.model_config, step.model.layer_names
    stream = ck.fidelity("stream")  # whether this stream is the policy the checkpoint was trained as
    return {
        "format": FORMAT, "schema": SCHEMA, "artefact": fmt, **dt_checkpoint.exported(ck),
        "obs_dim": cfg.state_dim, "act_dim": cfg.act_dim, "default_target": ck.data.eval_targets[0],
        "K": cfg.K, "max_timestep": cfg.max_timestep,
        "layers": kinds, "d_model": cfg.d_model, "n_heads": cfg.n_heads,
        "softmax_stream_window": softmax_stream_window(step.model),
        "inputs": [{"name": name, "shape": [_BATCH, *dims], "dtype": dtype} for name, dims, dtype in (
            ("observation", [cfg.state_dim], "float32"), ("reward", [], "float32"), ("reset", [], "bool"),
            ("target", [], "float32"))],
        "outputs": [{"name": "action", "shape": [_BATCH, cfg.act_dim], "dtype": "float32"}],
        "state": [{"name": s.name, "shape": [_BATCH, *s.shape], "dtype": str(s.dtype).removeprefix("torch."),
                   "initial": 0, "what": _what(s.name, kinds), **({"masked_by": s.masked_by} if s.masked_by else {})}
                  for s in step.specs],
        "semantics": semantics(step), "package_version": package_version(), "torch_version": torch.__version__,
        "checkpoint": source, "checkpoint_sha256": sha256,
        "stream_exact": stream.exact, "stream_window": stream.stream_window, "stream_from_start": stream.from_start,
        "stream_whole_episodes": stream.whole_episodes,
    }


def _what(name: str, kinds: list[str]) -> str:
    fixed = {"t": "timestep of the row's episode", "rtg": "return-to-go R_t / reward_scale",
             "prev_action": "the action of the previous step (a_{t-1})"}
    if name in fixed:
        return fixed[name]
    layer, _, part = name.partition(".")
    return f"{layer} ({kinds[int(layer.removeprefix('layer'))]}) state: {part}"


def export_policy(source, format: str = "onnx", out: str | Path | None = None, *, overwrite: bool = False) -> Path:
    """Write ``source``'s stream step (a checkpoint file, its run directory, or a ``DTCheckpoint``) as
    ``format`` to ``out`` (default: next to the checkpoint), atomically; an existing file is replaced only
    with ``overwrite=True``, never the checkpoint itself."""
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; choose one of {', '.join(FORMATS)}")
    path = None if isinstance(source, DTCheckpoint) else dt_checkpoint.resolve(source)
    ck = dt_checkpoint.load(source if path is None else path)
    if out is None or str(out) == "":
        if path is None:
            raise ValueError("out=PATH is required when exporting a checkpoint held in memory")
        out = path.parent / FORMATS[format]
    out = Path(out)
    if path is not None and out.exists() and out.resolve() == path.resolve():
        raise ValueError(f"out={out} is the checkpoint being exported; choose another path")
    if out.is_dir():
        raise ValueError(f"out={out} is a directory; give a file path, e.g. {out / FORMATS[format]}")
    suffix = Path(FORMATS[format]).suffix
    if out.suffix.lower() in {".onnx", ".pt", ".pth"} - {suffix}:  # read back later as the other kind of file
        raise ValueError(f"out={out} ends {out.suffix}, but a format={format} export is a {suffix} file: name it "
                         f"{out.with_suffix(suffix).name}, or pass the format the name says")
    if out.exists() and not overwrite:
        raise ValueError(f"out={out} exists; choose another path, or pass overwrite=true to replace it")
    step = stream_step(ck.build_model("cpu"), ck.data)
    meta = metadata(step, ck, None if path is None else ck_io.sha256_file(path),
                    ck.origin if path is None else str(path), format)
    data = (_onnx_bytes if format == "onnx" else _torchscript_bytes)(step, meta)
    ck_io.remove_stale_temps(out.parent, names=(out.name,))  # a killed export's temporary file
    try:  # without overwrite, refusing an existing file and writing are one step: of two exports, one wins
        return ck_io.write_atomic(out, data, f"exported {format} policy", replace=overwrite)
    except FileExistsError:
        raise ValueError(f"out={out} exists (written while this export ran); choose another path, or pass "
                         "overwrite=true to replace it") from None


def _example(step: DTStep, batch: int = 2):
    """Two rows to trace with, one at its first step and one further on."""
    obs = torch.randn(batch, step.model.cfg.state_dim)
    state = step.init(batch)._replace(t=torch.arange(batch, dtype=torch.int64))
    return (obs, torch.zeros(batch), torch.zeros(batch, dtype=torch.bool), torch.full((batch,), 1000.0),
            *state.flat())


def _onnx_bytes(step: DTStep, meta: dict) -> bytes:
    import onnx

    example = _example(step)
    inputs = [*INPUTS, *(STATE_IN + s.name for s in step.specs)]
    outputs = ["action", *(STATE_OUT + s.name for s in step.specs)]
    batch = torch.export.Dim(_BATCH)
    log = logging.getLogger("torch.onnx")  # the exporter prints its progress: the command's output is its own
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        # (a softmax ring's write: one ScatterND, ``ring_writes``)
        with warnings.catch_warnings(), torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), \
                scatter_nd_writes(step):
            warnings.simplefilter("ignore")  # the exporter's notes are not about the user's input
            dims = (*({0: batch} for _ in INPUTS), tuple({0: batch} for _ in example[len(INPUTS):]))  # any batch
            program = torch.onnx.export(step, example, dynamo=True, input_names=inputs, output_names=outputs,
                                        dynamic_shapes=dims, opset_version=OPSET, verbose=False,
                                        custom_translation_table=onnx_translations())
    finally:
        log.setLevel(level)
    model = program.model_proto
    model.metadata_props.add(key=METADATA_KEY, value=json.dumps(meta))
    model.producer_name = "primal-dt agents.export"
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _torchscript_bytes(step: DTStep, meta: dict) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # torch.jit's deprecation and tracer notes are not about the user's input
        traced = torch.jit.trace(step, _example(step), check_trace=False)
        # weights become constants, and TorchScript's inference passes fuse what they can
        traced = torch.jit.optimize_for_inference(torch.jit.freeze(traced))
        torch.jit.save(traced, buf, _extra_files={METADATA_KEY + ".json": json.dumps(meta)})
    return buf.getvalue()


def read_metadata(path: str | Path) -> dict:
    """The metadata document of an exported policy (ONNX or TorchScript), read and checked as its runtime does."""
    path = Path(path)
    torchscript = path.is_file() and path.read_bytes()[:2] == b"PK"  # TorchScript archives are zip files
    with warnings.catch_warnings():  # the metadata says whether the stream is exact; a reader decides what to say
        warnings.simplefilter("ignore", StreamNotTrainedWarning)
        return (TorchScriptPolicy if torchscript else OnnxPolicy)(path).metadata


class TorchScriptPolicy(GraphPolicy):
    """An exported TorchScript policy with the ``Agent`` API. ``threads``: torch's intra-op threads, set for
    the whole process (None: left as they are)."""

    runtime = "torchscript"

    def __init__(self, path, threads: int | None = None):
        path = Path(path)
        if not path.is_file():
            what = "is a directory, not an exported policy file" if path.is_dir() else "does not exist"
            raise FileNotFoundError(f"policy {path} {what} (export one with python -m agents.export "
                                    "checkpoint=RUN format=torchscript out=PATH)")
        extra = {METADATA_KEY + ".json": ""}
        try:
            self.module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
        except RuntimeError as err:
            raise ValueError(f"{path} is not a readable TorchScript file: {err}") from err
        text = extra[METADATA_KEY + ".json"]
        if not text:
            raise ValueError(f"{path} is a TorchScript file without primal-dt policy metadata; export one with "
                             "python -m agents.export format=torchscript")
        super().__init__(json_reader.parse(text, f"{path} policy metadata"), str(path))
        if threads is not None:
            options.check_number("threads", threads, options.AT_LEAST_1)
            torch.set_num_threads(int(threads))

    def _step(self, obs, reward):
        r = np.zeros(self.batch, dtype=np.float32) if reward is None else reward
        inputs = [np.ascontiguousarray(obs, dtype=np.float32), r, self._reset, self._target_rows, *self._state]
        with torch.inference_mode():
            action, *state = self.module(*(torch.from_numpy(a) for a in inputs))
        self._state = [s.numpy() for s in state]
        self._reset.fill(False)
        return action.numpy().copy()  # action and next_state.prev_action are one tensor in the graph


@dataclass
class ExportConfig:
    checkpoint: str = ""
    """kind="dt" checkpoint written by primal_dt.train (file or run directory)"""
    format: Literal["onnx", "torchscript"] = "onnx"
    """the artefact's format"""
    out: str = ""
    """artefact path ('' : policy.onnx / policy.torchscript.pt next to the checkpoint)"""
    overwrite: bool = False
    """replace an existing out file"""


def run(argv: list[str]) -> Path:
    """What ``python -m agents.export`` does; bad input is a ``SetupError``."""
    from primal_dt.run.cli import parse

    cfg = parse(ExportConfig, argv, prog="python -m agents.export",
                description="Export a Decision-Transformer checkpoint's stream step (the agent's whole act, recurrent "
                            "state as explicit inputs and outputs) as ONNX or TorchScript.")
    with errors.setup_errors():
        if not cfg.checkpoint:
            raise ValueError("checkpoint=PATH is required (a last.pt written by primal_dt.train, or its run directory)")
        if cfg.format == "onnx" and missing_package():
            raise ValueError(f"format=onnx needs the {missing_package()} package: pip install 'primal-dt[export]'")
        out = export_policy(cfg.checkpoint, cfg.format, cfg.out or None, overwrite=cfg.overwrite)
    meta = read_metadata(out)
    print(f"exported {meta['checkpoint']} ({'/'.join(meta['layers'])}, obs {meta['obs_dim']} -> act "
          f"{meta['act_dim']}) as {cfg.format}: {out} ({out.stat().st_size / 1e6:.2f} MB, {len(meta['state'])} state "
          "tensors, any batch)")
    runner = "onnx_policy.OnnxPolicy" if cfg.format == "onnx" else "agents.export.TorchScriptPolicy"
    print(f"run it with {runner}({str(out)!r}): reset(batch), act(obs, reward), reset_done(done)")
    if not meta["stream_exact"]:
        print(f"note: {stream_note(str(out))}")
    return out


def main(argv: list[str] | None = None) -> Path:
    """``python -m agents.export``: bad input and failed writes end as every entry point's (errors.main)."""
    return errors.main(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
