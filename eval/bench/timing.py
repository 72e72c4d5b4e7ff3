"""What every benchmark shares: its checked command line, interleaved median timing, the machine it ran on,
and its output files, written by the benchmark itself (``--json``, ``--markdown``: under ``docs/results/``
for the project's) headed by the machine and the command, so a measured table is never typed by hand.
"""

from __future__ import annotations

import datetime
import json
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass

from primal_dt.run import checkpoint, cli, options, runtime


@dataclass
class Outputs:
    """The output files of every benchmark's command line (``write``)."""

    json: str = ""
    """also write the results here"""
    markdown: str = ""
    """also write the tables here as Markdown, headed by the machine and the command (the project's: docs/results/)"""


def median_ms(fns: dict, calls: int, rounds: int, round_s: float = 0.2) -> dict:
    """Interleaved rounds, so load drifting on a shared CPU hits every function alike: each round runs each
    function ``n`` times (at most ``calls``, fewer for slow ones so a call group lasts about ``round_s``);
    {name: median ms per call over the rounds}."""
    n, out = {}, {k: [] for k in fns}
    for k, f in fns.items():
        f()  # warm-up
        t0 = time.perf_counter()
        f()
        n[k] = max(1, min(calls, int(round_s / max(time.perf_counter() - t0, 1e-6))))
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(n[k]):
                f()
            out[k].append((time.perf_counter() - t0) / n[k] * 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


def machine(prog: str, argv) -> dict:
    """The machine, the software and the command of a measurement (the header of its tables)."""
    import torch

    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    # the vector instructions torch uses here: CPUs sold under one name differ (AVX2 only, AVX-512, AMX)
    isa = torch.backends.cpu.get_cpu_capability() + (", native bf16" if runtime.native_bf16("cpu") else "")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": f"{cpu} ({isa})", "cores": runtime.usable_cores(), "torch_threads": torch.get_num_threads(), "gpu": gpu,
            "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([prog, *map(shlex.quote, argv)])}


def parse(cls, argv, prog: str, doc: str, numbers: dict, prefix: str = "--", check=None) -> tuple:
    """(options, the words given) of a bench's command line, checked before anything is measured: every option
    in ``numbers`` ({name: Range}), the output files (``json``, ``markdown``) and ``check(options)``; a mistake
    is one ``error:`` line naming the option as the bench spells it (``prefix``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = cli.parse(cls, argv, prog=prog, description=doc.split("\n\n")[0])
    try:
        options.check_numbers(args, numbers, prefix)
        for name in ("json", "markdown"):
            if getattr(args, name):
                options.check_output_file(getattr(args, name), prefix + name)
        if check is not None:
            check(args)
    except ValueError as err:
        cli.fail(str(err))
    return args, argv


def cell(text) -> str:
    """One Markdown table cell: ``|`` escaped and control characters made spaces, so a name read from a file
    can never break a table's rows."""
    return "".join(" " if ord(c) < 32 or ord(c) == 127 else c for c in str(text)).replace("|", "\\|")


def table(columns: list[str], rows: list[list]) -> list[str]:
    """A Markdown table of ``cell``s."""
    line = lambda cells: "| " + " | ".join(map(cell, cells)) + " |"  # noqa: E731
    return [line(columns), "|" + "---|" * len(columns), *map(line, rows)]


def write(result: dict, json_path: str | None, markdown: str | None, title: str, tables: list[list[str]],
          notes: list[str] = ()) -> None:
    """The result as JSON and its tables (from ``table``) and notes as a Markdown page headed by
    ``result["machine"]``; the page's body is printed last, after ``== title``, so the console ends with it."""
    body = [line for t in tables for line in ["", *t]] + (["", *notes] if notes else [])
    if json_path:
        checkpoint.write_atomic(json_path, json.dumps(result, indent=2, default=str), "benchmark's results")
        print(f"wrote {json_path}", flush=True)
    if markdown:
        m = result["machine"]
        head = [f"# {title}", "", f"Command: `{m['command']}`", "",
                f"Machine: {m['cpu']}, {m['cores']} core(s), {m['torch_threads']} torch thread(s)"
                + (f", GPU {m['gpu']}" if m["gpu"] else "") + f"; torch {m['torch']}; {m['date']}."]
        checkpoint.write_atomic(markdown, "\n".join(head + body) + "\n", "benchmark's table")
        print(f"wrote {markdown}", flush=True)
    print("\n".join([f"== {title}", *body]), flush=True)
