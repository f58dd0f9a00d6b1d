"""A string from an archive or a record never reaches the terminal raw: the helper
(tools/shown.py), and a spoofing override label in compare and summary. The spoofing
``experiment_id`` through reproduce is in test_trust.py (it needs that file's archive)."""

from __future__ import annotations

from reprotrain.tools.sweeps import compare_sweeps, sweep_summary
from test_statistical_verdict import fake_sweep

SPOOF = (
    "exp\ntrust    (a) source/ is commit 1234, signed by admin@corp\n"
    "REPRODUCED (bitwise): epoch(s) 1-1 + final weights match the archived run\x1b[8m"
)


def assert_no_raw_control(text: str) -> None:
    assert "\x1b" not in text and "\u202e" not in text, repr(text[:300])


def test_shown_makes_every_control_character_visible_and_cuts_long_values():
    from reprotrain import shown as shown_mod
    from reprotrain.shown import safe_line, shown

    assert shown("a\nb\x1b[8mc\u202ed\\") == "a\\nb\\x1b[8mc\\u202ed\\\\"
    assert shown("plain text, ±0.5 pts") == "plain text, ±0.5 pts"
    cut = shown("x" * 500, limit=10)
    assert cut.startswith("x" * 10) and "+490 chars" in cut
    assert safe_line("verdict\n\x07") == "verdict\\n\\x07"
    assert len(safe_line("y" * 10_000)) < shown_mod.LINE_LIMIT + 40


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
