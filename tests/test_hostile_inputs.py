"""The hostile-input corpus: files and paths crafted by the tests, given to the real entry points as a
user (or an attacker who can write into their folders) would. Every case asserts one ``error:`` line and no
traceback, the exit status, a time bound, and that nothing outside the command's target changed (every file
and link under the test's folder, content and all, compared before and after).

The commands run as ``python -m`` runs them, each in its own process, forked from one that imported torch and
the simulators once (tests/forked_entries.py): the corpus fits the default test run. Readers that are the entry
themselves (the JSON reader, the ONNX runtime's metadata) are called directly. Time bounds are on processor time
(a test machine shared with training sweeps stretches wall time several-fold); a command that blocks instead of
computing is ended by its wall-clock timeout and fails its case."""

import errno
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import pytest

from primal_dt.run import json_reader
from primal_dt.run.json_reader import JSONError

ROOT = Path(__file__).resolve().parents[1]
LONG = "n" * 300
"""a file name longer than the 255 bytes Linux allows"""
QUOTES = '\\"'
"""an escaped quote: a file of them made the old nesting scan quadratic"""
TINY = ["preset=smoke", "tensorboard=false", "model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.s=8",
        "K=5", "batch_size=8", "warmup_steps=3", "eval.every=0", "eval.final_episodes=2", "eval.max_steps=15",
        "eval.num_envs=2", "eval.engine=stream"]
FAST = 10.0
"""processor seconds a refusal may take in its own (forked) process; a hang runs into the timeout"""


# -- the entry points, as processes ------------------------------------------------------------------------------
@dataclass
class Ended:
    returncode: int
    seconds: float
    cpu_seconds: float
    stdout: str
    stderr: str


class Entries:
    """``python -m`` commands run by the server in tests/forked_entries.py."""

    def __init__(self, scratch: Path):
        self.scratch, self.n = scratch, 0
        self.server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "forked_entries.py")], cwd=ROOT,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       env={**os.environ, "OMP_NUM_THREADS": "1"})

    def _ask(self, request: dict) -> dict:
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        assert line, "the entry-point server ended"
        return json.loads(line)

    def start(self, module: str, *args, env: dict | None = None, timeout: int = 120) -> tuple[int, Path]:
        self.n += 1
        out = self.scratch / f"{self.n}"
        request = {"module": module, "args": [str(a) for a in args], "cwd": str(ROOT), "timeout": timeout,
                   "env": {**os.environ, "OMP_NUM_THREADS": "1", "PRIMAL_DT_OFFLINE": "1", **(env or {})},
                   "stdout": f"{out}.out", "stderr": f"{out}.err"}
        return self._ask(request)["pid"], out

    def wait(self, started: tuple[int, Path]) -> Ended:
        pid, out = started
        answer = self._ask({"wait": pid})
        return Ended(answer["rc"], answer["seconds"], answer["cpu_seconds"], Path(f"{out}.out").read_text(),
                     Path(f"{out}.err").read_text())

    def run(self, module: str, *args, **kw) -> Ended:
        return self.wait(self.start(module, *args, **kw))

    def close(self):
        self.server.kill()  # every command it started has been waited for
        self.server.wait(30)


@pytest.fixture(scope="module")
def entries():
    with tempfile.TemporaryDirectory(prefix="hostile-output-") as scratch:
        e = Entries(Path(scratch))
        yield e
        e.close()


@pytest.fixture(scope="module")
def refused(one_line_error):
    """refused(ended, *fragments, status=2, within=FAST) -> the line: ``one_line_error``'s checks (the status,
    one ``error:`` line holding every fragment, no traceback), and within ``within`` processor seconds."""
    def check(ended: Ended, *fragments, status: int = 2, within: float = FAST) -> str:
        line = one_line_error(ended, *fragments, status=status)
        assert ended.cpu_seconds < within, f"took {ended.cpu_seconds:.1f} s of processor time: {line}"
        return line

    return check


