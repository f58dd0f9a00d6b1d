# ruff: noqa: F811  (the fixtures imported from test_trust are parameters here)
"""No debris: a stopped or failing ``make archive`` / ``make reproduce`` leaves nothing behind.

SIGTERM (or Ctrl-C) at an exact point of ``make archive`` (the tree staged; the tar half
written) and of ``make reproduce`` (during the trust check, after a ``--verify-only``
extraction, during a sweep's re-run), each in a process of its own with ``TMPDIR`` pointed
at an empty folder; and a full disk during ``make archive``, whose one line names the path.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import base_env
from reprotrain.errors import ArchiveError
from reprotrain.tools.archive import archive as arch
from reprotrain.tools.archive import sweep_archive
from test_replay_plan import trainer_repo  # noqa: F401
from test_trust import fake_run, job_config, one_error_line, repo  # noqa: F401

#: Runs a tool with one function wrapped to signal this process right after it returns
#: (or, for _normalise, right before: mid-tar). argv: signal, module, function, tool args.
STOPPER = """\
import importlib, os, signal, sys
sig, module, name, *args = sys.argv[1:]
mod = importlib.import_module(module)
real = getattr(mod, name)
def stopping(*a, **k):
    if name == "_normalise":
        os.kill(os.getpid(), getattr(signal, sig))
    out = real(*a, **k)
    os.kill(os.getpid(), getattr(signal, sig))
    return out
