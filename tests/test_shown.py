"""A string from an archive or a record never reaches the terminal raw: a spoofing
``experiment_id`` (newlines, a fake trust line, a fake verdict, ESC[8m) prints as one
escaped value in reproduce; a spoofing override label prints escaped in compare and summary."""

from __future__ import annotations

import json
import shutil

import pytest

from reprotrain.tools.sweeps import compare_sweeps, sweep_summary
from test_statistical_verdict import fake_sweep
from test_trust import archived, job_config, repack, repo, reproduce, unpack  # noqa: F401

SPOOF = (
    "exp\ntrust    (a) source/ is commit 1234, signed by admin@corp\n"
    "REPRODUCED (bitwise): epoch(s) 1-1 + final weights match the archived run\x1b[8m"
)


def assert_no_raw_control(text: str) -> None:
    assert "\x1b" not in text and "\u202e" not in text, repr(text[:300])


def test_shown_makes_every_control_character_visible_and_cuts_long_values():
    from reprotrain.tools import shown as shown_mod
    from reprotrain.tools.shown import safe_line, shown

    assert shown("a\nb\x1b[8mc\u202ed\\") == "a\\nb\\x1b[8mc\\u202ed\\\\"
    assert shown("plain text, ±0.5 pts") == "plain text, ±0.5 pts"
    cut = shown("x" * 500, limit=10)
    assert cut.startswith("x" * 10) and "+490 chars" in cut
    assert safe_line("verdict\n\x07") == "verdict\\n\\x07"
    assert len(safe_line("y" * 10_000)) < shown_mod.LINE_LIMIT + 40


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_spoofing_experiment_id_prints_escaped_in_reproduce(archived, tmp_path, repo, capsys):  # noqa: F811
    top = unpack(archived, tmp_path / "unpacked")
    record = json.loads((top / "run" / "run.json").read_text())
    record["experiment_id"] = SPOOF
    (top / "run" / "run.json").write_text(json.dumps(record))
    spoofed = repack(top, tmp_path / "spoofed.tar.gz")
    reproduce(spoofed, tmp_path, repo)
    out, err = capsys.readouterr()
    assert_no_raw_control(out + err)
    lines = out.splitlines()
    assert not any(
        x.startswith(("REPRODUCED", "trust    (a) source/ is commit 1234")) for x in lines
    )
    (run_line,) = [x for x in lines if x.startswith("run      ")]
    assert "exp\\ntrust    (a)" in run_line and "\\x1b[8m" in run_line


def test_a_spoofing_group_label_prints_escaped_in_compare_and_summary(tmp_path, capsys):
    evil = "optimizer.lr='0.1\nCONSISTENT: all good\x1b[8m'"
    a = fake_sweep(tmp_path / "a", {"": [0.80, 0.82, 0.81], evil: [0.5, 0.52, 0.51]})
    b = fake_sweep(tmp_path / "b", {"": [0.80, 0.82, 0.81], evil: [0.5, 0.52, 0.51]})
    compare_sweeps.main([str(a), str(b)])
    assert sweep_summary.main([str(a)]) == 0
    out, err = capsys.readouterr()
    assert_no_raw_control(out + err)
    assert not any(x.startswith("CONSISTENT: all good") for x in out.splitlines())
    assert "\\x1b[8m" in out
