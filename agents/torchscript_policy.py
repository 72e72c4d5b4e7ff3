"""Run an exported TorchScript policy with the ``Agent`` API (``agents.onnx_policy.GraphPolicy``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from primal_dt.run import json_reader, options

from .onnx_policy import METADATA_KEY, GraphPolicy


class TorchScriptPolicy(GraphPolicy):
    """``threads``: torch's intra-op threads, set for the whole process (None: left as they are)."""

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

    def _step(self, obs, reward):
        r = np.zeros(self.batch, dtype=np.float32) if reward is None else reward
        inputs = [np.ascontiguousarray(obs, dtype=np.float32), r, self._reset, self._target_rows, *self._state]
        with torch.inference_mode():
            action, *state = self.module(*(torch.from_numpy(a) for a in inputs))
        self._state = [s.numpy() for s in state]
        self._reset.fill(False)
        return action.numpy().copy()  # action and next_state.prev_action are one tensor in the graph
