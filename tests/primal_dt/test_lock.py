"""primal_dt/lock.py: one process per directory, with real processes: the second is refused naming the
holder, a SIGKILL of the holder frees the directory, a child handed the lock keeps it held."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primal_dt import lock
from primal_dt.errors import SetupError

ROOT = Path(__file__).resolve().parents[2]
HOLD = """
import subprocess, sys, time
from primal_dt import lock
fd = lock.hold(sys.argv[1])
child = None
if len(sys.argv) > 2:  # hand the lock to a child that outlives this process
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(fd,)).pid
print("held", child, flush=True)
time.sleep(600)
"""


def holder(d: Path, *extra: str) -> subprocess.Popen:
    """A process holding ``d`` (with ``extra``: and a child it handed the lock to, ``p.child``)."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(d), *extra], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    said, child = p.stdout.readline().split()
    assert said == "held"
    p.child = None if child == "None" else int(child)
    return p


def test_a_held_directory_is_refused_naming_the_holder_until_it_is_killed(tmp_path):
    d = tmp_path / "run"
    p = holder(d)
    try:
        with pytest.raises(SetupError, match=rf"the run directory {d} is in use by process {p.pid}; wait for it"):
            lock.hold(d)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    lock.hold(d)  # the kernel dropped the dead holder's lock
    assert (d / lock.FILENAME).read_text().strip() == str(os.getpid())
    assert lock.hold(d) == lock.hold(d)  # holding again is a no-op
    lock.release(d)
    p = holder(d)  # released: another process takes it
    p.send_signal(signal.SIGKILL)
    p.wait()


def test_a_child_handed_the_lock_keeps_it_held_after_its_parent_dies(tmp_path):
    d = tmp_path / "sweep"
    p = holder(d, "with-child")
    p.send_signal(signal.SIGKILL)
    p.wait()
    with pytest.raises(SetupError, match=rf"in use by processes started by process {p.pid} \(which has exited"):
        lock.hold(d, "sweep's output")
    os.kill(p.child, signal.SIGKILL)  # the last process holding it
    deadline, held = time.time() + 10, False
    while not held and time.time() < deadline:
        try:
            lock.hold(d)
            held = True
        except SetupError:
            time.sleep(0.05)
    assert held
    lock.release(d)
