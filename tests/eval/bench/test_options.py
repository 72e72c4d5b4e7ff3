"""Every benchmark checks its options before it measures anything: an output file that cannot be written
(a directory, a missing folder), a thread count or timeout it cannot use, is one error line at once, not
a traceback or a hang after minutes of measuring."""

import pytest

BENCHES = ["eval.bench.train", "eval.bench.inference"]


def json_option(module):
    return "json" if module == "eval.bench.inference" else "--json"


@pytest.mark.parametrize("module", [BENCHES[0], *(pytest.param(m, marks=pytest.mark.slow) for m in BENCHES[1:])])
def test_an_output_file_that_cannot_be_written_is_refused_before_any_work(module, tmp_path, run_cli, one_line_error):
    opt = json_option(module)
    sep = "=" if not opt.startswith("--") else " "
    for bad, why in ((tmp_path, "is a directory"), (tmp_path / "missing" / "b.json", "does not exist")):
        args = [f"{opt}={bad}"] if sep == "=" else [opt, str(bad)]
        p = run_cli(module, *args, timeout=60)
        one_line_error(p, why)
    assert not (tmp_path / "missing").exists()
