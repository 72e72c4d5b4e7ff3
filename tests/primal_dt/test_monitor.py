"""RunMonitor against real TensorBoard event files: a resumed run continues its killed
predecessor's curves even when both start within one second."""

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from primal_dt.monitor import RunMonitor


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
