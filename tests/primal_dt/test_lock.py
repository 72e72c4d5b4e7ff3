"""primal_dt/run/lock.py: one process per directory, with real processes: the second is refused naming the
holder, a SIGKILL of the holder frees the directory, a child handed the lock keeps it held."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from primal_dt.run import lock
from primal_dt.run.errors import SetupError

ROOT = Path(__file__).resolve().parents[2]
HOLD = """
import subprocess, sys, time
from primal_dt.run import lock
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
        with pytest.raises(SetupError, match=rf"the run directory {d} is in use by process {p.pid} \(or a process it started\); wait for it"):
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
    with pytest.raises(SetupError, match=rf"in use by process {p.pid} \(or a process it started\)"):
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


@pytest.mark.parametrize("plant", ["symlink", "dangling symlink", "hard link", "directory"])
def test_a_planted_lock_file_is_refused_and_what_it_points_to_is_untouched(tmp_path, plant):
    """A ``.lock`` that is a link to a file of the user's (planted in a run copied from elsewhere) would have
    that file truncated and overwritten with a pid: it is refused, naming the path and what to do."""
    d, victim = tmp_path / "run", tmp_path / "victim.txt"
    d.mkdir()
    victim.write_text("precious\n")
    planted = d / lock.FILENAME
    if plant == "symlink":
        planted.symlink_to(victim)
    elif plant == "dangling symlink":
        planted.symlink_to(tmp_path / "not-yet")
    elif plant == "hard link":
        os.link(victim, planted)
    else:
        planted.mkdir()
    with pytest.raises(SetupError, match=rf"the lock file of the run directory, {planted}, is .*: remove {planted}"):
        lock.hold(d)
    assert victim.read_text() == "precious\n" and not (tmp_path / "not-yet").exists()
    assert lock.holder(d) is None  # asking who holds it follows no link either
    planted.rmdir() if plant == "directory" else planted.unlink()
    lock.hold(d)  # removed as told: the directory is held again
    lock.release(d)


def test_holder_names_a_live_holder_and_none_once_it_is_gone(tmp_path):
    d = tmp_path / "run"
    assert lock.holder(d) is None and not d.exists()  # asking creates nothing
    p = holder(d)
    assert lock.holder(d) == f"process {p.pid}"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert lock.holder(d) is None


@pytest.mark.parametrize("command", ["primal_dt.train", "primal_dt.classify"])
def test_a_resume_takes_the_lock_before_it_reads_the_checkpoint(tmp_path, command):
    """A checkpoint read before the lock could be replaced by its holder's last save, and the resumed run would
    continue from the older one over it: the refusal comes first, whatever the file holds."""
    import importlib

    d = tmp_path / "run"
    d.mkdir()
    (d / "last.pt").write_bytes(b"being replaced")  # read, it would be refused as damaged
    p = holder(d)
    try:
        with pytest.raises(SetupError, match=rf"the run directory {d} is in use by process {p.pid}"):
            importlib.import_module(command).run([f"resume={d}", "progress=false"])
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    with pytest.raises(SetupError, match="could not be read|not loaded|not a primal-dt checkpoint|not a PyTorch checkpoint"):
        importlib.import_module(command).run([f"resume={d}", "progress=false"])  # free: read, and refused
    assert not (d / lock.FILENAME).exists() or lock.holder(d) is None  # the refusal let the lock go


def test_release_removes_the_lock_file_and_the_next_holder_makes_a_new_one(tmp_path):
    """A finished run leaves no ``.lock``; a process that opened the file before its holder removed it finds it
    removed (``hold`` then takes the new one, never the removed file, so two holders never hold one directory)."""
    d = tmp_path / "run"
    lock.hold(d)
    early = os.open(d / lock.FILENAME, os.O_RDONLY)  # opened before the release: the old file
    lock.release(d)
    assert not (d / lock.FILENAME).exists()
    p = holder(d)  # another process holds the directory through a new file
    try:
        assert (d / lock.FILENAME).read_text().strip() == str(p.pid)
        assert os.fstat(early).st_nlink == 0  # the old one is gone: locking it would hold nothing
        with pytest.raises(SetupError, match=f"in use by process {p.pid}"):
            lock.hold(d)
    finally:
        os.close(early)
        p.send_signal(signal.SIGKILL)
        p.wait()
    (d / lock.FILENAME).write_text("12345\n")  # left by a killed holder (or an older release): free, taken, removed
    lock.hold(d)
    lock.release(d)
    assert not (d / lock.FILENAME).exists()
