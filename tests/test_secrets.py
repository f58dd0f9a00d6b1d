"""No planted secret reaches a run directory or its archive.

One micro run is trained in a temporary git repository made from this worktree's tracked
files, with a different random token planted in each route a secret can take:

- an untracked ``conf/local_credentials.yaml`` (git.diff used to copy untracked code files),
- an untracked ``src/reprotrain/_local_token.py``,
- a config value read from the environment (``name='${oc.env:PLANTED_TOKEN}'``),
- the credentials in the git remote URL.

Then it is archived, and every file of the run directory and every member of the archive is
searched for each token. The trainer records git state through ``repro.gitinfo.git_info``
and the config through ``repro.secrets.redact``.

The unit tests below check gitinfo and secrets directly.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import MICRO, REPO, base_env
from reprotrain.quoting import hydra_override
from reprotrain.repro import gitinfo
from reprotrain.repro.secrets import env_value_differences, redact, value_sha256
from reprotrain.tools.archive import archive as arch
from reprotrain.tools.reproduce import reproduce as repro

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

TOKENS = {route: f"planted-{route}-{uuid.uuid4().hex}" for route in ("yaml", "py", "env", "remote")}
REMOTE = "https://x-access-token:{}@example.invalid/org/repo.git?private_token={}"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def tracked_copy(dest: Path) -> Path:
    """A fresh one-commit repository holding this worktree's tracked files as they are now."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    _git(dest, "init", "-q")
    _git(dest, "add", ".")
    _git(dest, "commit", "-qm", "snapshot of the worktree under test")
    return dest


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """(run dir, archive, trainer output, archive output) of a run with every route planted."""
    base = tmp_path_factory.mktemp("secrets")
    clone = tracked_copy(base / "clone")
    _git(clone, "remote", "add", "origin", REMOTE.format(TOKENS["remote"], TOKENS["remote"]))
    (clone / "conf/local_credentials.yaml").write_text(f"api_token: {TOKENS['yaml']}\n")
    (clone / "src/reprotrain/_local_token.py").write_text(f"TOKEN = {TOKENS['py']!r}\n")
    env = base_env(PLANTED_TOKEN=TOKENS["env"], PYTHONPATH=str(clone / "src"))
    run_dir = base / "run"
    train = subprocess.run(
        [sys.executable, "-m", "reprotrain.train", *MICRO, "name=${oc.env:PLANTED_TOKEN}",
         hydra_override("hydra.run.dir", run_dir)],
        cwd=clone, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    packed = subprocess.run(
        [sys.executable, "-m", "reprotrain.tools.archive.archive", str(run_dir), "--out-dir",
         str(base / "archives")],
        cwd=clone, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert packed.returncode == 0, packed.stdout[-3000:] + packed.stderr[-3000:]
    (archive,) = (base / "archives").glob("*.tar.gz")
    return run_dir, archive, train.stdout + train.stderr, packed.stdout


def files_holding(token: str, run_dir: Path, archive: Path) -> list[str]:
    """Every run-dir file and archive member (name or contents) that contains ``token``."""
    needle = token.encode()
    hits = [
        str(p.relative_to(run_dir))
        for p in sorted(run_dir.rglob("*"))
        if (p.is_file() and needle in p.read_bytes()) or needle in str(p).encode()
    ]
    with tarfile.open(archive) as tar:
        for m in tar.getmembers():
            data = tar.extractfile(m).read() if m.isreg() else b""
            if needle in data or needle in m.name.encode():
                hits.append(f"archive:{m.name}")
    return hits


def test_the_remote_url_credentials_appear_nowhere(planted):
    run_dir, archive, _, _ = planted
    assert files_holding(TOKENS["remote"], run_dir, archive) == []
    with tarfile.open(archive) as tar:
        (member,) = [m for m in tar.getmembers() if m.name.endswith("/env/git.json")]
        recorded = json.loads(tar.extractfile(member).read())
    assert recorded["remotes"]["origin"] == "https://example.invalid/org/repo.git", "control"


@pytest.mark.parametrize("route", ["yaml", "py"])
def test_untracked_files_contents_appear_nowhere(planted, route):
    run_dir, archive, _, _ = planted
    assert files_holding(TOKENS[route], run_dir, archive) == []


def test_an_oc_env_value_appears_nowhere(planted):
    run_dir, archive, _, _ = planted
    assert files_holding(TOKENS["env"], run_dir, archive) == []
    assert "${oc.env:PLANTED_TOKEN}" in (run_dir / "config.resolved.yaml").read_text()


def test_untracked_files_are_recorded_by_name_and_sha256_and_the_run_warns(planted):
    run_dir, _, train_output, archive_output = planted
    git = json.loads((run_dir / "run.json").read_text())["git"]
    listed = {u["path"]: u for u in git["untracked"]}
    yaml_entry = listed["conf/local_credentials.yaml"]
    assert yaml_entry["sha256"] == value_sha256(f"api_token: {TOKENS['yaml']}\n")
    assert git["fully_archivable"] is False
    assert "not fully archivable" in train_output
    assert "NOT FULLY ARCHIVABLE" in archive_output


# ------------------------------------------------------------------------------ units


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    (repo / "src/pkg").mkdir(parents=True)
    (repo / "src/pkg/a.py").write_text("A = 1\n")
    (repo / "README").write_text("r\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    return repo


def test_git_info_never_copies_untracked_files_but_lists_them(repo):
    secret = uuid.uuid4().hex
    (repo / "conf").mkdir()
    (repo / "conf/local_credentials.yaml").write_text(f"token: {secret}\n")
    (repo / "src/pkg/_local_token.py").write_text(f"T = '{secret}'\n")
    (repo / "notes.txt").write_text(f"{secret}\n")
    (repo / "src/pkg/a.py").write_text("A = 2\n")  # a tracked edit is still recorded
    info, diff = gitinfo.git_info(repo)
    assert secret not in diff and secret not in json.dumps(info)
    assert "+A = 2" in diff
    listed = {u["path"]: u["sha256"] for u in info["untracked"]}
    assert listed["notes.txt"] == value_sha256(f"{secret}\n")
    assert set(listed) == {"conf/local_credentials.yaml", "src/pkg/_local_token.py", "notes.txt"}
    assert info["fully_archivable"] is False
    assert info["not_archived"] == ["conf/local_credentials.yaml", "src/pkg/_local_token.py"]
    warning = gitinfo.archivability_warning(info)
    assert "not fully archivable" in warning and "conf/local_credentials.yaml" in warning


def test_only_opted_in_untracked_paths_are_copied(repo):
    (repo / "src/pkg/new_model.py").write_text("WIDTH = 3\n")
    (repo / "src/pkg/_local_token.py").write_text("T = 'x'\n")
    info, diff = gitinfo.git_info(repo, include_untracked=["src/pkg/new_model.py"])
    assert "WIDTH = 3" in diff and "T = 'x'" not in diff
    assert info["not_archived"] == ["src/pkg/_local_token.py"]
    info, diff = gitinfo.git_info(repo, include_untracked=["src/pkg/"])
    assert "T = 'x'" in diff and info["fully_archivable"] is True
    assert gitinfo.archivability_warning(info) is None


@pytest.mark.parametrize(
    "url, scrubbed",
    [
        ("https://user:ghp_tok@github.com/o/r.git", "https://github.com/o/r.git"),
        ("https://oauth2:tok@gitlab.com/o/r.git?private_token=tok#x", "https://gitlab.com/o/r.git"),
        ("ssh://git:pw@host:22/o/r", "ssh://host:22/o/r"),
        ("git@github.com:o/r.git", "git@github.com:o/r.git"),
        ("/srv/git/r.git", "/srv/git/r.git"),
    ],
)
def test_remote_urls_lose_their_credentials(url, scrubbed):
    assert gitinfo.scrub_url(url) == scrubbed


def test_oc_env_values_are_recorded_as_interpolation_and_sha256(monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("PLANTED_TOKEN", secret)
    monkeypatch.setenv("MIRROR_HOST", "mirror.internal")
    cfg = OmegaConf.create(
        {
            "name": "${oc.env:PLANTED_TOKEN}",
            "dataset": {"url": "https://${oc.env:MIRROR_HOST}/data", "num_train": 4},
            "copy": "${name}",
            "items": [1, "${oc.env:PLANTED_TOKEN}"],
            "plain": "${dataset.num_train}",
        }
    )
    container, digests = redact(cfg)
    text = json.dumps(container) + json.dumps(digests)
    assert secret not in text and "mirror.internal" not in text
    assert container["name"] == "${oc.env:PLANTED_TOKEN}"
    assert container["plain"] == 4, "values not from the environment stay resolved"
    assert set(digests) == {"name", "dataset.url", "copy", "items[1]"}
    assert digests["name"]["sha256"] == value_sha256(secret)
    # A replay re-resolves the interpolation and can tell same from different values.
    reloaded = OmegaConf.create(OmegaConf.to_yaml(container))
    assert env_value_differences(reloaded, digests) == []
    monkeypatch.setenv("PLANTED_TOKEN", "something else")
    assert any("name" in d for d in env_value_differences(reloaded, digests))
    monkeypatch.delenv("PLANTED_TOKEN")
    assert any("cannot be resolved" in d for d in env_value_differences(reloaded, digests))


def test_archive_and_reproduce_say_when_a_run_is_not_fully_archivable():
    record = {"git": {"fully_archivable": False, "not_archived": ["src/pkg/_local.py"]}}
    (note,) = arch.archivability(record)
    assert note.startswith("NOT FULLY ARCHIVABLE") and "src/pkg/_local.py" in note
    assert "src/pkg/_local.py" in repro.not_fully_archivable(record)
    assert arch.archivability({"git": {"commit": "x"}}) == []  # records before the flag
