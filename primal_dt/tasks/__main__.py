"""Data tools: ``python -m primal_dt.tasks listops out=DIR n_train=2000 max_length=500`` writes ListOps
files in the LRA release format (see listops.py). A package entry point, so that running the tool does
not re-import the module the package has already loaded."""

import sys

from .listops import main as listops_main

TOOLS = {"listops": listops_main}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in TOOLS:
        sys.exit(f"usage: python -m primal_dt.tasks {{{','.join(TOOLS)}}} [key=value ...]")
    TOOLS[sys.argv[1]](sys.argv[2:])
