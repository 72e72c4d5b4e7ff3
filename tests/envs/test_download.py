"""D4RL files downloaded by name (envs/download.py, envs/d4rl.py) from a real HTTP server on the loopback
interface that the tests start: small D4RL files made by the package's writer, served whole, cut short,
stalled, refused, or in ranges; the package finds the server through $PRIMAL_DT_D4RL_URL."""

import fcntl
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import numpy as np
import pytest

from envs import get_spec, load_dataset
from envs.d4rl import D4RL_URL, d4rl_url, write_d4rl
from envs.download import fetch, part_path
from envs.sources import DatasetError, DatasetNotFound


def d4rl_bytes(tmp_path, name="hopper-medium", steps=300, keys=None):
    """A D4RL-format file of ``name``'s dimensions, written by the package's writer: episodes of 100 steps,
    the first ended by a fall, the others by the time limit."""
    spec = get_spec(name)
    rng = np.random.default_rng(0)
    ends = np.zeros(steps, bool)
    ends[99::100] = True
    arrays = {"observations": rng.normal(size=(steps, spec.obs_dim)),
              "actions": rng.uniform(-1, 1, size=(steps, spec.act_dim)),
              "rewards": rng.uniform(0, 3, size=steps),
              "terminals": ends & (np.arange(steps) < 100), "timeouts": ends & (np.arange(steps) >= 100)}
    path = write_d4rl(tmp_path / f"served-{name}.hdf5", arrays)
    return path.read_bytes()


class Handler(BaseHTTPRequestHandler):
    """Serves ``server.files[path]``: {"body": bytes, "mode": "whole" | "cut" | "stall" | "silent", "cut": n,
    "ranges": bool}. "cut" announces the whole length and sends ``cut`` bytes; "stall" sends them and then nothing;
    "silent" answers nothing at all."""

    def do_GET(self):
        srv = self.server
        path = urlparse(self.path).path  # a proxy is asked for the whole address
        srv.requests.append((path, self.headers.get("Range")))
        entry = srv.files.get(path)
        if entry is None:
            self.send_error(404)
            return
        body, mode, cut = entry["body"], entry.get("mode", "whole"), entry.get("cut", 0)
        if mode == "silent":
            srv.release.wait(30)
            return
        start, asked = 0, re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if asked and entry.get("ranges", True):
            start = int(asked[1])
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        self.wfile.write(body[start:] if mode == "whole" else body[start:start + cut])
        self.wfile.flush()
        if mode == "stall":
            srv.release.wait(30)

    def log_message(self, *args):
        pass


@pytest.fixture
def server(monkeypatch):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    srv.files, srv.requests, srv.release = {}, [], threading.Event()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/d4rl"
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("PRIMAL_DT_OFFLINE", "0")
    monkeypatch.setenv("PRIMAL_DT_D4RL_URL", srv.url)
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


def serve(srv, name, body, **how):
    srv.files[f"/d4rl/{get_spec(name).d4rl_file}"] = {"body": body, **how}


def test_the_address_is_d4rls(monkeypatch):
    """d4rl's URL table (infos.py): gym_mujoco_v2/<family>_<level with underscores>-v2.hdf5."""
    monkeypatch.delenv("PRIMAL_DT_D4RL_URL", raising=False)
    assert D4RL_URL == "http://rail.eecs.berkeley.edu/datasets/offline_rl/gym_mujoco_v2"
    assert d4rl_url(get_spec("hopper-medium-replay")) == f"{D4RL_URL}/hopper_medium_replay-v2.hdf5"
    assert d4rl_url(get_spec("halfcheetah-medium-expert")) == f"{D4RL_URL}/halfcheetah_medium_expert-v2.hdf5"
    monkeypatch.setenv("PRIMAL_DT_D4RL_URL", "http://mirror.example/d4rl/")
    assert d4rl_url(get_spec("walker2d-random")) == "http://mirror.example/d4rl/walker2d_random-v2.hdf5"


