"""A run directory is written once: a fresh run into one that holds a run is refused in one
line, with the old run intact byte for byte (``.hydra/`` included); a sweep into a used
sweep directory is refused the same way. One real run is reused (copied), nothing here
trains except the ``resume=auto``-in-an-empty-dir control."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MICRO, REPO, assert_ok, base_env, run_json, train
from reprotrain.run import directory as run_dirs


def contents(root: Path) -> dict[str, str]:
    """{relative path: sha256 of the bytes} of every file, plus every directory."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def one_error(proc: subprocess.CompletedProcess) -> str:
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


@pytest.fixture
def old_run(reference_run, tmp_path) -> Path:
    run = tmp_path / "old run"
    shutil.copytree(reference_run, run)
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "checkpoints").is_dir()
    return run


def test_a_fresh_run_into_a_used_run_dir_is_refused_and_the_old_run_is_intact(old_run):
    before = contents(old_run)
    proc = train(old_run, "seed.base=7")
    line = one_error(proc)
    assert "already holds a run (run.json, status completed)" in line
    assert "make resume 'RUN=" in line and "resume=<its checkpoint>" in line
    assert contents(old_run) == before, "not one byte of the old run changed, .hydra/ included"
    # Forking another checkpoint into it is refused the same way.
    other = sorted((old_run / "checkpoints").glob("step-*.pt"))[0]
    fork = old_run.parent / "other.pt"
    shutil.copy(other, fork)
    line = one_error(train(old_run, f"resume={fork}"))
    assert "a fork from resume=" in line and "new directory" in line
    assert contents(old_run) == before


def test_the_trainer_refuses_too_when_the_command_line_check_is_bypassed(old_run):
    """A launcher that calls main() directly (no preflight): rank 0 refuses before any
    record is written. Hydra itself has rewritten .hydra/ by then; the record is intact."""
    before = {k: v for k, v in contents(old_run).items() if not k.startswith(".hydra")}
    before.pop("train.log", None)
    code = (
        "import sys; from reprotrain import preflight, train; preflight.register_resolvers(); "
        "from reprotrain.config import register_configs; register_configs(); "
        f"sys.argv = ['train', *{MICRO!r}, 'seed.base=7', 'hydra.run.dir={old_run}']; "
        "train.main()"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: " in proc.stderr and "already holds a run" in proc.stderr
    after = {k: v for k, v in contents(old_run).items() if not k.startswith(".hydra")}
    after.pop("train.log", None)
    assert after == before
    assert run_json(old_run)["status"] == "completed"


def test_resume_auto_into_an_empty_dir_starts_fresh(tmp_path):
    run = tmp_path / "new"
    assert_ok(train(run, "resume=auto", "trainer.epochs=1", "trainer.limit_train_steps=2"))
    assert run_json(run)["status"] == "completed"


def test_which_resumes_may_use_a_dir_that_holds_a_run(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    run_dirs.refuse_reuse(run, None)  # no run.json yet (Hydra's .hydra/ does not count)
    (run / ".hydra").mkdir()
    run_dirs.refuse_reuse(run, None)
    (run / "run.json").write_text('{"status": "interrupted"}')
    run_dirs.refuse_reuse(run, "auto")  # requeue / make resume
    run_dirs.refuse_reuse(run, str(run / "checkpoints" / "step-00000003.pt"))  # its own
    with pytest.raises(run_dirs.RunDirUsed, match="status interrupted"):
        run_dirs.refuse_reuse(run, None)
    with pytest.raises(run_dirs.RunDirUsed, match="a fork from resume="):
        run_dirs.refuse_reuse(run, str(tmp_path / "elsewhere" / "step-00000003.pt"))


def test_a_sweep_dir_is_used_once_it_holds_a_sweep_or_a_run(tmp_path):
    sweep = tmp_path / "sweep"
    run_dirs.refuse_used_sweep_dir(sweep)  # absent
    sweep.mkdir()
    run_dirs.refuse_used_sweep_dir(sweep)  # empty
    (sweep / "multirun.yaml").write_text("x: 1\n")
    with pytest.raises(run_dirs.RunDirUsed, match=r"a multirun\.yaml"):
        run_dirs.refuse_used_sweep_dir(sweep)
    (sweep / "multirun.yaml").unlink()
    (sweep / "1").mkdir()
    (sweep / "1" / "run.json").write_text("{}")
    with pytest.raises(run_dirs.RunDirUsed, match=r"1 run\(s\)"):
        run_dirs.refuse_used_sweep_dir(sweep)


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                    reason="needs git and a git checkout of the project")  # fmt: skip
def test_runs_started_from_conf_or_any_subfolder_are_ignored_not_dirty_code():
    """Hydra's run dir is relative to the working directory: `cd conf && python -m
    reprotrain.train` writes conf/outputs/. It must not make the next run +dirty."""
    for rel in ("conf/outputs/default/2026-01-01/run.json", "conf/multirun/x/0/run.json",
                "outputs/a/run.json", "src/outputs/b/train.log"):  # fmt: skip
        proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", rel])
        assert proc.returncode == 0, f"{rel} is not ignored"
