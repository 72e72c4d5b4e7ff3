"""primal_dt.checkpoint against real files and real processes: a crafted pickle never runs, numpy objects
are refused, a write that hits a real file-size limit is one clear error that
leaves the previous file intact, and temporaries of killed writers are cleaned up."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from primal_dt import checkpoint
from primal_dt.errors import WriteError


def test_a_crafted_pickle_is_refused_and_never_runs(tmp_path, crafted_checkpoint):
    marker = tmp_path / "pwned"
    path = crafted_checkpoint(tmp_path / "evil.pt", marker)
    with pytest.raises(ValueError) as err:
        checkpoint.load(path)
    msg = str(err.value)
    assert f"checkpoint {path} was not loaded" in msg and "posix.system" in msg and "could run code" in msg
    assert not marker.exists()
    torch.load(path, weights_only=False)  # what the old reader did: the payload runs
    assert marker.exists()


def test_numpy_objects_are_refused(tmp_path):
    """The trainers store random states as tensors and plain data, so no numpy object is allowed in."""
    for other in (np.random.get_state(), np.zeros(3), np.str_("1.0"), np.array([1, "x"], dtype=object)):
        path = checkpoint.save_atomic({"kind": "dt", "config": {}, "model": {}, "rng": other}, tmp_path / "other.pt")
        with pytest.raises(ValueError, match="other than tensors and plain data .*numpy"):
            checkpoint.load(path)


def test_unreadable_and_corrupt_files_say_so(tmp_path, run_code):
    path = checkpoint.save_atomic({"kind": "dt", "config": {}, "model": {}}, tmp_path / "ok.pt")
    path.chmod(0)
    p = run_code(f"from primal_dt import checkpoint\ncheckpoint.load({str(path)!r})", honour_permissions=True)
    assert p.returncode != 0 and f"checkpoint {path} cannot be read: permission denied" in p.stderr, p.stderr[-2000:]
    (tmp_path / "torn.pt").write_bytes(b"PK\x03\x04 not a whole zip")
    with pytest.raises(ValueError, match="may be truncated"):
        checkpoint.load(tmp_path / "torn.pt")


def test_a_write_past_a_real_file_size_limit_is_one_clear_error_and_keeps_the_old_file(tmp_path, run_code):
    """2 MB into a process whose files may not grow past 512 KB (RLIMIT_FSIZE: the write fails with
    EFBIG, as on a full disk with ENOSPC)."""
    old = checkpoint.save_atomic({"model": torch.arange(10)}, tmp_path / "last.pt")
    before = old.read_bytes()
    p = run_code("import sys, torch\nfrom primal_dt import checkpoint, errors\n"
                 f"try:\n    checkpoint.save_atomic({{'model': torch.zeros(2**19)}}, {str(old)!r}, "
                 "what='checkpoint (step 7)')\n"
                 "except errors.WriteError as e:\n    sys.exit(f'error: {e}')\n", file_size=512 * 1024)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip() == (f"error: could not write the checkpoint (step 7) {old}: file too large (a file-size "
                                "limit such as `ulimit -f` was reached)")
    assert old.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["last.pt"]  # no temporary left
    with pytest.raises(WriteError, match=r"could not write the checkpoint .*nope.pt: a file is in the way"):
        checkpoint.save_atomic({}, old / "nope.pt")


def test_stale_temporaries_of_dead_writers_are_removed_live_ones_kept(tmp_path, killed_checkpoint_write):
    run = tmp_path / "run"
    run.mkdir()
    dead = killed_checkpoint_write(run / "last.pt").name
    assert dead.startswith(".last.pt.") and f"@{os.uname().nodename}-" in dead
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = run / f".best.pt.{live.pid}@{os.uname().nodename}-abcdefgh.tmp"
        elsewhere = run / ".last.pt.1@another-host-abcdefgh.tmp"  # a writer on another machine: cannot ask it
        old_release = run / ".last.pt.x7k2m9q1.tmp"  # release 0.1's names carry no writer
        unrelated = run / ".notes.txt.1-abc.tmp"
        for p in (alive, elsewhere, old_release, unrelated):
            p.write_bytes(b"x")
        assert checkpoint.remove_stale_temps(run) == [run / dead]
        assert checkpoint.remove_stale_temps(run, own=True) == [old_release]
        assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in (alive, elsewhere, unrelated))
    finally:
        live.kill()
        live.wait()
    assert checkpoint.remove_stale_temps(run) == [alive]  # its writer is gone now
