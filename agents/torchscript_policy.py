"""Run an exported TorchScript policy with the ``Agent`` API (``agents.onnx_policy.GraphPolicy``)."""

from __future__ import annotations

from pathlib import Path

import torch

from primal_dt.run import json_reader, options

from .onnx_policy import METADATA_KEY, GraphPolicy


class TorchScriptPolicy(GraphPolicy):
    """An exported TorchScript policy. ``threads``: torch's intra-op threads, set for the whole process
    (None: left as they are)."""

    runtime = "torchscript"

    def __init__(self, path, threads: int | None = None):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"policy {path} does not exist (export one with python -m agents.export "
                                    "checkpoint=RUN format=torchscript out=PATH)")
        key = METADATA_KEY + ".json"
        extra = {key: ""}
        try:
            self.module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
        except RuntimeError as err:
            raise ValueError(f"{path} is not a readable TorchScript file: {err}") from err
        if not extra[key]:
            raise ValueError(f"{path} is a TorchScript file without primal-dt policy metadata; export one with "
                             "python -m agents.export format=torchscript")
        super().__init__(json_reader.parse(extra[key], f"{path} policy metadata"), str(path))
        if threads is not None:
            options.check_number("threads", threads, options.AT_LEAST_1)
            torch.set_num_threads(int(threads))

    def _run(self, inputs):
        with torch.inference_mode():
            out = self.module(*(torch.from_numpy(a) for a in inputs))
        arrays = [o.numpy() for o in out]
        arrays[0] = arrays[0].copy()  # action and next_state.prev_action are one tensor in the graph
        return arrays