@pytest.mark.parametrize("name", ["hopper-medium", "hopper-medium-replay", "walker2d-medium-expert"])
def test_a_missing_file_is_downloaded_checked_and_put_in_place(server, data_dirs, tmp_path, capsys, name):
    body = d4rl_bytes(tmp_path, name)
    serve(server, name, body)
    ds = load_dataset(name)  # auto: D4RL first
    target = data_dirs["d4rl"] / get_spec(name).d4rl_file
    assert ds.source == f"d4rl:{target}" and ds.num_steps == 300 and ds.lengths.tolist() == [100, 100, 100]
    assert target.read_bytes() == body and not part_path(target).exists()
    assert server.requests == [(f"/d4rl/{target.name}", None)]
    err = capsys.readouterr().err
    assert f"downloading {server.url}/{target.name} ({len(body) / 2**20:,.1f} MiB) to {target.parent}" in err
    assert "\r" not in err  # not a terminal: no bar frames
    load_dataset(name, verbose=False)  # now local: no second download
    assert len(server.requests) == 1


def test_a_truncated_download_is_kept_for_resuming_and_not_put_in_place(server, data_dirs, tmp_path, capsys):
    body = d4rl_bytes(tmp_path)
    serve(server, "hopper-medium", body, mode="cut", cut=1000)  # Content-Length: all of it; 1000 bytes sent
    with pytest.raises(DatasetNotFound) as e:
        load_dataset("hopper-medium", source="d4rl")
    target = data_dirs["d4rl"] / "hopper_medium-v2.hdf5"
    assert f"the server announced {len(body):,} bytes and sent 1,000" in str(e.value)
    assert not target.exists() and part_path(target).read_bytes() == body[:1000]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[envs] d4rl:")]
    assert len(lines) == 1 and f"put hopper_medium-v2.hdf5 in {target.parent} by hand" in lines[0]
    assert "next attempt resumes" in lines[0] and "PRIMAL_DT_OFFLINE=1 skips" in lines[0]


def test_an_interrupted_download_resumes_where_it_stopped(server, data_dirs, tmp_path, capsys):
    body = d4rl_bytes(tmp_path)
    serve(server, "hopper-medium", body, mode="cut", cut=2500)
    with pytest.raises(DatasetNotFound):
        load_dataset("hopper-medium", source="d4rl", verbose=False)
    serve(server, "hopper-medium", body)  # the server now sends everything, honouring ranges
    ds = load_dataset("hopper-medium", source="d4rl")
    target = data_dirs["d4rl"] / "hopper_medium-v2.hdf5"
    assert server.requests[-1] == ("/d4rl/hopper_medium-v2.hdf5", "bytes=2500-")  # only the rest was asked for
    assert target.read_bytes() == body and not part_path(target).exists() and ds.num_steps == 300
    assert "resuming the download" in capsys.readouterr().err


@pytest.mark.parametrize("partial", ["garbage", "longer"])
def test_a_server_that_ignores_or_refuses_the_range_restarts_cleanly(server, data_dirs, tmp_path, capsys, partial):
    """A partial file the server will not continue (it ignores Range: 200; or the range starts past the file's
    end: 416) is replaced by the whole file, never appended to or left longer."""
    body = d4rl_bytes(tmp_path)
    target = data_dirs["d4rl"] / "hopper_medium-v2.hdf5"
    part_path(target).write_bytes(b"x" * (777 if partial == "garbage" else len(body) + 500))
    serve(server, "hopper-medium", body, ranges=partial != "garbage")
    load_dataset("hopper-medium", source="d4rl")
    assert target.read_bytes() == body and not part_path(target).exists()
    asked = 777 if partial == "garbage" else len(body) + 500
    assert server.requests[0][1] == f"bytes={asked}-"
    assert server.requests[-1][1] == (None if partial == "longer" else f"bytes={asked}-")
    if partial == "garbage":
        assert "does not resume downloads: downloading it from the start" in capsys.readouterr().err


