"""Train a sequence classifier and select its checkpoint: what ``python -m primal_dt.classify`` runs.
``Trainer`` keeps ``step`` (timed: ``train_time``, optimisation only, for the throughput it logs) and ``evaluate``
apart; ``fit`` is the loop, evaluation rounds keeping best.pt (``classify_config.SELECTIONS``) and last.pt.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
import yaml

from .classifier import SequenceClassifier, classification_loss
from .classify_config import SELECTIONS, ClassifyConfig, attention_options
from .layouts import layout
from .run import checkpoint, errors, runtime
from .run.interrupts import Interrupts
from .run.monitor import RunMonitor
from .tasks import Split, TaskData

KIND = "classifier"


class Diverged(RuntimeError):
    """The loss or gradient became NaN/inf: the run stops rather than report a model with NaN weights."""


def build_model(cfg: ClassifyConfig, data: TaskData) -> SequenceClassifier:
    a = cfg.arch
    head = a.head if a.head != "auto" else "pair" if data.pair else "flatten" if cfg.data.kind == "uea" else "mean"
    if (head == "pair") != data.pair:
        raise ValueError(f"arch.head={head!r} does not fit {data.name} ({'pairs' if data.pair else 'single sequences'})")
    return SequenceClassifier(
        layout(cfg.model, a.layers, attention_options(cfg)), input_kind=data.input_kind, n_inputs=data.n_inputs,
        n_classes=data.n_classes, max_len=data.max_len, head=head, d_model=a.d_model, n_heads=a.n_heads,
        d_ff=a.d_ff, dropout=a.dropout, norm=a.norm, activation=a.activation)


def batches(split: Split, size: int, generator: torch.Generator | None = None):
    """(x, mask, y) mini-batches; shuffled when a generator is given."""
    order = torch.randperm(len(split), generator=generator) if generator is not None else torch.arange(len(split))
    for idx in order.split(size):
        yield split.x[idx], split.mask[idx], split.y[idx]


class Trainer:

    def __init__(self, cfg: ClassifyConfig, data: TaskData, device: torch.device | str = "cpu"):
        self.cfg, self.data, self.device = cfg, data, torch.device(device)
        runtime.seed_torch(cfg.seed)
        self.model = build_model(cfg, data).to(self.device)
        t = cfg.train
        self.steps_per_epoch = math.ceil(len(data.train) / t.batch_size)
        self.total_steps = t.steps or t.epochs * self.steps_per_epoch
        self.eval_every = t.eval_every or self.steps_per_epoch
        optimizer = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "radam": torch.optim.RAdam}[t.optimizer]
        self.opt = optimizer(self.model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
        if t.schedule == "constant":
            self.sched = torch.optim.lr_scheduler.LambdaLR(
                self.opt, lambda s: min(1.0, (s + 1) / t.warmup) if t.warmup else 1.0)
        else:
            self.sched = torch.optim.lr_scheduler.OneCycleLR(
                self.opt, max_lr=t.lr, total_steps=self.total_steps + 1, anneal_strategy="linear",
                pct_start=min(0.999, max(t.warmup, 1) / self.total_steps), cycle_momentum=False, div_factor=1e4,
                final_div_factor=1e4)
        self.gen = torch.Generator().manual_seed(cfg.seed)  # batch order: its own stream, on the CPU
        self.step_no = self.saved_step = 0  # saved_step: last.pt's
        self.train_time = 0.0  # seconds inside optimisation steps (no evaluation, no logging)
        self.best = {"metric": -1.0, "step": 0, "test_acc": None, "val_acc": None, "val_loss": None}
        self._it = iter(())

    def next_batch(self):
        try:
            return next(self._it)
        except StopIteration:
            self._it = batches(self.data.train, self.cfg.train.batch_size, self.gen)
            return next(self._it)

    def step(self, batch) -> dict:
        t0 = time.perf_counter()
        x, m, y = (t.to(self.device) for t in batch)
        out, t = self.model(x, m), self.cfg.train
        loss, parts = classification_loss(out, y, self.cfg.primal.eta)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf"))
        if not (torch.isfinite(loss) and torch.isfinite(gn)):  # a NaN weight never reaches a checkpoint or a score
            raise Diverged(f"training diverged at step {self.step_no + 1}: loss={loss.item()}, grad norm={gn.item()}; "
                           f"the optimizer step was not taken and last.pt keeps the last evaluation round's weights "
                           f"(if one was written). Try a lower train.lr (now {t.lr:g}) or train.grad_clip > 0 (now "
                           f"{t.grad_clip:g})")
        self.opt.step()
        self.sched.step()
        if self.device.type == "cuda":  # the step is timed: wait for the GPU to finish it
            torch.cuda.synchronize(self.device)
        self.train_time += time.perf_counter() - t0
        self.step_no += 1
        return parts | {"loss": loss.detach(), "correct": (out.logits.argmax(-1) == y).sum(), "n": len(y),
                        "tokens": m.sum()}

    @torch.no_grad()
    def evaluate(self, split: Split) -> dict[str, float]:
        self.model.eval()
        correct, loss, n = 0, 0.0, 0
        for batch in batches(split, self.cfg.train.eval_batch_size or self.cfg.train.batch_size):
            x, m, y = (t.to(self.device) for t in batch)
            out = self.model(x, m)
            correct += int((out.logits.argmax(-1) == y).sum())
            loss += float(classification_loss(out, y, self.cfg.primal.eta)[0]) * len(y)
            n += len(y)
        self.model.train()
        return {"acc": correct / max(n, 1), "loss": loss / max(n, 1)}

    def state(self) -> dict:
        cuda = {"cuda_rng": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {}
        return cuda | {"kind": KIND, "config": dataclasses.asdict(self.cfg), "model": self.model.state_dict(),
                "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "step": self.step_no,
                "train_time": self.train_time, "best": dict(self.best), "rng": self.gen.get_state(),
                "torch_rng": torch.get_rng_state(),
                "task": {"name": self.data.name, "n_classes": self.data.n_classes, "max_len": self.data.max_len,
                         "class_names": [str(c) for c in self.data.class_names]}}  # plain str, not numpy's

    def restore(self, ck: dict) -> None:
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["optimizer"])
        self.sched.load_state_dict(ck["scheduler"])
        self.step_no, self.best, self.train_time = ck["step"], ck["best"], ck["train_time"]
        self.saved_step = self.step_no
        self.gen.set_state(ck["rng"])
        torch.set_rng_state(ck["torch_rng"])
        if "cuda_rng" in ck and self.device.type == "cuda":
            torch.cuda.set_rng_state(ck["cuda_rng"], self.device)


def evaluation_round(tr: Trainer, data: TaskData, out: Path, whole=contextlib.nullcontext) -> dict:
    """Evaluate on test (and val), keep the selected checkpoint in best.pt, the latest in last.pt (``whole``: both
    written, or neither, under an interrupt)."""
    res = {"test": tr.evaluate(data.test)}
    if data.val is not None:
        res["val"] = tr.evaluate(data.val)
    selection = tr.cfg.train.selection
    metric = (res["val"] if selection == "val" else res["test"])["acc"]
    # small validation splits saturate or stall: accuracy ties go to the lower validation loss (val protocol only)
    tie_better = selection == "val" and metric == tr.best["metric"] and res["val"]["loss"] < tr.best["val_loss"]
    if metric > tr.best["metric"] or tie_better or selection == "last":
        val = res.get("val", {})
        tr.best = {"metric": metric, "step": tr.step_no, "test_acc": res["test"]["acc"], "val_acc": val.get("acc"),
                   "val_loss": val.get("loss")}
    with whole():
        if tr.best["step"] == tr.step_no:
            checkpoint.save_atomic(tr.state(), out / "best.pt", what=f"best checkpoint (step {tr.step_no})")
        checkpoint.save_atomic(tr.state(), out / "last.pt", what=f"checkpoint (step {tr.step_no})")
        tr.saved_step = tr.step_no
    return res


def fit(tr: Trainer, data: TaskData, out: Path, source: str, resumed: bool = False) -> dict:
    """Train ``tr`` to its total steps with evaluation rounds, then report the selected checkpoint: hyper-parameters,
    accuracy.png and summary.json."""
    cfg, t = tr.cfg, tr.cfg.train
    n_params = sum(p.numel() for p in tr.model.parameters())
    mon = RunMonitor(out, enabled=cfg.tensorboard, progress_total=tr.total_steps, progress=cfg.progress,
                     progress_desc=f"{cfg.task} {cfg.model}", initial=tr.step_no,
                     purge_step=tr.step_no + 1 if resumed else None,  # drop what a killed run logged after last.pt
                     lines=True)
    mon.print(f"task {cfg.task}: {data.describe()}\n  preset source: {source}\n  " + "\n  ".join(data.notes))
    mon.print(f"model {cfg.model}: {[s.attention for s in tr.model.stack.specs]}, {n_params:,} parameters; "
              f"{tr.total_steps} steps ({tr.steps_per_epoch}/epoch), selection: {SELECTIONS[t.selection]}\n"
              f"  device {tr.device}; run directory: {out}")
    mon.text("config", "```\n" + yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False) + "\n```")
    acc_sum = {"correct": 0, "n": 0, "tokens": 0}
    timed_before, t_start, last_eval, shown = tr.train_time, time.perf_counter(), tr.step_no, {}
    interrupts = Interrupts()
    try:
        with interrupts.installed():
            while tr.step_no < tr.total_steps:
                parts = tr.step(tr.next_batch())
                mon.progress(1, **shown)
                for k in acc_sum:
                    acc_sum[k] += int(parts[k])
                s = tr.step_no
                if s % 10 == 0 or s == tr.total_steps:
                    shown["loss"] = f"{float(parts['loss']):.3f}"
                    mon.scalars({"loss/total": float(parts["loss"]), "loss/ce": float(parts["ce"]),
                                 "loss/ksvd": float(parts["ksvd"]), "lr": tr.sched.get_last_lr()[0]}
                                | {f"ksvd/{k}": float(v) for k, v in parts.items() if k.startswith("J/")}, s)
                if s % tr.eval_every == 0 or s == tr.total_steps:
                    steps, t_train = s - last_eval, tr.train_time - timed_before
                    mon.scalars({"acc/train": acc_sum["correct"] / max(acc_sum["n"], 1),
                                 "throughput/samples_per_s": acc_sum["n"] / max(t_train, 1e-9),
                                 "throughput/tokens_per_s": acc_sum["tokens"] / max(t_train, 1e-9),
                                 "throughput/s_per_1k_steps": 1000 * t_train / max(steps, 1)}, s)
                    res = evaluation_round(tr, data, out, interrupts.held)
                    for name, r in res.items():
                        mon.scalars({f"acc/{name}": r["acc"], f"loss/{name}": r["loss"]}, s)
                    mon.flush()  # the curves reach the checkpoint just written, so a resume continues them
                    shown.update({"val" if "val" in res else "test": f"{res.get('val', res['test'])['acc']:.3f}",
                                  "best": f"{tr.best['metric']:.3f}"})
                    acc_sum = {k: 0 for k in acc_sum}
                    timed_before, last_eval = tr.train_time, s
    except KeyboardInterrupt as err:  # no checkpoint here: resuming is exact from an evaluation round's only
        why = f" by {err.args[0]}" if err.args else ""
        if (out / "last.pt").exists():
            mon.print(f"interrupted{why} at step {tr.step_no}; last.pt holds step {tr.saved_step}, the last evaluation "
                      f"round; resume with: python -m primal_dt.classify resume={out}")
        else:
            mon.print(f"interrupted{why} at step {tr.step_no}, before the first evaluation round (step "
                      f"{tr.eval_every}) wrote a checkpoint: nothing to resume")
        mon.close()
        raise
    except errors.WriteError:
        with contextlib.suppress(errors.WriteError):  # the disk may refuse the rest of the log too
            mon.close()
        raise
    # the selected checkpoint's test accuracy (the val protocol's re-evaluated from best.pt: the saved weights')
    tr.model.load_state_dict(checkpoint.load(out / "best.pt", expect_kind=KIND)["model"])
    test_sel = tr.evaluate(data.test)["acc"] if t.selection == "val" else tr.best["test_acc"]
    summary = {
        "task": cfg.task, "model": cfg.model, "seed": cfg.seed, "layers": [s.attention for s in tr.model.stack.specs],
        "protocol": t.selection, "protocol_meaning": SELECTIONS[t.selection],
        "test_acc": test_sel, "selected_step": tr.best["step"], "selected_val_acc": tr.best["val_acc"],
        "steps": tr.total_steps, "epochs": t.epochs or round(tr.total_steps / tr.steps_per_epoch, 2),
        "train_s": round(tr.train_time, 2), "wall_s": round(time.perf_counter() - t_start, 2),
        "s_per_1k_steps": round(1000 * tr.train_time / max(tr.total_steps, 1), 2),
        "parameters": n_params, "data": data.describe(), "preset_source": source, "run_dir": str(out),
    }
    d, val = dataclasses.asdict(cfg), tr.best["val_acc"]  # the options that define a result: TensorBoard's HPARAMS
    mon.hparams({"task": cfg.task, "model": cfg.model, "seed": cfg.seed, "arch": d["arch"], "primal": d["primal"],
                 "train": d["train"], "data": {k: v for k, v in d["data"].items() if k != "listops"}},
                {"test_acc": test_sel} | ({} if val is None else {"selected_val_acc": val}))
    mon.plot(["acc/train", "acc/val", "acc/test"], out / "accuracy.png", title=f"{cfg.task} {cfg.model}",
             ylabel="accuracy")
    mon.close()
    checkpoint.write_atomic(out / "summary.json", json.dumps(summary, indent=2), "run summary")
    print(json.dumps(summary, indent=2), flush=True)
    return summary
