"""Train several layouts on one classification task in one process and compare time per 1K steps.

    python -m eval.bench.classify task=lra/listops-fast models=transformer,primalformer train.steps=400

Each model gets its own Trainer (same data, seed and batches), in alternating blocks of ``train.eval_every``
steps so load on a shared machine hits them alike; only optimisation steps are timed. Writes
``out``/bench-<task>.json: each model's test accuracy selected on validation, seconds per 1K steps, ratio.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from primal_dt.run import cli, errors, runtime
from primal_dt.classifier_training import Trainer
from primal_dt.classify_config import build_config, check_config
from primal_dt.tasks import load_task

from . import timing


@dataclass
class ClassifyBenchConfig:
    models: tuple[str, ...] = ("transformer", "primalformer")
    """layouts (or attention mechanisms) to train and compare, the first one the reference"""


PROG = "python -m eval.bench.classify"
DESCRIPTION = (__doc__.split("\n\n")[0] + " Every other option is every model's training's: primal_dt.classify's "
               "(python -m primal_dt.classify --help).")


def main(argv: list[str] | None = None) -> dict:
    given = sys.argv[1:] if argv is None else list(argv)
    bench, argv = cli.parse(ClassifyBenchConfig, given, prog=PROG, description=DESCRIPTION, known=True)
    models = list(bench.models)
    with errors.setup_errors(RuntimeError):  # bad input: SetupError, printed as one line by errors.main
        if not models:
            raise ValueError("models= names no model; e.g. models=transformer,primalformer")
        cfgs = [build_config(argv + [f"model={m}"], PROG)[0] for m in models]
        for c in cfgs:
            check_config(c)
        device = runtime.pick_device(cfgs[0].device)
        runtime.set_threads(cfgs[0].threads)
        data = load_task(cfgs[0].data, with_val=True)
        if data.val is None:
            raise ValueError("the benchmark selects on validation; this task has no validation split")
        trainers = [Trainer(c, data, device) for c in cfgs]
    total, block = trainers[0].total_steps, trainers[0].eval_every
    print(f"{data.describe()}\nmodels {models}; {total} steps each in blocks of {block}, device {device}, torch "
          f"threads {torch.get_num_threads()}", flush=True)
    best = {m: (-1.0, 0.0, 0) for m in models}  # (val acc, test acc, step)
    for done in range(0, total, block):
        n = min(block, total - done)
        for m, tr in zip(models, trainers):
            for _ in range(n):
                tr.step(tr.next_batch())
            val, test = tr.evaluate(data.val)["acc"], tr.evaluate(data.test)["acc"]
            if val > best[m][0]:
                best[m] = (val, test, tr.step_no)
            print(f"  step {tr.step_no:5d} {m:>14}: val {val:.3f} test {test:.3f} "
                  f"({1000 * tr.train_time / tr.step_no:.1f} s/1K steps so far)", flush=True)
    base = 1000 * trainers[0].train_time / total
    rows = []
    for m, tr in zip(models, trainers):
        s = 1000 * tr.train_time / total
        rows.append({"model": m, "layers": [sp.attention for sp in tr.model.stack.specs], "steps": total,
                     "s_per_1k_steps": round(s, 1), "ratio_to_first": round(s / base, 3),
                     "selected_val_acc": best[m][0], "test_acc": best[m][1], "selected_step": best[m][2]})
    result = {"machine": timing.machine(PROG, given), "task": cfgs[0].task, "data": data.describe(),
              "seed": cfgs[0].seed, "timing": "optimisation steps only, interleaved blocks", "results": rows}
    timing.write(result, str(Path(cfgs[0].out) / f"bench-{cfgs[0].task.replace('/', '-')}.json"), None,
                 f"{data.describe()}: seconds per 1K optimisation steps, test accuracy selected on validation",
                 [timing.table(["model", "s per 1K steps", "x first", "test acc", "val acc", "at step"],
                               [[r["model"], r["s_per_1k_steps"], r["ratio_to_first"], f"{r['test_acc']:.3f}",
                                 f"{r['selected_val_acc']:.3f}", r["selected_step"]] for r in rows])])
    return result


if __name__ == "__main__":
    errors.main(main)
