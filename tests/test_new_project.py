"""`make new-project` and `make update-template`: the user's package renamed, the framework
byte for byte, and template fixes merged into a project without touching the user's files.

Everything runs on temp copies (git clone of this checkout's HEAD), with plain git and the
system python3, as a user would: no training here (tests/starter checks the bits).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, assert_ok
from reprotrain.tools.template import template_files as tf

PY3 = shutil.which("python3") or "python3"
GIT_ID = ["-c", "user.name=t", "-c", "user.email=t@localhost"]


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *GIT_ID, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def make(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # A fresh top-level make, as a user types it, even when the suite itself runs under
    # `make test` (a nested make would prefix its messages with "make[1]:").
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(
        ["make", "--no-print-directory", f"PYTHON={PY3}", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def tool_lines(stderr: str) -> list[str]:
    """stderr without make's own "make: *** [...] Error N" line."""
    return [ln for ln in stderr.splitlines() if not ln.startswith("make: ")]


def commit_all(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


@pytest.fixture
def template(tmp_path) -> Path:
    """A private copy of the template (this checkout's HEAD) to commit changes into."""
    copy = tmp_path / "template"
    subprocess.run(["git", "clone", "-q", str(REPO), str(copy)], check=True)
    return copy


def new_project(template: Path, dest: Path, name: str = "mylab") -> Path:
    assert_ok(make(template, "new-project", f"NAME={name}", f"DEST={dest}"))
    return dest


def test_new_project_renames_only_the_users_package_and_records_its_template(tmp_path, template):
    dest = new_project(template, tmp_path / "mylab")
    old = tf.TEMPLATE_PACKAGE
    assert (dest / "src" / "mylab").is_dir() and not (dest / "src" / old).exists()
    assert (dest / "tests" / "mylab").is_dir() and (dest / "src" / "reprotrain").is_dir()
    # Framework files: byte-identical; user files: renamed, no trace of the old name.
    files = [f for f in git(template, "ls-files").splitlines()]
    framework = [f for f in files if tf.is_framework(f, old)]
    assert "src/reprotrain/train.py" in framework and "tests/conftest.py" in framework
    for rel in framework:
        assert (dest / rel).read_bytes() == (template / rel).read_bytes(), rel
    user = [f for f in git(dest, "ls-files").splitlines() if not tf.is_framework(f, "mylab")]
    assert f"src/mylab/{'__init__.py'}" in user and "conf/train.yaml" in user
    for rel in user:
        if rel != tf.RECORD and (dest / rel).suffix in (".py", ".yaml", ".md", ".toml"):
            assert not re.search(rf"\b{old}\b", (dest / rel).read_text()), rel
    targets = "".join(p.read_text() for p in (dest / "conf").rglob("*.yaml"))
    assert "_target_: mylab." in targets
    assert 'name = "mylab"' in (dest / "pyproject.toml").read_text()
    record = json.loads((dest / tf.RECORD).read_text())
    assert record["commit"] == git(template, "rev-parse", "HEAD").strip()
    assert record["template"] == str(template) and record["package"] == "mylab"
    assert record["framework_files"] == list(tf.FRAMEWORK)
    assert len(git(dest, "log", "--oneline").splitlines()) == 1
    assert git(dest, "status", "--porcelain") == ""


def test_the_new_projects_readme_links_resolve(tmp_path, template):
    dest = new_project(template, tmp_path / "mylab")
    text = (dest / "README.md").read_text()
    assert text.startswith("# mylab\n") and str(template) in text
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link.split("#")[0] for link in links if not re.match(r"[a-z]+://|#|mailto:", link)]
    assert local, "the README links to its own files (images, docs)"
    for link in local:
        assert (dest / link).exists(), f"README link {link} points nowhere"


