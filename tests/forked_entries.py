"""A process that imports what the entry points import once, then runs each command it is sent in a child forked
from it, as ``python -m MODULE ARGS`` runs one (``runpy`` as ``__main__``, its own process, working directory,
environment, stdout and stderr): the exit status and the output are the command's own. Why: importing torch and
the simulators takes seconds, and the hostile-input corpus runs dozens of commands within the default test run.

Protocol (one JSON object a line): ``{"module", "args", "cwd", "env", "stdout", "stderr", "timeout"}`` starts a
command and answers ``{"pid"}``; ``{"wait": pid}`` answers ``{"rc", "seconds", "cpu_seconds"}`` when it has ended
(the processor time its own, whatever else loads the machine; a command still running at its ``timeout`` is ended
by SIGALRM: status -14). Started by tests/test_hostile_inputs.py."""

import json
import os
import runpy
import signal
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# what the entry points import, but none of the entry modules themselves (runpy would warn that a module it runs
# as __main__ was imported before)
import gymnasium  # noqa: E402,F401
import h5py  # noqa: E402,F401
import numpy  # noqa: E402,F401
import torch  # noqa: E402,F401
import tyro  # noqa: E402,F401

import agents  # noqa: E402,F401
import agents.training  # noqa: E402,F401
import envs  # noqa: E402,F401
import primal_dt.run.cli  # noqa: E402,F401

try:
    import minari  # noqa: F401 - an extra (Minari datasets); imported here when installed
except ImportError:
    pass


def _child(req: dict) -> int:
    """Run the command in this (forked) process; its exit status, as the interpreter would set it."""
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests are the server's, not the command's
    for fd, name in ((1, req["stdout"]), (2, req["stderr"])):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    signal.alarm(int(req["timeout"]))  # a command that hangs ends here, not the test run
    # Ctrl-C as a terminal gives it: a test run started in the background of a non-interactive shell (a CI script)
    # inherits SIGINT ignored (or blocked, by whatever thread spawned it), and so would every command here, which
    # would then never see an interrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    sys.argv = [req["module"], *req["args"]]
    warnings.simplefilter("ignore", RuntimeWarning)  # runpy's note on modules a package imported before
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code or 0


def serve() -> None:
    started: dict[int, float] = {}
    for line in sys.stdin:
        req = json.loads(line)
        if "wait" in req:
            pid = req["wait"]
            _, status, usage = os.wait4(pid, 0)
            answer = {"rc": os.waitstatus_to_exitcode(status), "seconds": time.monotonic() - started.pop(pid),
                      "cpu_seconds": usage.ru_utime + usage.ru_stime}
        else:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = _child(req)
                finally:
                    os._exit(code)
            started[pid] = time.monotonic()
            answer = {"pid": pid}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    serve()
