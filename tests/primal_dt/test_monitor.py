"""RunMonitor against real TensorBoard event files: a resumed run continues its killed
predecessor's curves even when both start within one second."""

import contextlib
import os
import signal

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from primal_dt.run.interrupts import Interrupts
from primal_dt.run.monitor import RunMonitor


def steps(d, tag):
    acc = EventAccumulator(str(d), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_resume_in_the_same_second_keeps_the_curve_in_order(tmp_path):
    first = RunMonitor(tmp_path, progress=False)
    for s in (1, 2, 3):  # the killed run: its checkpoint was at step 2, step 3 came after it
        first.scalar("loss", float(s), s)
    first.close()
    # as if the predecessor were another process with a larger pid (names: events.out.tfevents.<second>.<host>.<pid>...)
    (f,) = tmp_path.glob("events.out.tfevents.*")
    parts = f.name.split(".")
    parts[-2] = "999999999"  # the pid field (host names may contain dots)
    f.rename(tmp_path / ".".join(parts))
    second = RunMonitor(tmp_path, progress=False, purge_step=3)  # resumes from the step-2 checkpoint
    for s in (3, 4):
        second.scalar("loss", 10.0 * s, s)
    second.close()
    assert steps(tmp_path, "loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert second.history["loss"] == [(3, 30.0), (4, 40.0)]


def test_flush_puts_events_on_disk_before_close(tmp_path):
    mon = RunMonitor(tmp_path, progress=False)
    mon.scalar("x", 1.5, 7)
    mon.flush()
    assert steps(tmp_path, "x") == [(7, 1.5)]  # readable while the writer is still open
    mon.close()


def test_run_directories_started_together_are_distinct_and_created(tmp_path):
    """Forty runs asking for a directory in the same second with the same seed get forty, each
    created by its claimant (checking the name and creating it later let two runs share one)."""
    from concurrent.futures import ThreadPoolExecutor

    from primal_dt.run.monitor import run_dir

    with ThreadPoolExecutor(40) as pool:
        dirs = list(pool.map(lambda _: run_dir(tmp_path, "hopper-medium", "primal+dt", seed=0), range(40)))
    assert len(set(dirs)) == 40 and all(d.is_dir() and not any(d.iterdir()) for d in dirs)
    assert all(d.parent == tmp_path / "hopper-medium" / "primal+dt" and d.name.endswith("-seed0") for d in dirs)


def test_an_unwritable_root_is_one_clear_error(tmp_path, run_code):
    from primal_dt.run.monitor import run_dir
    from primal_dt.run.errors import WriteError

    (tmp_path / "file").write_text("x")
    with pytest.raises(WriteError, match=r"could not write the run directory .*file/hopper-medium: a part of the "
                                         r"path is a file, not a directory; nothing was written. Choose a writable out="):
        run_dir(tmp_path / "file", "hopper-medium", seed=0)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    p = run_code(f"from primal_dt.run.monitor import run_dir\nrun_dir({str(locked)!r}, 'x', seed=0)", honour_permissions=True)
    assert "WriteError: could not write the run directory" in p.stderr and "permission denied" in p.stderr, p.stderr
    assert not any(locked.iterdir())


def test_tensorboard_past_a_real_file_size_limit_is_one_write_error(tmp_path, run_code):
    """TensorBoard writes its events in a thread; a write it cannot make reaches the logging code as
    one WriteError naming the directory, without the thread's traceback."""
    p = run_code("import sys\nfrom primal_dt.run.monitor import RunMonitor\nfrom primal_dt.run.errors import WriteError\n"
                 f"m = RunMonitor({str(tmp_path)!r}, progress=False)\n"
                 "try:\n    for i in range(5000):\n        m.scalar('x', i, i)\n        m.flush()\n"
                 "except WriteError as e:\n    m.close()\n    sys.exit(f'error: {e}')\n", file_size=4096)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "Exception in thread" not in p.stderr, p.stderr
    assert p.stderr.strip() == (f"error: could not write the TensorBoard event file in {tmp_path}: file too large "
                                "(a file-size limit such as `ulimit -f` was reached)")


def test_a_resume_after_a_truncated_event_file_continues_one_clean_curve(tmp_path):
    """A write cut short (a file-size limit, a kill) leaves the event file's last record partial; TensorBoard
    stops reading that file at the torn record and the resumed run's purge drops what followed the
    checkpoint, so the curve is read once, in order, with no duplicate steps."""
    first = RunMonitor(tmp_path, progress=False)
    for s in (1, 2, 3):
        first.scalar("loss", float(s), s)
    first.close()
    (f,) = tmp_path.glob("events.out.tfevents.*")
    f.write_bytes(f.read_bytes()[:-7])  # the step-3 record torn
    second = RunMonitor(tmp_path, progress=False, purge_step=3)
    for s in (3, 4):
        second.scalar("loss", 10.0 * s, s)
    second.close()
    assert steps(tmp_path, "loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


@pytest.mark.parametrize("trainer", [True, False])
def test_an_interrupt_inside_the_event_writer_waits_for_the_write_and_close_returns(tmp_path, trainer):
    """A SIGTERM raised inside TensorBoard's writer (its queue, its worker thread) left close() waiting forever
    (seen under load: a classifier stopped by SIGTERM never exited). It now lands after the write: the event is
    on disk, the interrupt still stops the run, and close returns; in a trainer (its handler installed) as in a
    command that installs none (eval.video), whose handlers are as they were afterwards."""
    mon = RunMonitor(tmp_path, progress=False)
    real, reached = mon.writer.add_scalar, []

    def add_scalar(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the writer works
        reached.append(True)
        return real(*args, **kwargs)

    mon.writer.add_scalar = add_scalar
    with Interrupts().installed() if trainer else contextlib.nullcontext():
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            mon.scalar("loss", 1.5, 7)
    assert reached == [True] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    mon.close()
    assert steps(tmp_path, "loss") == [(7, 1.5)]


def test_held_regions_nest_and_a_second_interrupt_stops_at_once():
    """The interrupt waits for the outermost held region; a second one is raised where it arrives."""
    interrupts, order = Interrupts(), []
    with interrupts.installed():
        with pytest.raises(KeyboardInterrupt):
            with interrupts.held():
                with interrupts.held():
                    os.kill(os.getpid(), signal.SIGTERM)
                    order.append("inner end")
                order.append("outer end")
        assert order == ["inner end", "outer end"]
        with pytest.raises(KeyboardInterrupt), interrupts.held():
            os.kill(os.getpid(), signal.SIGTERM)
            order.append("first deferred")
            os.kill(os.getpid(), signal.SIGTERM)
            order.append("never reached")
    assert order[-1] == "first deferred"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