def tree(root: Path, leave_out: Path | None = None) -> dict:
    """Every entry under ``root`` (links not followed) with its kind and content, but ``leave_out``'s."""
    seen = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(d) / name
            if leave_out is not None and (p == leave_out or leave_out in p.parents):
                continue
            if p.is_symlink():
                seen[p] = ("link", os.readlink(p))
            elif p.is_file():
                seen[p] = ("file", p.stat().st_mode, hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                seen[p] = ("dir", p.stat().st_mode)
    return seen


class Outside:
    """``with Outside(root, target):`` asserts that nothing under ``root`` but ``target`` changed."""

    def __init__(self, root: Path, target: Path | None = None):
        self.root, self.target = root, target

    def __enter__(self):
        self.before = tree(self.root, self.target)

    def __exit__(self, *exc):
        if exc[0] is None:
            assert tree(self.root, self.target) == self.before, "something outside the target changed"


# -- 1. JSON: bounded in time as in size, for every reader ---------------------------------------------------------
def timed_read(path, **kw) -> tuple[float, object]:
    """(processor seconds, the value or the JSONError) of reading ``path``."""
    t0 = time.process_time()
    try:
        value = json_reader.read(path, **kw)
    except JSONError as err:
        value = err
    return time.process_time() - t0, value


@pytest.mark.parametrize("text", [
    QUOTES * (128 * 1024),  # 256 KiB of escaped quotes: the quadratic scan never finished on them
    '"' + QUOTES * (128 * 1024),  # the same in one unterminated string
    '{"a": "' + QUOTES * (128 * 1024 - 4) + '"}',  # and in a terminated one: valid, read
    '"\\' * (256 * 1024), '"' * (1 << 20), "[" * (1 << 20), '["' * (1 << 19), "\\" * (1 << 20),
], ids=["escaped-quotes", "unterminated", "terminated", "quote-backslash", "quotes", "brackets", "bracket-quote",
        "backslashes"])
def test_every_shape_of_a_json_file_is_read_or_refused_in_linear_time(tmp_path, text):
    path = tmp_path / "summary.json"
    path.write_text(text)
    seconds, value = timed_read(path, nonfinite=True)
    assert seconds < 1.0, f"{seconds:.2f}s"
    if text.startswith('{"a"'):
        assert value == {"a": '"' * (128 * 1024 - 4)}
    else:
        assert isinstance(value, JSONError) and str(path) in str(value)


def test_the_onnx_runtimes_own_reader_is_bounded_too():
    """agents/onnx_policy.py stands alone (numpy and onnxruntime only) with json.loads, linear in its input."""
    from agents.onnx_policy import parse_metadata

    for text in ('"' + QUOTES * (128 * 1024), "[" * (1 << 20)):
        t0 = time.process_time()
        with pytest.raises(ValueError, match="policy.onnx: its policy metadata .* is not valid JSON"):
            parse_metadata(text, "policy.onnx")
        assert time.process_time() - t0 < 1.0


def test_no_module_of_the_package_reads_json_but_the_bounded_reader():
    """Every JSON the package did not just write goes through primal_dt.run.json_reader (the ONNX runtime, which
    must stand alone, is the one exception): a json.load/json.loads anywhere else is a reader with no bound."""
    import ast

    readers = []
    for top in ("primal_dt", "agents", "envs", "eval", "configs"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Attribute) and node.attr in ("load", "loads")
                        and isinstance(node.value, ast.Name) and node.value.id == "json"):
                    readers.append(str(path.relative_to(ROOT)))
    assert sorted(set(readers)) == ["agents/onnx_policy.py", "primal_dt/run/json_reader.py"], readers


def test_a_minari_metadata_of_escaped_quotes_ends_training_at_once(refused, entries, tmp_path):
    """128 KiB of them hung training for 100 s."""
    data = tmp_path / "minari" / "mujoco" / "hopper" / "medium-v0" / "data"
    data.mkdir(parents=True)
    (data / "metadata.json").write_text('{"env_spec": "' + QUOTES * (64 * 1024))
    with Outside(tmp_path, tmp_path / "out"):
        ended = entries.run("primal_dt.train", *TINY, "env=mujoco/hopper/medium-v0", f"out={tmp_path / 'out'}",
                            env={"MINARI_DATASETS_PATH": str(tmp_path / "minari")})
    refused(ended, "Minari dataset mujoco/hopper/medium-v0", "cannot be opened")
    assert not (tmp_path / "out").exists()