def test_new_project_refuses_an_existing_destination_and_a_shadowing_name(tmp_path):
    proc = make(REPO, "new-project", "NAME=mylab", f"DEST={tmp_path}")
    assert proc.returncode == 2 and "already exists" in proc.stderr
    proc = make(REPO, "new-project", "NAME=reprotrain", f"DEST={tmp_path / 'x'}")
    assert proc.returncode == 2 and "shadow" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_update_template_merges_framework_fixes_and_keeps_the_users_edits(tmp_path, template):
    proj = new_project(template, tmp_path / "mylab")
    # The user edits their own package and commits.
    resnet = proj / "src" / "mylab" / "resnet.py"
    resnet.write_text(resnet.read_text() + "\n# my own change\n")
    commit_all(proj, "my model")
    # The template fixes a framework file, adds one, and changes its own example package.
    errors = template / "src" / "reprotrain" / "errors.py"
    errors.write_text(errors.read_text() + "\n# template fix 1\n")
    (template / "scripts" / "new_helper.py").write_text('"""A new framework helper."""\n')
    example = template / "src" / tf.TEMPLATE_PACKAGE / "resnet.py"
    example.write_text(example.read_text() + "\n# template example change\n")
    commit_all(template, "framework fix")
    new = git(template, "rev-parse", "HEAD").strip()

    proc = make(proj, "update-template")
    assert_ok(proc)
    assert "updated 2 framework file(s)" in proc.stdout
    assert (proj / "src/reprotrain/errors.py").read_bytes() == errors.read_bytes()
    assert (proj / "scripts/new_helper.py").is_file()
    assert resnet.read_text().endswith("# my own change\n")  # the user's edit survives
    assert "template example change" not in resnet.read_text()  # the user's room: untouched
    assert json.loads((proj / tf.RECORD).read_text())["commit"] == new
    assert git(proj, "remote") == "" and len(git(proj, "branch").splitlines()) == 1
    staged = git(proj, "diff", "--cached", "--name-only").split()
    assert sorted(staged) == sorted(
        [tf.RECORD, "scripts/new_helper.py", "src/reprotrain/errors.py"]
    )
    commit_all(proj, "take template fixes")
    proc = make(proj, "update-template", f"TEMPLATE={template}")  # the location, given
    assert_ok(proc)
    assert "already up to date" in proc.stdout

    # A dirty tree: refused in one line, nothing changed.
    resnet.write_text("dirty\n")
    proc = make(proj, "update-template")
    (line,) = tool_lines(proc.stderr)
    assert proc.returncode == 2 and line.startswith("error: ") and "uncommitted changes" in line
    git(proj, "checkout", "--", ".")


def test_update_template_conflict_is_reported_by_file_and_leaves_the_tree_as_it_was(
    tmp_path, template
):
    proj = new_project(template, tmp_path / "mylab")
    rel = "src/reprotrain/errors.py"
    lines = (proj / rel).read_text().splitlines(keepends=True)
    lines[0] = '"""My local edit of a framework docstring."""\n'
    (proj / rel).write_text("".join(lines))
    commit_all(proj, "local framework edit")
    head, mine = git(proj, "rev-parse", "HEAD"), (proj / rel).read_bytes()

    t_lines = (template / rel).read_text().splitlines(keepends=True)
    t_lines[0] = '"""The template changed this docstring too."""\n'
    (template / rel).write_text("".join(t_lines))
    (template / "scripts" / "other_fix.py").write_text('"""Applies cleanly on its own."""\n')
    commit_all(template, "conflicting fix")

    proc = make(proj, "update-template")
    assert proc.returncode != 0, proc.stdout + proc.stderr  # the tool exits 1, make says 2
    (line,) = tool_lines(proc.stderr)
    assert line.startswith("error: ") and rel in line and "nothing was changed" in line
    assert (proj / rel).read_bytes() == mine  # the local edit is not lost
    assert not (proj / "scripts" / "other_fix.py").exists()  # nothing half-applied
    assert git(proj, "status", "--porcelain") == "" and git(proj, "rev-parse", "HEAD") == head
    record = json.loads((proj / tf.RECORD).read_text())
    assert record["commit"] != git(template, "rev-parse", "HEAD").strip()


def test_update_template_outside_a_project_is_one_line(tmp_path):
    git(tmp_path, "init", "-q")
    proc = subprocess.run(
        [PY3, str(REPO / "src/reprotrain/tools/template/update_template.py")],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2 and tf.RECORD in proc.stderr and proc.stderr.count("\n") == 1


def test_deleting_the_users_models_and_data_leaves_bench_tests_and_tools_working(
    tmp_path, template
):
    """The framework never needs the user's room: delete its models and datasets, then the
    quickest bench, two framework test files and a tool still run (on the framework's own
    self-check job)."""
    import sys

    from conftest import base_env

    proj = new_project(template, tmp_path / "mylab")
    for module in ("resnet.py", "cifar10.py", "synthetic.py"):
        (proj / "src" / "mylab" / module).unlink()
    shutil.rmtree(proj / "tests" / "mylab")  # its tests go with it
    env = base_env(PYTHONPATH=str(proj / "src"))

    def run(*cmd: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *cmd], cwd=proj, env=env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    bench = run("scripts/bench.py", "--smoke", "--only", "P1,P5", "--levels", "strict",
                "--out", str(tmp_path / "bench"))  # fmt: skip
    assert_ok(bench)
    assert (tmp_path / "bench" / "bench.md").is_file()
    tests = run("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_download.py",
                "tests/test_determinism.py",
                "-k", "restricted or selfcheck_net or warn")  # fmt: skip
    assert_ok(tests)
    assert " passed" in tests.stdout and "failed" not in tests.stdout
    verify = run("-m", "reprotrain.tools.runs.verify", "--out-dir", str(tmp_path / "verify"),
                 "experiment=selfcheck", "dataset.num_train=256", "dataset.num_test=128",
                 "trainer.batch_size=64", "trainer.epochs=1")  # fmt: skip
    assert_ok(verify)
    assert "IDENTICAL" in verify.stdout
