"""``load_agent(..., runtime="onnx")`` (and "auto"): the torch agent's own step (``DTStep``) exported and
run on onnxruntime, faster on a CPU; before it is handed out it plays a few steps beside the torch agent.

The export is kept in the user's own cache (``cache_dir``), never read from the run directory: a
``policy.onnx`` there names its checkpoint only in its own metadata, which anyone who can write there can
copy into a graph that computes something else (and a few checked steps cannot tell a graph that deviates
later). An entry is named by the checkpoint file's SHA-256 and what made the graph (``cached_export``); the
graph's own SHA-256, recorded beside it, is checked before every reuse.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import numpy as np
import torch

from primal_dt.run import checkpoint as ck_io

from .dt_checkpoint import resolve
from .export import FORMATS, export_policy, missing_package, package_version, sha256_file
from .onnx_policy import SCHEMA, OnnxPolicy

EXACT = 1e-5
"""largest action difference the ONNX step may show against the torch stream step"""


def onnx_agent(checkpoint, ck, agent):
    """An ``OnnxPolicy`` on the export of ``checkpoint`` (a file or run directory, else ``ck``), checked
    against the torch ``agent``, with its target and ``info``."""
    if missing_package():
        raise ValueError(f"runtime='onnx' needs the {missing_package()} package: pip install 'primal-dt[export]' "
                         "(or use runtime='torch')")
    source = resolve(checkpoint) if isinstance(checkpoint, (str, Path)) else ck
    path = cached_export(source) if isinstance(source, Path) else None
    if path is not None:
        policy = OnnxPolicy(path)
    else:  # no cache (a checkpoint in memory, or no usable cache directory): a temporary file, gone once read
        tmp = Path(tempfile.mkdtemp(prefix="primal-dt-policy-"))
        try:
            policy = OnnxPolicy(export_policy(source, "onnx", tmp / FORMATS["onnx"], overwrite=True))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # onnxruntime holds the graph in memory
    policy = checked(policy, agent)
    policy.default_target, policy.info = agent.default_target, agent.info
    return policy


def cache_dir() -> Path | None:
    """``$XDG_CACHE_HOME/primal-dt/onnx`` (``~/.cache/primal-dt/onnx``), created readable by the user only;
    None when it cannot be made or is not a directory only the user can write (then nothing is cached)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    d = base / "primal-dt" / "onnx"
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(d)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        return None
    return d


def cached_export(path: Path) -> Path | None:
    """The ONNX export of the checkpoint file ``path``, from the cache when its graph still has the digest
    recorded beside it, else exported into the cache now; None without a usable cache directory."""
    d = cache_dir()
    if d is None:
        return None
    made_by = f"primal-dt{package_version()}-schema{SCHEMA}-torch{torch.__version__}"  # an upgrade exports again
    key = f"{sha256_file(path)}-{''.join(c if c.isalnum() or c in '.-' else '_' for c in made_by)}"
    graph, digest = d / f"{key}.onnx", d / f"{key}.onnx.sha256"
    try:
        if graph.is_file() and digest.read_text().strip() == sha256_file(graph):
            return graph
    except OSError:
        pass  # no digest (an export killed before it was written): export again
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=d))
        try:
            fresh = export_policy(path, "onnx", tmp / FORMATS["onnx"], overwrite=True)
            ck_io.write_atomic(digest, sha256_file(fresh) + "\n", "digest of a cached ONNX export")
            os.replace(fresh, graph)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        return None  # a full or read-only cache: export without keeping it
    return graph


def checked(policy, torch_agent, steps: int = 12, batch: int = 2, seed: int = 0):
    """``policy`` once ``steps`` steps of ``batch`` rows (a restart of row 0 halfway) beside ``torch_agent``
    agreed to ``EXACT``; a ValueError otherwise."""
    g = np.random.default_rng(seed)
    mean, std = np.asarray(torch_agent.mean.cpu()), np.asarray(torch_agent.std.cpu())
    worst, reward = 0.0, None
    target = float(np.ravel(torch_agent.default_target)[0])
    for p in (policy, torch_agent):
        p.reset(batch, target=target)
    for t in range(steps):
        obs = (mean + std * g.normal(size=(batch, mean.size))).astype(np.float32)
        a, b = policy.act(obs, reward), torch_agent.act(obs, reward)
        worst = max(worst, float(np.abs(a - b).max()))
        reward = g.uniform(0, 3, batch).astype(np.float32)
        if t == steps // 2:
            done = np.arange(batch) == 0
            policy.reset_done(done, target=target)
            torch_agent.reset_done(done, target=target)
    if not worst <= EXACT:
        raise ValueError(f"the exported ONNX step disagrees with the torch stream step (largest action difference "
                         f"{worst:.2e} > {EXACT:g}); use runtime='torch'")
    return policy
