"""eval.video and RunMonitor.video: a recorded episode reaches a real TensorBoard event file as an
animated GIF (what TensorBoard plays), the GIF file holds the same bytes, the rendering backend is
picked in order (egl, then osmesa) and a machine without one gets a message, not a crash."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from eval.video import BACKENDS, frame_every, rendering_available
from primal_dt.run.monitor import RunMonitor, encode_gif


def tensorboard_images(logdir, tag):
    """Image events of ``tag`` as TensorBoard's own reader returns them."""
    acc = EventAccumulator(str(logdir), size_guidance={"images": 0})
    acc.Reload()
    return acc.Images(tag)


def gif_frames(data: bytes) -> list[np.ndarray]:
    im = Image.open(io.BytesIO(data))
    assert im.format == "GIF"
    out = []
    for k in range(im.n_frames):
        im.seek(k)
        out.append(np.asarray(im.convert("RGB")))
    return out


def test_a_video_is_a_gif_image_in_a_real_event_file(tmp_path):
    # distinct frames with few colours: the GIF palette holds them exactly
    frames = [np.zeros((24, 32, 3), np.uint8) for _ in range(6)]
    for k, f in enumerate(frames):
        f[:, :, k % 3] = 40 * (k + 1)
        f[k:k + 4, :8] = 255
    mon = RunMonitor(tmp_path, progress=False)
    data = encode_gif(frames, 25)
    mon.image("rollout/stream", data, frames[0].shape[:2], step=7)
    mon.close()
    (event,) = tensorboard_images(tmp_path, "rollout/stream")
    assert (event.step, event.width, event.height) == (7, 32, 24)
    assert event.encoded_image_string == data
    decoded = gif_frames(data)
    assert len(decoded) == len(frames)
    for got, want in zip(decoded, frames):
        np.testing.assert_array_equal(got, want)
    assert Image.open(io.BytesIO(data)).info["duration"] == 40  # 25 fps: 4 centiseconds a frame


@pytest.mark.parametrize("fps, ms", [(25, 40), (10, 100), (60, 20), (1000, 20)])
def test_gif_frame_delays_are_whole_centiseconds_of_at_least_two(fps, ms):
    """Browsers play a delay under 2 cs as 10 cs; faster frame rates are capped at 50 fps instead."""
    frames = [np.full((4, 4, 3), v, np.uint8) for v in (0, 120, 250)]
    assert Image.open(io.BytesIO(encode_gif(frames, fps))).info["duration"] == ms


def test_frames_are_sampled_for_real_time_playback():
    assert frame_every(0.008) == 5  # Hopper, Walker2d: 40 ms of simulated time per frame
    assert frame_every(0.05) == 1  # HalfCheetah, Ant
    assert frame_every(0.5) == 1


def test_backends_are_tried_in_order_and_a_machine_without_any_gets_the_reason(monkeypatch):
    monkeypatch.delenv("MUJOCO_GL", raising=False)
    alone = {b: rendering_available(b)[0] for b in BACKENDS}
    first = next((b for b in BACKENDS if alone[b]), None)
    ok, got = rendering_available()  # MUJOCO_GL unset: egl, then osmesa
    assert (got if ok else None) == first
    ok, got = rendering_available(["no-such-backend", *BACKENDS])
    if first is not None:
        assert ok and got == first
    else:  # every one tried, each with its own reason
        assert not ok and all(f"MUJOCO_GL={b}:" in got for b in ("no-such-backend", *BACKENDS))
    monkeypatch.setenv("MUJOCO_GL", "no-such-backend")  # set: only that one is tried
    ok, msg = rendering_available()
    assert not ok and "MUJOCO_GL=no-such-backend:" in msg
    assert not any(f"MUJOCO_GL={b}:" in msg for b in BACKENDS) and "rollout results are unaffected" in msg


@pytest.mark.parametrize("gl", [None, pytest.param("glfw", marks=pytest.mark.slow)], ids=["auto", "glfw-without-display"])
def test_rollout_video_true_out_of_the_box(gl, tmp_path, tiny_dt, dt_checkpoint_file, run_cli, monkeypatch):
    """``python -m eval.rollout ... video=true`` as a user runs it (MUJOCO_GL unset): the GIF file and
    the same GIF in TensorBoard. With no backend that renders (glfw needs a display; a valid MUJOCO_GL
    value, so the simulators themselves still load), the rollout still succeeds and says why. The video goes
    where out= puts the report, not beside the checkpoint."""
    if gl is None:
        monkeypatch.delenv("MUJOCO_GL", raising=False)
    else:
        monkeypatch.setenv("MUJOCO_GL", gl)
        monkeypatch.delenv("DISPLAY", raising=False)
        monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    ckpt = dt_checkpoint_file(tmp_path, tiny_dt("primal+dt", K=5))
    out = tmp_path / "reports" / "report.json"
    p = run_cli("eval.rollout", f"checkpoint={ckpt}", "engine=stream", "episodes=1", "targets=3600", "max_steps=30",
                "num_envs=1", "video=true", "progress=false", f"out={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    video = json.loads(out.read_text())["video"]
    available, backend = rendering_available()
    if not available:  # this machine (or this case) renders nothing: the reason, and no file
        assert video["path"] is None and "rollout results are unaffected" in video["message"]
        assert video["message"] in p.stderr and f"video: {video['message']}" in p.stdout
        assert not list(tmp_path.rglob("*.gif")) and not (out.parent / "video").exists()
        return
    gif = Path(video["path"])
    assert not list(tmp_path.glob("*.gif")) and not (tmp_path / "video").exists()  # nothing beside the checkpoint
    assert gif == out.parent / "episode-stream.gif" and video["backend"] == backend and video["length"] <= 30
    data = gif.read_bytes()
    assert len(gif_frames(data)) == video["frames"] >= 2
    (event,) = tensorboard_images(out.parent / "video", "rollout/stream")
    assert event.encoded_image_string == data and (event.width, event.height) == (240, 240)
    assert f"video: {gif}; TensorBoard: GIF" in p.stdout


def test_a_gif_that_cannot_be_written_whole_leaves_no_file(tmp_path, run_code):
    """A GIF written under a file-size limit (as a full disk) is one error naming it, and no truncated
    GIF nor empty claimed name is left as the rollout's output."""
    code = ("import numpy as np\nfrom pathlib import Path\nfrom eval.video import _write\n"
            "frames = [np.random.default_rng(i).integers(0, 255, (64, 64, 3), dtype=np.uint8) for i in range(20)]\n"
            f"_write(frames, 10.0, Path({str(tmp_path)!r}), 'stream', 0)\n")
    p = run_code(code, file_size=4096)
    assert p.returncode != 0 and "could not write the episode GIF" in p.stderr, p.stderr[-2000:]
    assert not list(tmp_path.iterdir())