def test_a_d4rl_provenance_of_escaped_quotes_is_refused_at_once(refused, entries, tmp_path, hopper_file):
    data = tmp_path / "hopper.hdf5"
    data.write_bytes(hopper_file.read_bytes())
    with h5py.File(data, "a") as f:
        f.attrs["primal_dt_provenance"] = '{"env": "' + QUOTES * (128 * 1024)
    with Outside(tmp_path, tmp_path / "out"):
        ended = entries.run("primal_dt.train", *TINY, f"data_source=d4rl:{data}", f"out={tmp_path / 'out'}")
    refused(ended, f"{data} attribute primal_dt_provenance is not valid JSON", "regenerate it")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["meta.json", "evals.json"])
def test_a_collectors_work_file_of_escaped_quotes_is_refused_at_once(refused, entries, tmp_path, name):
    work = tmp_path / "work"
    work.mkdir()
    (work / name).write_text('"' + QUOTES * (128 * 1024))
    with Outside(tmp_path):
        ended = entries.run("envs.collect", f"workdir={work}", "train=false", f"out={tmp_path / 'o.hdf5'}")
    refused(ended, f"{work / name} is not valid JSON")


def test_a_runs_json_of_escaped_quotes_is_refused_at_once(refused, entries, tmp_path):
    runs = tmp_path / "old" / "runs.json"
    runs.parent.mkdir()
    runs.write_text('{"format": "' + QUOTES * (128 * 1024))
    with Outside(tmp_path):
        ended = entries.run("eval.report", runs, f"out={tmp_path / 'report'}")
    refused(ended, f"{runs} is not valid JSON")


def test_a_summary_of_escaped_quotes_leaves_its_run_out_of_the_report_at_once(refused, entries, tmp_path, tiny_dt,
                                                                               dt_checkpoint_file):
    run = tmp_path / "runs" / "hopper-medium" / "primal+dt" / "20260101-000000-seed0"
    dt_checkpoint_file(run, tiny_dt("primal+dt", K=5))
    (run / "summary.json").write_text('{"steps": "' + QUOTES * (128 * 1024))
    (run / "rollout-stream.json").write_text('{"targets": "' + QUOTES * (128 * 1024))
    with Outside(tmp_path):
        ended = entries.run("eval.report", tmp_path / "runs", f"out={tmp_path / 'report'}")
    refused(ended, "none of the 1 finished run(s) could be reported")
    assert f"{run / 'summary.json'} is not valid JSON" in ended.stdout + ended.stderr


# -- 2. a sweep writes only inside its out -------------------------------------------------------------------------
def sweep(entries, hopper_file, out, *args, timeout: int = 120) -> Ended:
    return entries.run("eval.sweep", *TINY, f"data_source=d4rl:{hopper_file}", f"out={out}", "model=dt", "seeds=0",
                       "steps=4", *args, timeout=timeout)


def victim_run(tmp_path) -> Path:
    """A run directory outside the sweep's out, which a link in out must not let it touch."""
    victim = tmp_path / "elsewhere" / "20200101-000000-seed0"
    victim.mkdir(parents=True)
    (victim / "last.pt").write_bytes(b"someone else's run")
    (victim / "victim.log").write_text("precious\n")
    return victim


@pytest.mark.parametrize("planted", ["sweep-logs/hopper-medium-dt-seed0.log", "sweep-logs",
                                     "hopper-medium/dt/20200101-000000-seed0", "hopper-medium/dt", "hopper-medium",
                                     "report"])
def test_a_link_planted_in_a_sweeps_out_is_refused_before_any_run(refused, entries, tmp_path, hopper_file, planted):
    out = tmp_path / "sweep"
    victim = victim_run(tmp_path)
    link = out / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim / "victim.log" if planted.endswith(".log") else victim)
    with Outside(tmp_path, out):
        ended = sweep(entries, hopper_file, out)
    refused(ended, f"{link} is a symbolic link (to {victim}", "a sweep writes only inside", f"remove {link}")
    assert not [d for d in out.rglob("*-seed0") if not d.is_symlink()] and "[sweep] start" not in ended.stdout


def test_a_hard_linked_log_in_a_sweeps_out_is_refused(refused, entries, tmp_path, hopper_file):
    out = tmp_path / "sweep"
    victim = victim_run(tmp_path) / "victim.log"
    (out / "sweep-logs").mkdir(parents=True)
    os.link(victim, out / "sweep-logs" / "hopper-medium-dt-seed0.log")
    with Outside(tmp_path, out):
        ended = sweep(entries, hopper_file, out)
    refused(ended, "hopper-medium-dt-seed0.log is a file with 2 names (a hard link)")
    assert victim.read_text() == "precious\n"


