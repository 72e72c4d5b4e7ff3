"""primal_dt.run.checkpoint against real files and real processes: a crafted pickle never runs, numpy objects
are refused, a write that hits a real file-size limit is one clear error that
leaves the previous file intact, and temporaries of killed writers are cleaned up."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from primal_dt.run import checkpoint
from primal_dt.run.errors import WriteError

ROOT = Path(__file__).resolve().parents[2]


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
    p = run_code(f"from primal_dt.run import checkpoint\ncheckpoint.load({str(path)!r})", honour_permissions=True)
    assert p.returncode != 0 and f"checkpoint {path} cannot be read: permission denied" in p.stderr, p.stderr[-2000:]
    (tmp_path / "torn.pt").write_bytes(b"PK\x03\x04 not a whole zip")
    with pytest.raises(ValueError, match="may be truncated"):
        checkpoint.load(tmp_path / "torn.pt")


def test_a_file_of_another_kind_is_named_for_what_it_is_not_called_a_foreign_pickle(tmp_path):
    """A dataset or a report given where a checkpoint goes was refused as "pickled objects ... which could run
    code": true of no byte in it, and no help. The file's first bytes say what it is."""
    import h5py

    with h5py.File(tmp_path / "data.hdf5", "w") as f:
        f["observations"] = np.zeros((3, 11))
    (tmp_path / "summary.json").write_text('{"steps": 3}')
    (tmp_path / "notes.txt").write_text("hello")
    for name, what in (("data.hdf5", "is an HDF5 file (a dataset? give it as data_source=d4rl:PATH), not a PyTorch"),
                       ("summary.json", "is a JSON file, not a PyTorch checkpoint"),
                       ("notes.txt", "is not a PyTorch checkpoint (torch.save writes a zip archive; this file begins b'hell')")):
        with pytest.raises(ValueError, match=re.escape(f"checkpoint {tmp_path / name} {what}")):
            checkpoint.load(tmp_path / name)


def test_a_write_past_a_real_file_size_limit_is_one_clear_error_and_keeps_the_old_file(tmp_path, run_code):
    """2 MB into a process whose files may not grow past 512 KB (RLIMIT_FSIZE: the write fails with
    EFBIG, as on a full disk with ENOSPC)."""
    old = checkpoint.save_atomic({"model": torch.arange(10)}, tmp_path / "last.pt")
    before = old.read_bytes()
    p = run_code("import sys, torch\nfrom primal_dt.run import checkpoint, errors\n"
                 f"try:\n    checkpoint.save_atomic({{'model': torch.zeros(2**19)}}, {str(old)!r}, "
                 "what='checkpoint (step 7)')\n"
                 "except errors.WriteError as e:\n    sys.exit(f'error: {e}')\n", file_size=512 * 1024)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert p.stderr.strip() == (f"error: could not write the checkpoint (step 7) {old}: file too large (a file-size "
                                "limit such as `ulimit -f` was reached)")
    assert old.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["last.pt"]  # no temporary left
    with pytest.raises(WriteError, match=r"could not write the checkpoint .*nope.pt: a file is in the way"):
        checkpoint.save_atomic({}, old / "nope.pt")


STALLED_WRITE = ("import os, sys, time\nfrom primal_dt.run import checkpoint\n"
                 "os.fsync = lambda fd: (print('writing', flush=True), time.sleep(600))\n"
                 "checkpoint.write_atomic(sys.argv[1], b'x' * 1000, 'test file')\n")


def test_a_temporary_is_removed_only_when_its_writer_is_gone(tmp_path, killed_checkpoint_write):
    """Real writers stalled mid-write (their fsync never returns): a killed one's temporary is removed, a live
    one's kept, whoever the live writer is (another process, another thread of this one); once it dies, its
    temporary goes too. Temporaries of other files and files of other names are left alone."""
    import threading

    run = tmp_path / "run"
    run.mkdir()
    dead = killed_checkpoint_write(run / "last.pt")
    live = subprocess.Popen([sys.executable, "-c", STALLED_WRITE, str(run / "best.pt")], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    stall, real_fsync = threading.Event(), os.fsync
    try:
        assert live.stdout.readline().strip() == "writing"
        (alive,) = run.glob(".best.pt.*.tmp")
        unrelated = run / ".notes.txt.tmp"
        unrelated.write_bytes(b"x")

        in_fsync = threading.Event()

        def stalled_fsync(fd):  # this process's own writer, stalled in another thread
            in_fsync.set()
            stall.wait(60)
            real_fsync(fd)

        os.fsync = stalled_fsync
        writer = threading.Thread(target=checkpoint.write_atomic, args=(run / "summary.json", "{}", "summary"))
        writer.start()
        # in its fsync, the writer holds its temporary's lock (seen between creating and locking it, a cleaner may
        # take a temporary: the writer then makes another, by design)
        assert in_fsync.wait(30)
        (mine,) = run.glob(".summary.json.*.tmp")
        assert checkpoint.remove_stale_temps(run) == [dead]
        assert checkpoint.remove_stale_temps(run, names=("best.pt",)) == []
        assert sorted(run.iterdir()) == sorted([alive, mine, unrelated])
        stall.set()
        writer.join()
        assert (run / "summary.json").read_text() == "{}" and not mine.exists()
    finally:
        stall.set()
        os.fsync = real_fsync
        live.kill()
        live.wait()
    assert checkpoint.remove_stale_temps(run) == [alive]  # its writer is gone now
    assert sorted(p.name for p in run.iterdir()) == [unrelated.name, "summary.json"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_get_the_permissions_of_the_users_umask_and_replaced_ones_keep_theirs(tmp_path, run_code,
                                                                                             umask, mode):
    """A new file: 0o666 less the umask, as any program's; a file replaced: its own permissions. In a real process
    with that umask (the umask is process-wide)."""
    new, kept, planted, victim = (tmp_path / n for n in ("summary.json", "last.pt", "eval_return.png", "victim"))
    kept.write_bytes(b"old")
    kept.chmod(0o640)
    victim.write_bytes(b"not ours")
    victim.chmod(0o777)
    planted.symlink_to(victim)  # replaced, not followed: the new file must not take the victim's permissions either
    p = run_code(f"import os\nos.umask({umask})\nfrom primal_dt.run import checkpoint\n"
                 f"checkpoint.write_atomic({str(new)!r}, '{{}}', 'summary')\n"
                 f"checkpoint.save_atomic({{'model': 1}}, {str(kept)!r})\n"
                 f"checkpoint.write_atomic({str(planted)!r}, b'png', 'plot')\n")
    assert p.returncode == 0, p.stderr[-2000:]
    assert oct(new.stat().st_mode & 0o777) == oct(mode) and oct(kept.stat().st_mode & 0o777) == oct(0o640)
    assert not planted.is_symlink() and oct(planted.stat().st_mode & 0o777) == oct(mode)
    assert victim.read_bytes() == b"not ours" and oct(victim.stat().st_mode & 0o777) == oct(0o777)