@pytest.mark.parametrize("served", ["html", "hdf5-without-keys", "another-task"])
def test_a_file_that_is_not_the_d4rl_dataset_is_refused_and_deleted(server, data_dirs, tmp_path, served):
    import h5py

    if served == "html":  # what a captive portal answers
        body = b"<html><body>Please log in to the network</body></html>"
    elif served == "another-task":  # walker2d data under hopper's name
        body = d4rl_bytes(tmp_path, "walker2d-medium")
    else:
        with h5py.File(tmp_path / "x.hdf5", "w") as f:
            f["observations"] = np.zeros((5, 11))
        body = (tmp_path / "x.hdf5").read_bytes()
    serve(server, "hopper-medium", body)
    with pytest.raises(DatasetNotFound) as e:
        load_dataset("hopper-medium", source="d4rl", verbose=False)
    target = data_dirs["d4rl"] / "hopper_medium-v2.hdf5"
    assert "served a file that is not the D4RL dataset hopper-medium, so it was deleted" in str(e.value)
    assert not target.exists() and not part_path(target).exists()


def test_a_missing_file_on_the_server_is_one_line_and_leaves_nothing(server, data_dirs, capsys):
    with pytest.raises(DatasetNotFound) as e:
        load_dataset("hopper-medium", source="d4rl")
    assert f"{server.url}/hopper_medium-v2.hdf5 answered 404" in str(e.value)
    assert os.listdir(data_dirs["d4rl"]) == []
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "answered 404" in ln]
    assert len(lines) == 1 and lines[0].startswith("[envs] d4rl: cannot download the D4RL dataset hopper-medium")


@pytest.mark.parametrize("mode", ["stall", "silent"])
def test_a_stalled_connection_times_out_and_the_next_attempt_resumes(server, data_dirs, tmp_path, mode):
    """The server stops sending mid-body ("stall", after 1500 bytes) or never answers ("silent"): the transfer
    stops after the stall timeout with what arrived kept, and a later attempt continues from there."""
    body = d4rl_bytes(tmp_path)
    serve(server, "hopper-medium", body, mode=mode, cut=1500)
    target = data_dirs["d4rl"] / "hopper_medium-v2.hdf5"
    url = f"{server.url}/{target.name}"
    check = lambda p: load_dataset("hopper-medium", source=f"d4rl:{p}", verbose=False)  # noqa: E731
    t = time.monotonic()
    with pytest.raises(DatasetNotFound) as e:
        fetch(url, target, check, what="hopper-medium", timeout=1.0, verbose=False)
    assert time.monotonic() - t < 20  # bounded by the timeout, not the server (a generous bound)
    kept = body[:1500] if mode == "stall" else b""
    assert ("nothing received for 1 s" if mode == "stall" else "no answer for 1 s") in str(e.value)
    assert not target.exists()
    assert part_path(target).read_bytes() == kept if kept else not part_path(target).exists()
    server.release.set()
    serve(server, "hopper-medium", body)
    assert fetch(url, target, check, what="hopper-medium", timeout=1.0, verbose=False) == target
    assert target.read_bytes() == body and server.requests[-1][1] == (f"bytes={len(kept)}-" if kept else None)


def test_offline_it_fails_within_seconds_and_auto_goes_on_in_its_documented_order(data_dirs, tmp_path, monkeypatch,
                                                                                   capsys):
    monkeypatch.setenv("PRIMAL_DT_OFFLINE", "0")
    monkeypatch.setenv("PRIMAL_DT_D4RL_URL", "http://127.0.0.1:9/d4rl")  # nothing listens: refused at once
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # Minari's download fails the same way
    (data_dirs["replicas"] / "hopper_medium-replica.hdf5").write_bytes(d4rl_bytes(tmp_path))
    t = time.monotonic()
    with pytest.warns(UserWarning, match="REPLICA"):
        ds = load_dataset("hopper-medium", verbose=False)
    assert time.monotonic() - t < 30  # not a hang (a generous bound; it takes milliseconds here)
    assert ds.source.startswith("replica:")
    searched = ds.metadata["searched"]
    assert [s.partition(":")[0] for s in searched] == ["d4rl", "minari"]
    assert "127.0.0.1:9 is unreachable" in searched[0] and "hopper_medium-v2.hdf5 in" in searched[0]
    assert os.listdir(data_dirs["d4rl"]) == []
    capsys.readouterr()
    with pytest.raises(DatasetNotFound):  # verbose: one line says why, and where to put the file by hand
        load_dataset("hopper-medium", source="d4rl")
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[envs] d4rl:")]
    assert len(lines) == 1 and "127.0.0.1:9 is unreachable" in lines[0]
    assert f"put hopper_medium-v2.hdf5 in {data_dirs['d4rl']} by hand" in lines[0]


