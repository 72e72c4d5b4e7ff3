"""Data tools: ``python -m primal_dt.tasks listops out=DIR n_train=2000 max_length=500`` writes ListOps files
in the LRA release format. A package entry point, so the tool does not re-import a module the package loaded."""

import sys

from ..run.cli import fail
from .listops import main as listops_main

TOOLS = {"listops": (listops_main, "write ListOps TSV files in the LRA release format")}
USAGE = f"usage: python -m primal_dt.tasks {{{','.join(TOOLS)}}} [-h] [KEY=VALUE ...]"


def main(argv: list[str]) -> None:
    if argv and argv[0] in TOOLS:
        TOOLS[argv[0]][0](argv[1:])
    elif argv and argv[0] in ("-h", "--help"):
        tools = "\n".join(f"  {name:<12}{what}" for name, (_, what) in TOOLS.items())
        print(f"{USAGE}\n\n{__doc__.split(chr(10) * 2)[0]}\n\ntools (python -m primal_dt.tasks TOOL --help: its "
              f"options):\n{tools}")
    else:
        fail(f"name a tool: {', '.join(TOOLS)}" + (f" (got {argv[0]!r})" if argv else "")
             + "; python -m primal_dt.tasks --help lists them")


if __name__ == "__main__":
    main(sys.argv[1:])