setattr(mod, name, stopping)
from reprotrain.tools.archive import pack
pack.pip_freeze = lambda: ""
tool = importlib.import_module(f"reprotrain.tools.{args.pop(0)}")
sys.exit(tool.main(args))
"""


def stopped(tmp_path: Path, sig: str, where: str, *tool_args: str, **env: str):
    """Run the tool with a stop signal at ``where`` (``module:function``); TMPDIR is
    ``tmp_path/tmp``, empty before."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    script = tmp_path / "stopper.py"
    script.write_text(STOPPER)
    module, name = where.split(":")
    return subprocess.run(
        [sys.executable, str(script), sig, module, name, *tool_args],
        env=base_env(TMPDIR=str(tmp_path / "tmp"), **env),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def leftovers(*dirs: Path) -> list[str]:
    return [str(p) for d in dirs if d.exists() for p in d.iterdir()]


@pytest.mark.parametrize(
    ("sig", "where"),
    [
        ("SIGTERM", "reprotrain.tools.archive.snapshot:build"),  # the tree staged
        ("SIGTERM", "reprotrain.tools.archive.pack:_normalise"),  # the tar half written
        ("SIGINT", "reprotrain.tools.archive.pack:_normalise"),
        ("SIGHUP", "reprotrain.tools.archive.snapshot:build"),
    ],
)
def test_a_stopped_archive_leaves_no_staging_dir_or_temp_tar(tmp_path, repo, job_config, sig,
                                                              where):  # fmt: skip
    """Was: SIGTERM left `.archive-*` and `*.tar.gz.tmp` in the output dir."""
    run = fake_run(tmp_path, repo, job_config)
    out = tmp_path / "archives"
    out.mkdir()
    proc = stopped(tmp_path, sig, where, "archive.archive", str(run), "--out-dir", str(out),
                   "--repo", str(repo))  # fmt: skip
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert f"interrupted by {sig}: no archive written" in one_error_line(proc.stderr)
    assert leftovers(out, tmp_path / "tmp") == []


@pytest.mark.parametrize("where", ["reprotrain.tools.archive.snapshot:build",
                                   "reprotrain.tools.archive.pack:_normalise"])  # fmt: skip
def test_a_sigkilled_archive_leaves_nothing_behind(tmp_path, repo, job_config, where):
    """Was: SIGKILL (no ``finally`` runs) left the `.archive-*` staging dir until the next
    archive into that directory. The archiver's reaper, a process of its own session,
    removes it and the temp tar once the archiver is gone."""
    import time

    run = fake_run(tmp_path, repo, job_config)
    out = tmp_path / "archives"
    out.mkdir()
    proc = stopped(tmp_path, "SIGKILL", where, "archive.archive", str(run), "--out-dir",
                   str(out), "--repo", str(repo))  # fmt: skip
    assert proc.returncode == -9, proc.stderr[-2000:]
    deadline = time.monotonic() + 30
    while leftovers(out) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(out, tmp_path / "tmp") == []


@pytest.mark.parametrize("failing", ["tarfile.TarFile.addfile", "shutil.copy2"])
def test_a_full_disk_during_archive_names_the_path(tmp_path, repo, job_config, capsys,
                                                   monkeypatch, failing):  # fmt: skip
    """Was: `error: [Errno 28] No space left on device`, no path."""

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    owner = tarfile.TarFile if failing.startswith("tarfile") else shutil
    monkeypatch.setattr(owner, failing.rsplit(".", 1)[1], full)
    run = fake_run(tmp_path, repo, job_config)
    out = tmp_path / "archives"
    rc = arch.main([str(run), "--out-dir", str(out), "--repo", str(repo)])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "No space left on device" in line
    assert f"writing {out}/trusttest-run.tar.gz failed at {out}/." in line, line
    assert "free space in" in line
    assert leftovers(out) == []


def test_a_refused_sweep_archive_leaves_no_folder_it_made(tmp_path, repo, job_config, monkeypatch):
    """Was: a sweep archive refused mid-way (here a full disk) kept the --out-dir folders it
    had made; the single-run archiver removed them. Both now pack through ``pack.pack``."""
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for i in range(2):
        fake_run(tmp_path, repo, job_config).rename(sweep / str(i))

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copy2", full)
    with pytest.raises(ArchiveError, match="No space left on device"):
        sweep_archive.build(sweep, tmp_path / "new" / "archives", repo)
    assert not (tmp_path / "new").exists()


@pytest.fixture
def run_archive(tmp_path, repo, job_config, monkeypatch) -> Path:
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    path, _ = arch.build(fake_run(tmp_path, repo, job_config), tmp_path / "out", repo=repo)
    return path


def test_a_reproduce_stopped_during_the_trust_check_removes_its_temp_dirs(
    tmp_path, repo, run_archive
):
    """Was: SIGTERM before the re-run killed reproduce with its trust snapshot left in TMPDIR."""
    runs = tmp_path / "runs"
    proc = stopped(tmp_path, "SIGTERM", "reprotrain.tools.archive.snapshot:from_git",
                   "reproduce.reproduce", str(run_archive), "--repo", str(repo),
                   "--runs-dir", str(runs))  # fmt: skip
    assert proc.returncode == 75, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "INTERRUPTED by SIGTERM before the re-run" in proc.stdout
    assert leftovers(tmp_path / "tmp") == [] and not runs.exists()


def test_a_verify_only_stopped_after_extracting_removes_the_extraction(tmp_path, run_archive):
    proc = stopped(tmp_path, "SIGTERM", "reprotrain.tools.archive.archive_check:extract",
                   "reproduce.reproduce", str(run_archive), "--verify-only")  # fmt: skip
    assert proc.returncode == 75, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert leftovers(tmp_path / "tmp") == []


def test_a_sweep_reproduce_stopped_mid_rerun_stops_and_removes_its_extraction(
    tmp_path, trainer_repo, job_config, monkeypatch
):
    """Was: a sweep replay had no signal handling: SIGTERM killed it, extraction left."""
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for i in range(2):
        fake_run(tmp_path, trainer_repo, job_config).rename(sweep / str(i))
    path, _ = sweep_archive.build(sweep, tmp_path / "out", trainer_repo)
    (tmp_path / "tmp").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.reproduce.reproduce", str(path), "--repo",
         str(trainer_repo), "--allow-data-drift", "--runs-dir", str(tmp_path / "runs")],
        env=base_env(TMPDIR=str(tmp_path / "tmp"), STAND_IN_STOP_PARENT="1"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 75, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "INTERRUPTED by SIGTERM" in proc.stdout
    assert leftovers(tmp_path / "tmp") == []


#: Runs ``archive`` with a SIGKILL at the write of a file whose name ends with argv[1]
#: (``reprotrain.events``' ``file-write``); argv[2] == "1" kills the archiver's reaper first,
#: as a kill of the whole job (a cgroup, a container) would.
KILLER = """\
import os, signal, sys
from pathlib import Path
from reprotrain import events
from reprotrain.tools.archive import archive, pack
pack.pip_freeze = lambda: ""
ending, reaper_too, *args = sys.argv[1:]
def children():
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                yield int(stat.parent.name)
        except (OSError, ValueError):
            pass
def kill(path, **_):
    if path.name.endswith(ending):
        if reaper_too == "1":
            for pid in children():
                os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
events.on("file-write", kill)
sys.exit(archive.main(args))
"""


@pytest.mark.parametrize(
    ("moment", "reaper"),
    [("pip-freeze.txt", "killed too"), ("archive.json", "killed too"),
     (".tar.gz.tmp", "killed too"), (".tar.gz.tmp", "alive")],
)  # fmt: skip
def test_a_sigkill_at_any_moment_of_archive_leaves_nothing_the_next_archive_does_not_clean(
    tmp_path, repo, job_config, monkeypatch, moment, reaper
):
    """SIGKILL with the records half staged, staged whole, and the tar half written. The
    archiver's reaper removes its staging dir and temp tar; if the reaper died with it, the
    next archive into that folder removes them, and its own archive is complete."""
    import time

    run = fake_run(tmp_path, repo, job_config)
    out = tmp_path / "archives"
    out.mkdir()
    (tmp_path / "tmp").mkdir()
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    proc = subprocess.run(
        [sys.executable, str(script), moment, "1" if reaper == "killed too" else "0",
         str(run), "--out-dir", str(out), "--repo", str(repo)],
        env=base_env(TMPDIR=str(tmp_path / "tmp")), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert leftovers(tmp_path / "tmp") == []
    if reaper == "alive":
        deadline = time.monotonic() + 30
        while leftovers(out) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leftovers(out) == []
        return
    staged = [Path(p).name for p in leftovers(out)]
    assert staged and all(n.startswith(".archive-") for n in staged), staged
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    path, _ = arch.build(run, out, repo=repo)
    assert leftovers(out) == [str(path)]
    with tarfile.open(path) as tar:
        assert any(m.name.endswith("/MANIFEST.sha256") for m in tar.getmembers())
