"""run/paths.inside: the one gate for a path a config value names inside a run directory."""

from __future__ import annotations

import os

import pytest

from reprotrain.run.paths import PathOutsideRun, inside


def test_a_relative_path_inside_the_run_is_returned_under_it(tmp_path):
    assert inside(tmp_path, "metrics.csv", "logger.csv.filename") == tmp_path / "metrics.csv"
    assert inside(tmp_path, "logs/a.csv", "k") == tmp_path / "logs" / "a.csv"
    assert inside(tmp_path, "./a", "k") == tmp_path / "a"


@pytest.mark.parametrize(
    ("value", "why"),
    [("/etc/passwd", "absolute"), ("../x.csv", "'..'"), ("a/../../x", "'..'"), ("", "empty"),
     ("~/x", "absolute"), ("a\x00b", "NUL")],
)  # fmt: skip
def test_absolute_dotdot_empty_and_home_are_refused_in_one_line_naming_the_key(
    tmp_path, value, why
):
    with pytest.raises(PathOutsideRun) as e:
        inside(tmp_path, value, "logger.csv.filename")
    message = str(e.value)
    assert message.startswith("logger.csv.filename=") and why in message
    assert "\n" not in message and "\x00" not in message


def test_a_symlink_that_leads_out_is_refused_and_one_that_stays_in_is_not(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    os.symlink(outside, run / "out")
    os.symlink(run / "sub", run / "in")
    (run / "sub").mkdir()
    with pytest.raises(PathOutsideRun, match="symlink"):
        inside(run, "out/x.csv", "k")
    os.symlink(outside / "f", run / "file-link")
    with pytest.raises(PathOutsideRun, match="symlink"):
        inside(run, "file-link", "k")
    assert inside(run, "in/x.csv", "k") == run / "in" / "x.csv"
