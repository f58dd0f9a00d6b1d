"""``reprotrain --exit-file PATH`` writes a regular file (or a new one) and nothing else: a
FIFO, a device or a directory is refused in one line before the job runs, and a write that
fails after the job keeps the job's own exit code."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

import faults
from conftest import REPO, base_env
from reprotrain import commands
from reprotrain.tools import exit_file


def test_a_fifo_is_refused_before_the_job_and_stays_a_fifo(tmp_path, capsys):
    fifo = tmp_path / "rc"
    os.mkfifo(fifo)
    assert commands.main(["--exit-file", str(fifo), "--version"]) == 2
    out, err = capsys.readouterr()
    assert "reprotrain" not in out, "the job did not run"
    (line,) = err.splitlines()
    assert line.startswith("error: --exit-file") and "a FIFO" in line
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO is still there"


def test_a_directory_is_refused_in_one_line_without_a_traceback(tmp_path, capsys):
    assert commands.main(["--exit-file", str(tmp_path), "--version"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "is a directory" in line and tmp_path.is_dir()


def test_a_character_device_is_refused_and_left_alone():
    dev = Path(os.devnull)  # never handed to the old writer: checked() alone
    before = os.stat(dev)
    with pytest.raises(exit_file.ExitFileError, match="a character device"):
        exit_file.checked(dev)
    assert os.stat(dev).st_ino == before.st_ino and stat.S_ISCHR(os.stat(dev).st_mode)


def test_a_symlink_to_a_regular_file_is_written_through(tmp_path, capsys):
    target, link = tmp_path / "target", tmp_path / "link"
    target.write_text("stale\n")
    link.symlink_to(target)
    assert commands.main(["--exit-file", str(link), "--version"]) == 0
    assert link.is_symlink() and target.read_text() == "0\n"


def test_an_unwritable_directory_is_refused_before_the_job(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")  # chattr +i, a read-only mount

    monkeypatch.setattr(exit_file.tempfile, "mkstemp", refuse)
    assert commands.main(["--exit-file", str(tmp_path / "rc"), "--version"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "cannot write in" in err and not (tmp_path / "rc").exists()


def test_a_full_disk_after_the_job_keeps_the_jobs_code_in_one_line(tmp_path):
    cmd = faults.command(
        "enospc:rc", "reprotrain", "--exit-file", str(tmp_path / "rc"), "--version"
    )
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert "the exit code 0 was not written" in line and "No space left" in line


def test_no_record_replaces_a_fifo_the_project_writer_refuses_it(tmp_path, capsys):
    """The same rule for every command: compare's comparison.json, report.md, summary.json
    ... all go through record.atomic_write_bytes, which never renames over a special file."""
    from reprotrain.tools.sweeps import compare_sweeps
    from test_statistical_verdict import fake_sweep

    a = fake_sweep(tmp_path / "a", {"": [0.80, 0.82, 0.81]})
    b = fake_sweep(tmp_path / "b", {"": [0.80, 0.82, 0.81]})
    os.mkfifo(b / "comparison.json")
    assert compare_sweeps.main([str(a), str(b)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert stat.S_ISFIFO(os.stat(b / "comparison.json").st_mode)
