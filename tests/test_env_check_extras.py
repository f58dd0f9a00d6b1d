"""Locked extras (``make install EXTRAS=mlflow,wandb``): hashed locks that ``make check-lock``
validates like the others, and that ``env_drift`` / ``make env-check`` count as locked when
installed, never as drift; without them nothing changes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reprotrain.repro import requirements_lock as lf
from reprotrain.tools.locks import check_lock

ROOT = Path(__file__).resolve().parents[1]
HASH = "--hash=sha256:" + "a" * 64


def write_lock(path: Path, pins: dict[str, str]) -> None:
    path.write_text("".join(f"{n}=={v} \\\n    {HASH}\n" for n, v in pins.items()))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_lock(tmp_path / "requirements.lock", {"torch": "2.0", "pyyaml": "6.0"})
    write_lock(tmp_path / "requirements-dev.lock", {"pytest": "8.0"})
    write_lock(
        tmp_path / "requirements-mlflow.lock",
        {"mlflow": "3.1", "sqlalchemy": "2.0", "pyyaml": "6.0"},
    )
    return tmp_path


def drift(root: Path, installed: dict[str, str], monkeypatch) -> dict:
    monkeypatch.setattr(lf, "installed_versions", lambda: dict(installed))
    return lf.env_drift(root)


BASE = {"torch": "2.0", "pyyaml": "6.0", "pytest": "8.0"}


def test_an_extra_installed_from_its_lock_is_locked_not_drift(root: Path, monkeypatch) -> None:
    result = drift(root, {**BASE, "mlflow": "3.1", "sqlalchemy": "2.0"}, monkeypatch)
    assert result["status"] == "ok", result
    assert result["locks"] == ["requirements.lock", "requirements-dev.lock",
                               "requirements-mlflow.lock"]  # fmt: skip


def test_without_extras_nothing_changes(root: Path, monkeypatch) -> None:
    result = drift(root, BASE, monkeypatch)
    assert result["status"] == "ok" and result["locks"] == ["requirements.lock",
                                                            "requirements-dev.lock"]  # fmt: skip
    # A package of an extra without the extra's head package is not locked: drift.
    assert drift(root, {**BASE, "sqlalchemy": "2.0"}, monkeypatch)["extra"] == ["sqlalchemy"]


def test_an_extra_installed_by_hand_at_other_versions_or_in_part_is_drift(
    root: Path, monkeypatch
) -> None:
    by_hand = drift(root, {**BASE, "mlflow": "3.2", "sqlalchemy": "2.0"}, monkeypatch)
    assert by_hand["different"] == [{"name": "mlflow", "locked": "3.1", "installed": "3.2"}]
    in_part = drift(root, {**BASE, "mlflow": "3.1"}, monkeypatch)
    assert in_part["missing"] == ["sqlalchemy"]


def test_each_extras_head_package_is_a_direct_requirement_of_its_in_file() -> None:
    from packaging.requirements import Requirement

    for extra, head in lf.EXTRAS.items():
        lock, src = lf.extra_pair(extra)
        names = [
            lf.normalize_name(Requirement(line).name)
            for line in (ROOT / src).read_text().splitlines()
            if line.strip() and not line.startswith(("#", "-"))
        ]
        assert names[0] == lf.normalize_name(head), (src, names)
        assert (ROOT / lock).is_file()


def test_check_lock_covers_the_extras_locks_hashed_and_fresh(tmp_path: Path) -> None:
    pairs = [(ROOT / lk, ROOT / i) for lk, i in lf.ALL_PAIRS]
    assert {p[0].name for p in pairs} >= {"requirements-mlflow.lock", "requirements-wandb.lock"}
    assert check_lock.check_locks(pairs) == []  # pinned, hashed, every platform, agreeing
    for name in {f for lk, i in lf.ALL_PAIRS for f in (lk, i, lk + ".sha256", lk + ".files")}:
        shutil.copy2(ROOT / name, tmp_path / name)
    lock = tmp_path / "requirements-wandb.lock"
    text = lock.read_text()
    first_hash = text.index("    --hash=sha256:")
    lock.write_text(text[:first_hash] + text[text.index("\n", first_hash) + 1 :])
    problems = check_lock.check_locks([(tmp_path / lk, tmp_path / i) for lk, i in lf.ALL_PAIRS])
    assert any("requirements-wandb.lock" in p and "edited after make lock" in p for p in problems)


def test_make_install_extras_installs_the_hashed_extra_locks_only() -> None:
    proc = subprocess.run(
        ["make", "-n", "install", "EXTRAS=mlflow,wandb"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    line = [x for x in proc.stdout.splitlines() if "requirements-mlflow.lock" in x][-1]
    assert "--require-hashes" in line and "-r requirements-wandb.lock" in line
    plain = subprocess.run(["make", "-n", "install"], cwd=ROOT, capture_output=True, text=True)
    assert "requirements-mlflow.lock" not in plain.stdout


def test_env_check_passes_in_this_venv_with_or_without_the_extras() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.locks.env_check", "--root", str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    installed = lf.installed_versions()
    for extra, head in lf.EXTRAS.items():
        shown = lf.extra_pair(extra)[0] in proc.stdout
        assert shown == (lf.normalize_name(head) in installed)


@pytest.mark.slow
def test_the_mlflow_extra_installs_from_its_lock_alone_into_a_fresh_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    lock = ROOT / "requirements-mlflow.lock"
    pip = [str(py), "-m", "pip", "install", "--quiet", "--require-hashes", "--no-deps"]
    proc = subprocess.run([*pip, "-r", str(lock)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    probe = "import mlflow, sqlalchemy, alembic; print(mlflow.__version__)"
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == lf.parse_lock(lock).entries["mlflow"].version


def test_check_lock_runs_on_the_standard_library_alone() -> None:
    """``make check-lock`` runs before any venv exists (the Makefile says so): ``-S`` leaves
    site-packages (yaml, torch) out, so an import of one on its path fails here."""
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-S", "-m", "reprotrain.tools.locks.check_lock"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok: requirements.lock"), done.stdout