@pytest.mark.slow  # a real training run and report
def test_a_sweep_still_writes_through_its_own_out_given_as_a_link(entries, tmp_path, hopper_file):
    """Only links inside out are refused: out= itself may be a link the user made."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "out").symlink_to(real)
    ended = sweep(entries, hopper_file, tmp_path / "out", "steps=2", timeout=900)
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert list(real.glob("hopper-medium/dt/*-seed0/last.pt")) and list(real.glob("sweep-logs/*.log"))
    assert (real / "report" / "scores.md").exists()


# -- 3. two rollouts given one out= --------------------------------------------------------------------------------
@pytest.fixture
def run_dir(tmp_path, tiny_dt, dt_checkpoint_file):
    d = tmp_path / "run"
    dt_checkpoint_file(d, tiny_dt("primal+dt", K=5))
    return d


ROLLOUT = ["episodes=1", "num_envs=1", "max_steps=5", "targets=3600", "engine=stream", "progress=false",
           "threads=1"]


def held_while(entries, first: list, second: list, report: Path) -> tuple[Ended, Ended]:
    """``second`` started while ``first`` (an endless rollout) holds ``report``, once its progress line counts a
    finished episode (an interrupt while it still imports the simulator is not this test's); then ``first``
    interrupted. Its output is a file, so the progress is a plain line, printed at the first episode's end."""
    started = entries.start("eval.rollout", *[a for a in first if a != "progress=false"], "progress=true")
    bar, deadline = Path(f"{started[1]}.out"), time.time() + 300
    while not re.search(r": [1-9][\d,]*/[\d,]+ episodes", bar.read_text() if bar.exists() else "") \
            and time.time() < deadline:
        time.sleep(0.1)
    assert report.exists(), bar.read_text()
    try:
        late = entries.run("eval.rollout", *second)
    finally:
        os.kill(started[0], signal.SIGINT)
    return entries.wait(started), late


def test_a_second_rollout_to_the_out_another_is_writing_is_refused(refused, entries, tmp_path, run_dir):
    report = tmp_path / "rollout.json"
    common = [f"checkpoint={run_dir}", f"out={report}", *ROLLOUT]
    with Outside(tmp_path, report):
        first, second = held_while(entries, [*common, "episodes=1000000"], common, report)
    refused(second, f"out={report} is being written by another process now")
    assert first.returncode == 130 and "interrupted: no report written" in first.stdout
    assert not report.exists()  # the claim of the interrupted rollout is not left behind, empty
    done = entries.run("eval.rollout", *common)
    assert done.returncode == 0 and json.loads(report.read_text())["episodes_per_target"] == 1
    refused(entries.run("eval.rollout", *common), f"out={report} exists", "overwrite=true")


def test_a_second_overwriting_rollout_is_refused_and_the_earlier_report_kept(refused, entries, tmp_path, run_dir):
    report = tmp_path / "rollout.json"
    report.write_text('{"an": "earlier report"}')
    common = [f"checkpoint={run_dir}", f"out={report}", "overwrite=true", *ROLLOUT]
    with Outside(tmp_path):
        first, second = held_while(entries, [*common, "episodes=1000000"], common, report)
    refused(second, f"out={report} is being written by another process now", "wait for it to end")
    assert first.returncode == 130 and report.read_text() == '{"an": "earlier report"}'


def test_a_rollout_report_planted_as_a_link_is_refused(refused, entries, tmp_path, run_dir):
    victim = tmp_path / "victim.json"
    victim.write_text("precious")
    (tmp_path / "rollout.json").symlink_to(victim)
    with Outside(tmp_path):
        ended = entries.run("eval.rollout", f"checkpoint={run_dir}", f"out={tmp_path / 'rollout.json'}",
                            "overwrite=true", *ROLLOUT)
    refused(ended, "is a symbolic link (to", "a rollout report is written only to a plain file")


# -- 4. a path the file system cannot take is one line naming its option -------------------------------------------
def long_name_cases():
    """(module, args, environment) with one over-long name; {L}: a folder whose child has that name."""
    L = "{tmp}/" + LONG
    return [
        ("primal_dt.train", ["preset=smoke", f"out={L}"], {}, "out="),
        ("primal_dt.train", [f"resume={L}"], {}, "resume="),
        ("primal_dt.train", [f"preset={LONG}"], {}, "preset="),  # a name: presets are never paths
        ("primal_dt.train", ["preset=smoke", f"data_source=d4rl:{L}"], {}, "data_source="),
        ("primal_dt.train", ["preset=smoke", "env=mujoco/hopper/medium-v0", "out={tmp}/o"],
         {"MINARI_DATASETS_PATH": L}, "MINARI_DATASETS_PATH="),
        ("primal_dt.classify", ["task=uea/JapaneseVowels-fast", f"out={L}"], {}, "out="),
        ("primal_dt.classify", [f"resume={L}"], {}, "resume="),
        ("primal_dt.classify", ["task=lra/text-fast", f"data.path={L}"], {}, "data.path="),
        ("eval.rollout", [f"checkpoint={L}"], {}, "checkpoint="),
        ("eval.rollout", ["checkpoint={tmp}/x.pt", f"out={L}/r.json"], {}, "out="),
        ("eval.bench.inference", [f"checkpoint={L}"], {}, "checkpoint="),
        ("eval.bench.inference", [f"json={L}"], {}, "json="),
        ("eval.bench.inference", [f"markdown={L}"], {}, "markdown="),
        ("eval.bench.train", ["--json", L], {}, "--json "),
        ("eval.bench.train", ["--markdown", L], {}, "--markdown "),
        ("agents.export", [f"checkpoint={L}"], {}, "checkpoint="),
        ("eval.sweep", [f"out={L}"], {}, "out="),
        ("eval.sweep", [f"report={L}"], {}, "report="),
        ("eval.report", [L], {}, "the argument "),
        ("envs.collect", [f"out={L}"], {}, "out="),
        ("envs.collect", [f"workdir={L}"], {}, "workdir="),
    ]


@pytest.mark.parametrize("module,args,env,option", long_name_cases(),
                         ids=[f"{c[0]}:{c[3].strip()}" for c in long_name_cases()])
def test_a_name_longer_than_the_file_system_allows_is_one_line_naming_its_option(refused, entries, tmp_path, module,
                                                                                 args, env, option):
    fill = lambda s: s.replace("{tmp}", str(tmp_path))  # noqa: E731
    with Outside(tmp_path):
        ended = entries.run(module, *map(fill, args), env={k: fill(v) for k, v in env.items()})
    line = refused(ended, f"error: {option}", "a name in it is longer than the file system allows",
                   "give a shorter path")
    assert LONG not in line  # elided: the line stays readable


def test_a_loop_of_links_is_one_line_naming_its_option(refused, entries, tmp_path, hopper_file):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with Outside(tmp_path):
        ended = sweep(entries, hopper_file, f"{loop}/runs")
    refused(ended, "error: out=", f"{loop.name}/runs: it loops through symbolic links", "fix or remove the link")


def test_the_line_names_the_option_whatever_opened_the_path():
    """errors.path_mistake, which errors.main applies to every entry point's OSError: the option, the argument or
    the environment variable whose path has the long name; any other OSError is not its to explain."""
    from primal_dt.run.errors import WriteError, path_mistake

    long = f"/x/{LONG}"
    err = OSError(errno.ENAMETOOLONG, "File name too long", f"{long}/hopper-medium/dt")
    assert path_mistake(err, ["env=hopper-medium", f"out={long}"]).startswith("out=/x/nnn")
    assert path_mistake(err, ["--json", long]).startswith("--json /x/nnn")
    assert path_mistake(err, [long]).startswith("the argument /x/nnn")
    assert path_mistake(err, [], {"MINARI_DATASETS_PATH": long}).startswith("MINARI_DATASETS_PATH=/x/nnn")
    assert path_mistake(err, [], {}).startswith("the path /x/nnn")
    wrapped = WriteError("could not write the run directory")
    wrapped.__cause__ = err
    again = WriteError("could not write the run directory; nothing was written")
    again.__cause__ = wrapped
    assert path_mistake(again, [f"out={long}"]).startswith("out=")
    assert path_mistake(OSError(errno.ENOSPC, "No space left on device", long), [f"out={long}"]) is None
    assert path_mistake(ValueError("x"), []) is None