def test_offline_setting_skips_the_download(server, tmp_path, monkeypatch):
    monkeypatch.setenv("PRIMAL_DT_OFFLINE", "1")
    serve(server, "hopper-medium", d4rl_bytes(tmp_path))
    with pytest.raises(DatasetNotFound) as e:
        load_dataset("hopper-medium", source="d4rl", verbose=False)
    assert server.requests == []
    msg = str(e.value)
    assert f"from {server.url}/hopper_medium-v2.hdf5 on a connected machine" in msg and "PRIMAL_DT_OFFLINE" in msg


def test_a_bad_address_setting_is_an_error_not_a_fall_through(monkeypatch):
    monkeypatch.setenv("PRIMAL_DT_OFFLINE", "0")
    monkeypatch.setenv("PRIMAL_DT_D4RL_URL", "ftp://mirror.example/d4rl")
    with pytest.raises(DatasetError, match="PRIMAL_DT_D4RL_URL='ftp://mirror.example/d4rl' is not an http:// or https"):
        load_dataset("hopper-medium", verbose=False)


def test_one_process_downloads_a_file_the_others_wait_for_it(server, data_dirs, tmp_path, capsys):
    """Every rank of a multi-process run loads the data: while one holds the partial file, another waits,
    then reads the file the first put in place instead of downloading it again."""
    body = d4rl_bytes(tmp_path)
    serve(server, "hopper-medium", body)
    target = data_dirs["d4rl"] / "hopper_medium-v2.hdf5"
    fd = os.open(part_path(target), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process's download, under way
    result = {}
    waiter = threading.Thread(target=lambda: result.update(ds=load_dataset("hopper-medium", source="d4rl")))
    waiter.start()
    deadline = time.monotonic() + 20
    while "waiting for it" not in capsys.readouterr().err and time.monotonic() < deadline:
        time.sleep(0.05)
    os.write(fd, body)
    os.replace(part_path(target), target)  # the other process finishes
    os.close(fd)
    waiter.join(20)
    assert result["ds"].source == f"d4rl:{target}" and server.requests == []


def test_written_to_a_file_the_progress_is_plain_lines(server, data_dirs, tmp_path, capsys, monkeypatch):
    """stderr is not a terminal under pytest: no bar frames, a plain line every LINE_EVERY seconds (here at
    every block received)."""
    import envs.download

    monkeypatch.setattr(envs.download, "LINE_EVERY", 0.0)
    body = d4rl_bytes(tmp_path)
    serve(server, "hopper-medium", body)
    target = data_dirs["d4rl"] / "hopper_medium-v2.hdf5"
    fetch(f"{server.url}/{target.name}", target, lambda p: None, what="hopper-medium")
    err = capsys.readouterr().err
    assert "\r" not in err and re.search(r"^\[envs\] hopper_medium-v2\.hdf5: [\d.]+ of [\d.]+ MiB after \d+ s$", err,
                                         flags=re.M)


def test_behind_a_proxy_the_probe_and_the_download_go_through_it(server, data_dirs, tmp_path, monkeypatch):
    """A machine that reaches the web only through $http_proxy: the server's own address is never contacted
    (here it does not even resolve), the proxy is."""
    body = d4rl_bytes(tmp_path)
    serve(server, "hopper-medium", body)
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("http_proxy", server.url.removesuffix("/d4rl"))
    monkeypatch.setenv("PRIMAL_DT_D4RL_URL", "http://d4rl-mirror.invalid/d4rl")
    ds = load_dataset("hopper-medium", source="d4rl", verbose=False)
    assert ds.num_steps == 300 and server.requests == [("/d4rl/hopper_medium-v2.hdf5", None)]
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # a proxy that is down: the probe says so
    with pytest.raises(DatasetNotFound, match="the proxy 127.0.0.1:9 is unreachable"):
        load_dataset("walker2d-medium", source="d4rl", verbose=False)
