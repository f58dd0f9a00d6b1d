"""`make new-project`: a fresh repository with the package renamed, that trains."""

import subprocess
import sys

from conftest import REPO, assert_ok, base_env


def test_new_project_is_a_renamed_repository_that_trains(tmp_path):
    dest = tmp_path / "mylab"
    proc = subprocess.run(
        ["make", "--no-print-directory", "new-project", "NAME=mylab", f"DEST={dest}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert_ok(proc)
    assert (dest / "src" / "mylab" / "train.py").is_file() and not (
        dest / "src" / "reprotrain"
    ).exists()
    log = subprocess.run(
        ["git", "-C", str(dest), "log", "--oneline"], capture_output=True, text=True
    )
    assert len(log.stdout.splitlines()) == 1
    status = subprocess.run(
        ["git", "-C", str(dest), "status", "--porcelain"], capture_output=True, text=True
    )
    assert status.stdout == ""
    left = subprocess.run(
        ["grep", "-rIil", "reprotrain", ".", "--exclude-dir=.git"],
        cwd=dest,
        capture_output=True,
        text=True,
    )
    assert sorted(left.stdout.split()) == ["./LICENSE", "./README.md"]
    assert not (dest / "outputs").exists() and not (dest / ".venv").exists()

    env = base_env(PYTHONPATH=str(dest / "src"))
    run = subprocess.run(
        [sys.executable, "-m", "mylab.train", "experiment=smoke", "trainer.epochs=1",
         "dataset.num_train=576", "dataset.num_test=256", "trainer.batch_size=64",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=dest, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert_ok(run)
    assert '"status": "completed"' in (tmp_path / "run" / "run.json").read_text()
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_config.py", "-k", "sha256 or defaults"],
        cwd=dest, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert_ok(tests)


def test_new_project_refuses_an_existing_destination(tmp_path):
    proc = subprocess.run(
        ["make", "--no-print-directory", "new-project", "NAME=mylab", f"DEST={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and "already exists" in proc.stderr
    assert list(tmp_path.iterdir()) == []
