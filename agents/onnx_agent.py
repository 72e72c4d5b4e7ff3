"""``load_agent(..., runtime="onnx")``: the checkpoint's stream step on onnxruntime, checked against torch.

The exported step is the same function as the torch stream engine's (``DTStep``), and on a CPU
onnxruntime runs it several times faster at batch 1, where a step costs per operator and torch's
per-operator dispatch dominates (eval/bench/inference.py measures both). So an agent that only needs
to act can run the export: it is written once beside the checkpoint (``policy.onnx``, the exporter's
default name, reused while its metadata's checkpoint hash matches the file), and before it is handed
out it plays a few steps beside the torch stream agent on the same inputs, a restart included; actions
that differ by more than ``EXACT`` (the exactness the tests hold the export to) are an error, not a
silently different policy.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

EXACT = 1e-5
"""largest action difference the ONNX step may show against the torch stream step"""


def onnx_agent(checkpoint, ck, agent):
    """``load_agent``'s runtime="onnx": an ``OnnxPolicy`` on the export of ``checkpoint`` (a file or run
    directory: ``cached_export``; a checkpoint in memory, ``ck``: exported for this policy only), checked
    against the torch ``agent`` of the same checkpoint, with its target and ``info``."""
    from .dt_checkpoint import resolve
    from .onnx_policy import OnnxPolicy

    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401  (torch.export's ONNX exporter)
    except ImportError as err:
        raise ValueError(f"runtime='onnx' needs the {err.name} package: pip install 'primal-dt[export]' (or use "
                         "runtime='torch')") from err
    if isinstance(checkpoint, (str, Path)):
        path = cached_export(resolve(checkpoint))
    else:
        path = _export(ck)
    policy = checked(OnnxPolicy(path), agent)
    policy.default_target, policy.info = agent.default_target, agent.info
    return policy


def _export(source) -> Path:
    """``source`` exported to a fresh temporary directory."""
    from .export import FORMATS, export_policy

    return export_policy(source, "onnx", Path(tempfile.mkdtemp(prefix="primal-dt-policy-")) / FORMATS["onnx"])


def cached_export(path: Path) -> Path:
    """The ONNX export of the checkpoint file ``path``: ``policy.onnx`` beside it when that file was
    exported from this very file (its metadata's SHA-256), else a fresh export there (or, when a file of
    that name belongs to another checkpoint or the directory is not writable, in a temporary directory)."""
    from .export import FORMATS, export_policy, read_metadata, sha256_file

    cached = path.parent / FORMATS["onnx"]
    if cached.is_file():
        try:
            if read_metadata(cached).get("checkpoint_sha256") == sha256_file(path):
                return cached
        except (ValueError, OSError):
            pass  # not a policy this package reads: left as it is
    else:
        try:
            return export_policy(path, "onnx", cached)
        except OSError:
            pass
    return _export(path)


def checked(policy, torch_agent, steps: int = 12, batch: int = 2, seed: int = 0):
    """``policy`` after ``steps`` steps of ``batch`` rows beside ``torch_agent`` (observations drawn around
    the data's mean, a restart of row 0 halfway) agreed to ``EXACT``; a ValueError otherwise."""
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
