"""Archive a run, replay it from the archive, and refuse archives that cannot be trusted.

One micro run is trained (with secret-looking variables in its environment, into a run
directory whose name has a space, a comma, quotes, brackets and a non-ASCII letter) and
archived once per module; the replays re-run it from the archived source snapshot in fresh
processes. Refusals (manifest, unsafe members, data drift) are checked in-process: nothing
is re-run. The development tree is usually dirty, so trust rule (a) (same commit, no patch)
does not hold for these archives: replays pass ``--trust`` (tests/test_trust.py covers the
rules themselves).
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import MICRO, REPO, assert_ok, base_env
from reprotrain.hashing import file_sha256
from reprotrain.quoting import hydra_override
from reprotrain.repro.gitinfo import git_info
from reprotrain.tools.archive import archive as arch
from reprotrain.tools.archive import pack, snapshot
from reprotrain.tools.reproduce import replay_plan, rerun
from reprotrain.tools.reproduce import reproduce as repro

# Random per session, so it is in no file (this test file shows up in a dirty run's git.diff).
MARKER = f"leakmarker-{uuid.uuid4().hex}"
SECRETS = {
    "WANDB_API_KEY": f"{MARKER}-wandb",
    "AWS_SECRET_ACCESS_KEY": f"{MARKER}-aws",
    "HF_TOKEN": f"{MARKER}-hf",
    "GITHUB_TOKEN": f"{MARKER}-gh",
}


#: A run directory name that needs quoting in Hydra, the shell and Make.
AWKWARD = "run a, ü(x)'q'~#&=["


def train_quoted(run_dir: Path, *overrides: str, env: dict | None = None):
    """conftest.train, with the run directory passed as a quoted Hydra value."""
    cmd = [sys.executable, "-m", "reprotrain.train", *MICRO, *overrides]
    cmd.append(hydra_override("hydra.run.dir", run_dir))
    return subprocess.run(
        cmd, cwd=REPO, env=env or base_env(), capture_output=True, text=True, timeout=600
    )


def tool(name: str, *args: str, cwd: Path, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", f"reprotrain.tools.{name}", *args],
        cwd=cwd,
        env=env or base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def unpack(archive: Path, dest: Path) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    (top,) = dest.iterdir()
    return top


def repack(top: Path, out: Path, manifest: bool = True) -> Path:
    """Tar ``top`` again; with ``manifest``, recompute MANIFEST.sha256 as archive.py would."""
    if manifest:
        digests = {
            p.relative_to(top).as_posix(): file_sha256(p)
            for p in sorted(top.rglob("*"))
            if p.is_file() and p.name != arch.MANIFEST
        }
        (top / arch.MANIFEST).write_text(arch.manifest_text(digests))
    with tarfile.open(out, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    return out


def edited(archive: Path, tmp: Path, rel: str, edit, manifest: bool = True) -> Path:
    top = unpack(archive, tmp / "unpacked")
    path = top / rel
    path.write_bytes(edit(path.read_bytes()))
    return repack(top, tmp / "edited.tar.gz", manifest=manifest)


def edit_run_json(**changes):
    def edit(data: bytes) -> bytes:
        record = json.loads(data)
        for dotted, value in changes.items():
            node, *path = dotted.split("__")
            target = record[node]
            for key in path[:-1]:
                target = target[key]
            if path:
                target[path[-1]] = value
            else:
                record[node] = value
        return json.dumps(record).encode()

    return edit


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


@pytest.fixture(scope="module")
def archived(tmp_path_factory):
    """(run dir, archive, archive stdout): a micro run trained and archived with secrets set."""
    base = tmp_path_factory.mktemp("archived")
    env = base_env(**SECRETS, SLURM_JOB_ID="job-4242")  # allowlisted: a control
    run_dir = base / AWKWARD
    assert_ok(train_quoted(run_dir, env=env))
    proc = tool(
        "archive.archive", str(run_dir), "--out-dir", str(base / "archives"), cwd=base, env=env
    )
    assert_ok(proc)
    (archive,) = (base / "archives").glob("*.tar.gz")
    return run_dir, archive, proc.stdout


# ------------------------------------------------------------------------------ archive


def test_archive_holds_run_source_env_and_a_manifest(archived, tmp_path):
    run_dir, archive, out = archived
    record = json.loads((run_dir / "run.json").read_text())
    assert archive.name == f"{record['experiment_id']}-{run_dir.name}.tar.gz"
    top = unpack(archive, tmp_path)
    for rel in (
        "run/run.json",
        "run/config.resolved.yaml",
        "run/fingerprints.jsonl",
        "run/.hydra/config.yaml",
        "source/src/reprotrain/train.py",
        "source/conf/train.yaml",
        "source/pyproject.toml",
        "source/requirements.lock",
        "env/requirements.lock",
        "env/pip-freeze.txt",
        "env/git.json",
        "archive.json",
    ):
        assert (top / rel).is_file(), rel
    assert not (top / "run" / "checkpoints").exists(), "checkpoints are left out by default"
    assert not (top / "source" / "tests").exists()
    lock = top / "env" / "requirements.lock"
    assert file_sha256(lock) == record["lock_sha256"], "the lock as it ran"
    assert "torch==" in (top / "env" / "pip-freeze.txt").read_text()
    meta = json.loads((top / "archive.json").read_text())
    assert meta["source"]["kind"] == "git"
    assert meta["source"]["commit"] == record["git"]["commit"]
    assert meta["source"]["diff_applied"] == bool(record["git"]["dirty"])
    # The manifest covers every member and is sha256sum-compatible.
    listed = arch.parse_manifest((top / arch.MANIFEST).read_text())
    assert set(listed) == {p.relative_to(top).as_posix() for p in top.rglob("*") if p.is_file()} - {
        arch.MANIFEST
    }
    if shutil.which("sha256sum"):
        check = subprocess.run(["sha256sum", "--quiet", "-c", arch.MANIFEST], cwd=top)
        assert check.returncode == 0
    for needle in (record["experiment_id"], "base=42", "strict", "test_acc=", "KiB"):
        assert needle in out, needle


def test_with_checkpoint_adds_only_the_final_one(archived, tmp_path):
    run_dir, _, _ = archived
    path, _ = arch.build(run_dir, tmp_path / "out", with_checkpoint=True)
    with tarfile.open(path) as tar:
        ckpts = [m.name.rsplit("/", 1)[1] for m in tar.getmembers() if "/checkpoints/" in m.name]
    assert ckpts == [pack.final_checkpoint(run_dir).name]
    assert ckpts[0].startswith("step-") and len(list((run_dir / "checkpoints").iterdir())) > 1


def test_incomplete_run_is_refused_unless_allowed(archived, tmp_path, capsys):
    run_dir, _, _ = archived
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))
    record = json.loads((copy / "run.json").read_text())
    (copy / "run.json").write_text(json.dumps({**record, "status": "interrupted"}))
    assert arch.main([str(copy), "--out-dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not completed" in err and "--allow-incomplete" in err
    assert not list((tmp_path).glob("a/*.tar.gz"))
    assert arch.main([str(copy), "--out-dir", str(tmp_path / "a"), "--allow-incomplete"]) == 0
    assert len(list(tmp_path.glob("a/*.tar.gz"))) == 1
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")], "no temp left"


def test_pip_freeze_credentials_are_redacted():
    line = "pkg @ git+https://user:ghp_abc123@github.com/o/r.git@v1\nother==1.0\n"
    assert (
        pack.scrub_credentials(line) == "pkg @ git+https://***@github.com/o/r.git@v1\nother==1.0\n"
    )


# ------------------------------------------------------------------------------ snapshot


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


@pytest.fixture
def small_repo(tmp_path):
    repo = tmp_path / "repo"
    for rel, text in {
        "src/pkg/a.py": "A = 1\n",
        "conf/c.yaml": "c: 1\n",
        "README.md": "readme\n",
        "tests/t.py": "T = 1\n",
        "requirements.lock": "x==1\n",
    }.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    return repo


def test_snapshot_is_the_recorded_commit_plus_the_recorded_diff(small_repo, tmp_path):
    repo = small_repo
    # The tree as the run saw it: a tracked edit, an untracked file, edits outside src/conf.
    (repo / "src/pkg/a.py").write_text("A = 2  # as ran\n")
    (repo / "src/pkg/new.py").write_text("NEW = True\n")
    (repo / "README.md").write_text("edited readme\n")
    assert "NEW = True" not in git_info(repo)[1], "untracked contents only when opted in"
    info, diff = git_info(repo, include_untracked=["src/pkg/new.py"])
    assert info["dirty"] and "new.py" in diff and info["fully_archivable"]
    # Afterwards the tree moves on: more edits and a new commit.
    (repo / "src/pkg/a.py").write_text("A = 3  # later\n")
    (repo / "conf/c.yaml").write_text("c: 2\n")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "two")
    (repo / "src/pkg/a.py").write_text("A = 4  # uncommitted later\n")

    snap = snapshot.build(repo, info["commit"], diff, tmp_path / "snap")
    assert (snap.kind, snap.commit, snap.diff_applied) == ("git", info["commit"], True)
    s = tmp_path / "snap"
    assert (s / "src/pkg/a.py").read_text() == "A = 2  # as ran\n"
    assert (s / "src/pkg/new.py").read_text() == "NEW = True\n"
    assert (s / "conf/c.yaml").read_text() == "c: 1\n"
    assert (s / "requirements.lock").read_text() == "x==1\n"
    assert not (s / "README.md").exists() and not (s / "tests").exists()


def test_snapshot_refuses_a_missing_commit_and_falls_back_without_git(small_repo, tmp_path):
    with pytest.raises(snapshot.SnapshotError, match="not in"):
        snapshot.build(small_repo, "0" * 40, "", tmp_path / "s1")
    plain = tmp_path / "plain"
    shutil.copytree(small_repo, plain, ignore=shutil.ignore_patterns(".git"))
    snap = snapshot.build(plain, "0" * 40, "", tmp_path / "s2")
    assert snap.kind == "working-tree" and "not as it ran" in snap.notes[0]
    assert (tmp_path / "s2/src/pkg/a.py").read_text() == "A = 1\n"


def test_archive_rebuilds_source_from_the_recorded_commit(archived, small_repo, tmp_path):
    """End to end through archive.build with --repo: a later working tree is not packed."""
    run_dir, _, _ = archived
    repo = small_repo
    (repo / "src/pkg/a.py").write_text("A = 2  # as ran\n")
    info, diff = git_info(repo)
    (repo / "src/pkg/a.py").write_text("A = 5  # edited after the run\n")
    fake = tmp_path / "run"
    shutil.copytree(run_dir, fake, ignore=shutil.ignore_patterns("checkpoints"))
    record = json.loads((fake / "run.json").read_text())
    (fake / "run.json").write_text(json.dumps({**record, "git": info}))
    (fake / "git.diff").write_text(diff)
    path, meta = arch.build(fake, tmp_path / "out", repo=repo)
    top = unpack(path, tmp_path / "x")
    assert (top / "source/src/pkg/a.py").read_text() == "A = 2  # as ran\n"
    assert (top / "run/git.diff").read_text() == diff
    assert meta["source"]["diff_applied"]


# ------------------------------------------------------------------------------ replay


def test_reproduce_from_another_directory_is_bitwise(archived, tmp_path):
    _, archive, _ = archived
    env = base_env(**SECRETS)
    proc = tool(
        "reproduce.reproduce",
        str(archive),
        "--trust",
        "--runs-dir",
        str(tmp_path / "runs"),
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last_line(proc.stdout).startswith("REPRODUCED (bitwise)")
    (new_run,) = (tmp_path / "runs").iterdir()
    report = json.loads((new_run / "reproduction.json").read_text())
    assert report["exit_code"] == 0 and report["verdict"].startswith("REPRODUCED")
    for path in new_run.rglob("*"):
        if path.is_file():
            assert MARKER.encode() not in path.read_bytes(), path


def test_reproduce_runs_the_archived_source_not_the_working_tree(archived, tmp_path):
    """A 'checkout' whose trainer cannot even be imported: the replay must not touch it."""
    _, archive, _ = archived
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "src", checkout / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for lock in REPO.glob("requirements*.lock"):
        shutil.copy2(lock, checkout / lock.name)
    engine = checkout / "src/reprotrain/step/runner.py"
    engine.write_text(engine.read_text() + "\nraise ImportError('working tree imported')\n")
    env = base_env(PYTHONPATH=str(checkout / "src"))
    control = subprocess.run(
        [sys.executable, "-c", "import reprotrain.step.runner"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
    )
    assert control.returncode != 0 and b"working tree imported" in control.stderr
    proc = tool(
        "reproduce.reproduce",
        str(archive),
        "--trust",
        "--epochs",
        "1",
        "--runs-dir",
        str(tmp_path / "runs"),
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last_line(proc.stdout).startswith("REPRODUCED (bitwise): epoch(s) 1-1")


def spot_check(archive, tmp_path, *extra: str):
    """Reproduce only the first epoch of ``archive`` (EPOCHS=1, TRUST=1), runs in tmp_path."""
    return tool(
        "reproduce.reproduce",
        str(archive),
        "--trust",
        *extra,
        "--epochs",
        "1",
        "--runs-dir",
        str(tmp_path / "runs"),
        cwd=tmp_path,
    )


def test_a_code_change_inside_the_archive_diverges(archived, tmp_path):
    """The converse: the replay's numbers come from the archived source."""
    _, archive, _ = archived
    rel = "source/src/reprotrain/repro/seeding.py"
    needle = b'SEED_SALT = "reprotrain"'

    def edit(data: bytes) -> bytes:
        assert needle in data, "update this test: seeding.py no longer derives streams this way"
        return data.replace(needle, b'SEED_SALT = "reprotrain-edited"')

    changed = edited(archive, tmp_path, rel, edit)
    proc = spot_check(changed, tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert last_line(proc.stdout).startswith("DIVERGED at epoch 1 (step 0)")
    assert "train_loss" in proc.stdout and "tolerance" in proc.stdout


def test_environment_difference_is_not_comparable(archived, tmp_path):
    _, archive, _ = archived
    changed = edited(archive, tmp_path, "run/run.json", edit_run_json(environment__torch="1.0.0"))
    proc = spot_check(changed, tmp_path)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = last_line(proc.stdout)
    assert verdict.startswith("NOT COMPARABLE") and "torch: 1.0.0 ->" in verdict
    assert "tolerance 0.02" in proc.stdout


# Default-tier siblings: test_reproduce_records.py::test_a_forged_metric_row_diverges_naming_
# the_field_and_epoch and ::test_forged_final_metrics_diverge_over_the_whole_run_only.
@pytest.mark.slow
def test_forged_metrics_and_final_metrics_diverge_naming_the_field(archived, tmp_path):
    """metrics.jsonl and final_metrics rewritten (a better metric, the manifest regenerated):
    the weights still match, and the verdict is DIVERGED naming the forged field, not
    REPRODUCED with the difference listed under it."""
    _, archive, _ = archived
    top = unpack(archive, tmp_path / "forged")
    rows = [json.loads(x) for x in (top / "run/metrics.jsonl").read_text().splitlines()]
    key = next(k for k in rows[-1] if k.startswith(("test_", "val_")))
    rows[-1][key] = 0.0123
    (top / "run/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    forged = repack(top, tmp_path / "forged.tar.gz")
    proc = tool("reproduce.reproduce", str(forged), "--trust", "--runs-dir",
                str(tmp_path / "runs"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = last_line(proc.stdout)
    assert verdict.startswith(f"DIVERGED at epoch {rows[-1]['epoch']}") and key in verdict
    assert "0.0123" in verdict

    changed = edited(archive, tmp_path / "final", "run/run.json", edit_run_json(
        **{f"final_metrics__{key}": 0.0123}))  # fmt: skip
    proc = tool("reproduce.reproduce", str(changed), "--trust", "--runs-dir",
                str(tmp_path / "runs2"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"final_metrics differ: {key} 0.0123 vs" in last_line(proc.stdout)


def test_a_config_that_no_longer_matches_its_config_sha256_is_refused(archived, tmp_path):
    """A callback added to the archived config (manifest regenerated): the archive
    contradicts itself, so nothing runs, trusted or not: one line, exit 2."""
    _, archive, _ = archived
    marker = tmp_path / "PWNED"

    def add_callback(data: bytes) -> bytes:
        cfg = OmegaConf.create(data.decode())
        cfg.callbacks = [*(cfg.get("callbacks") or []),
                         {"_target_": "os.system", "command": f"touch {marker}"}]  # fmt: skip
        return OmegaConf.to_yaml(cfg).encode()

    changed = edited(archive, tmp_path, "run/config.resolved.yaml", add_callback)
    proc = tool("reproduce.reproduce", str(changed), "--trust", "--runs-dir",
                str(tmp_path / "runs"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2 and not marker.exists(), proc.stdout[-2000:] + proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "config_sha256" in line and "contradicts itself" in line
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # default-tier sibling: test_run_trust.py (the rule for each command, in process)
def test_a_run_extracted_from_an_archive_is_built_only_under_trust(archived, tmp_path):
    """``reproduce --verify-only --extract-dir D`` marks what it extracts; ``eval`` of the
    extracted run then needs the trust decision reproduce makes: a config whose model
    ``_target_`` runs a command is refused in one line and nothing runs; the archive's own
    config (composed from this checkout's conf/) is built under rule (a)."""
    _, archive, _ = archived
    marker = tmp_path / "PWNED"

    def hostile(data: bytes) -> bytes:
        cfg = OmegaConf.create(data.decode())
        cfg.model = {"_target_": "reprotrain.tools.runs.resume.run_forwarding_signals",
                     "cmd": ["touch", str(marker)], "env": {}}  # fmt: skip
        return OmegaConf.to_yaml(cfg).encode()

    changed = edited(archive, tmp_path, "run/config.resolved.yaml", hostile)
    for name, source in (("hostile", changed), ("own", archive)):
        dest = tmp_path / name
        proc = tool("reproduce.reproduce", str(source), "--verify-only", "--extract-dir",
                    str(dest), cwd=tmp_path)  # fmt: skip
        assert_ok(proc)
        (top,) = dest.iterdir()
        assert (top / "from-archive.json").is_file() and (top / "run/from-archive.json").is_file()
        proc = subprocess.run([sys.executable, "-m", "reprotrain", "eval", str(top / "run")],
                              cwd=tmp_path, env=base_env(), capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
        if name == "hostile":
            assert "came from an archive" in errors[0] and "TRUST=1" in errors[0]
        else:  # trusted by rule (a); the archive holds no checkpoint to evaluate
            assert "trust" in proc.stderr and "(a) 1 run config(s)" in proc.stderr
            assert "has no step checkpoints" in errors[0]
    assert not marker.exists()


def test_eval_of_a_model_that_is_not_a_module_is_one_line(archived):
    run_dir, _, _ = archived
    proc = subprocess.run([sys.executable, "-m", "reprotrain", "eval", str(run_dir),
                           "model._target_=collections.OrderedDict"], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "collections.OrderedDict does not build a torch.nn.Module" in line


@pytest.mark.slow  # its unit: test_comparability.py (the kernel families)
def test_a_kernel_variable_set_for_the_replay_is_not_comparable_and_named(archived, tmp_path):
    """ONEDNN_DEFAULT_FPMATH_MODE=BF16 changes a conv run's bits; it was recorded nowhere, so
    a replay under it said "env matches" and then DIVERGED (issue 34). The families
    (ONEDNN_*, MKL_*, TORCH_*...) are recorded and compared: NOT COMPARABLE, the variable
    named, before anything is claimed."""
    _, archive, _ = archived
    env = {**base_env(), "ONEDNN_DEFAULT_FPMATH_MODE": "BF16"}
    proc = tool("reproduce.reproduce", str(archive), "--trust", "--epochs", "1", "--runs-dir",
                str(tmp_path / "runs"), cwd=tmp_path, env=env)  # fmt: skip
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = last_line(proc.stdout)
    assert verdict.startswith("NOT COMPARABLE")
    assert "$ONEDNN_DEFAULT_FPMATH_MODE: none -> BF16" in verdict


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "rel, edit, expect",
    [
        ("run/metrics.jsonl", lambda b: bytes([b[0] ^ 1]) + b[1:], "sha256"),
        ("source/src/reprotrain/train.py", lambda b: b[:-1] + bytes([b[-1] ^ 1]), "sha256"),
        ("run/run.json", lambda b: b + b" ", "sha256"),
    ],
)
def test_a_changed_member_fails_the_manifest_and_is_named(
    archived, tmp_path, capsys, rel, edit, expect
):
    _, archive, _ = archived
    changed = edited(archive, tmp_path, rel, edit, manifest=False)
    target = tmp_path / "target"
    rc = repro.main([str(changed), "--extract-dir", str(target), "--verify-only"])
    err = capsys.readouterr().err
    assert rc == 2 and f"/{rel} " in err and expect in err and err.count("\n") == 1
    assert not target.exists(), "nothing extracted"


def test_missing_and_extra_members_fail_the_manifest(archived, tmp_path, capsys):
    _, archive, _ = archived
    top = unpack(archive, tmp_path / "u1")
    (top / "run/train.log").unlink()
    rc = repro.main([str(repack(top, tmp_path / "a.tar.gz", manifest=False)), "--verify-only"])
    assert rc == 2 and "run/train.log is in MANIFEST.sha256 but not in" in capsys.readouterr().err
    top = unpack(archive, tmp_path / "u2")
    (top / "run/extra.txt").write_text("x")
    rc = repro.main([str(repack(top, tmp_path / "b.tar.gz", manifest=False)), "--verify-only"])
    assert rc == 2 and "run/extra.txt is in the archive but not in" in capsys.readouterr().err
    # control: the untouched archive verifies
    assert repro.main([str(archive), "--verify-only"]) == 0


def _crafted(path: Path, evil: tarfile.TarInfo | None, payload: bytes = b"pwned") -> Path:
    manifest = b""  # no file members besides the manifest itself
    with tarfile.open(path, "w:gz") as tar:
        d = tarfile.TarInfo("top")
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        m = tarfile.TarInfo(f"top/{arch.MANIFEST}")
        m.size = len(manifest)
        tar.addfile(m, io.BytesIO(manifest))
        if evil is not None:
            evil.size = len(payload) if evil.isreg() else 0
            tar.addfile(evil, io.BytesIO(payload) if evil.isreg() else None)
    return path


def _member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


@pytest.mark.parametrize(
    "member",
    [
        _member("../../evil"),
        _member("top/../../evil"),
        _member("/ABSOLUTE/evil"),
        _member("top/link", tarfile.SYMTYPE, "../../.."),
        _member("top/hard", tarfile.LNKTYPE, "/etc/passwd"),
        _member("top/dev", tarfile.CHRTYPE),
        _member("top/fifo", tarfile.FIFOTYPE),
        _member("other/evil"),
    ],
    ids=["dotdot", "top-dotdot", "absolute", "symlink", "hardlink", "device", "fifo", "second-top"],
)
def test_unsafe_members_refuse_the_whole_archive(tmp_path, capsys, member):
    root = tmp_path / "a" / "b"
    root.mkdir(parents=True)
    if member.name.startswith("/ABSOLUTE"):
        member.name = str(tmp_path / "abs-evil")
    crafted = _crafted(tmp_path / "crafted.tar.gz", member)
    before = files_under(tmp_path)
    target = root / "target"
    rc = repro.main([str(crafted), "--extract-dir", str(target), "--verify-only"])
    err = capsys.readouterr().err
    assert rc == 2 and "unsafe member" in err and "nothing extracted" in err
    assert files_under(tmp_path) == before, "nothing written anywhere"
    assert not (tmp_path / "evil").exists() and not (tmp_path / "a" / "evil").exists()
    # control: the same archive without the bad member is accepted
    clean = _crafted(tmp_path / "clean.tar.gz", None)
    assert repro.main([str(clean), "--extract-dir", str(root / "t2"), "--verify-only"]) == 0


# ------------------------------------------------------------------------------ data drift


def test_data_check_refuses_a_different_fingerprint_unless_allowed():
    cfg = OmegaConf.create(
        {
            "_target_": "reprotrain.selfcheck.images.SyntheticImages",
            "num_train": 64,
            "num_test": 32,
            "data_seed": 1,
            "noise": 1.0,
        }
    )
    from reprotrain.components import data_fingerprint

    here = data_fingerprint(cfg)
    assert rerun.check_data(cfg, here, allow_drift=False) is None
    wrong = {**here, "sha256": "f" * 64}
    with pytest.raises(repro.ReproduceRefused) as e:
        rerun.check_data(cfg, wrong, allow_drift=False)
    assert "f" * 64 in str(e.value) and here["sha256"] in str(e.value)
    assert "--allow-data-drift" in str(e.value)
    assert here["sha256"] in rerun.check_data(cfg, wrong, allow_drift=True)


def test_changed_dataset_is_refused_then_replayed_as_not_comparable(archived, tmp_path, capsys):
    _, archive, _ = archived
    changed = edited(
        archive, tmp_path, "run/run.json", edit_run_json(data_fingerprint__sha256="e" * 64)
    )
    runs = tmp_path / "runs"
    rc = repro.main([str(changed), "--runs-dir", str(runs)])
    err = capsys.readouterr().err
    assert rc == 2 and "e" * 64 in err and err.count("\n") == 1
    assert not runs.exists(), "refused before any re-run"
    proc = tool(
        "reproduce.reproduce",
        str(changed),
        "--trust",
        "--allow-data-drift",
        "--epochs",
        "1",
        "--runs-dir",
        str(runs),
        cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "data differs" in last_line(proc.stdout)


def test_verdict_helpers():
    assert rerun.not_comparable_reasons({"repro": {"level": "fast"}})
    assert not rerun.not_comparable_reasons({"repro": {"level": "strict"}})
    lines, ok = repro.tolerance_report({1: {"test_acc": (0.5, 0.51), "lr": (0.1, 0.1)}}, 0.02)
    assert ok and "ok" in lines[0]
    lines, ok = repro.tolerance_report({1: {"test_loss": (0.5, 0.6)}}, 0.02)
    assert not ok and "OUT" in lines[0]


def test_thread_count_and_cpu_capability_differences_rule_out_identical_bits():
    """Reduction order depends on the intra-op thread count and on the SIMD kernels."""
    env = {
        "python": "3.11.7",
        "torch": "2.14.1",
        "numpy": "2.4.6",
        "machine": "x86_64",
        "world_size": 1,
        "num_threads": 2,
        "device": {"type": "cpu"},
        "cpu": {"capability": "AVX512"},
    }
    same = {"environment": env, "lock_sha256": "x"}
    assert rerun.environment_differences(same, same) == ([], [])
    fewer = {"environment": {**env, "num_threads": 1}, "lock_sha256": "x"}
    blocking, _ = rerun.environment_differences(same, fewer)
    assert blocking == ["thread count: 2 -> 1"]
    avx2 = {
        "environment": {**env, "cpu": {"capability": "AVX2"}},
        "lock_sha256": "x",
    }
    blocking, _ = rerun.environment_differences(same, avx2)
    assert blocking == ["cpu capability: AVX512 -> AVX2"]


# ------------------------------------------------------------------------------ secrets


def test_no_secret_reaches_the_run_or_the_archive(archived, tmp_path):
    run_dir, archive, _ = archived
    assert all(MARKER in v for v in SECRETS.values())
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert MARKER.encode() not in path.read_bytes(), path
    with tarfile.open(archive) as tar:
        raw = b"".join(
            tar.extractfile(m).read() + m.name.encode() for m in tar.getmembers() if m.isreg()
        )
    assert MARKER.encode() not in raw
    top = unpack(archive, tmp_path)
    checked = 0
    for path in top.rglob("*"):
        if path.is_file():
            checked += 1
            assert MARKER.encode() not in path.read_bytes(), path
    assert checked > 20 and (top / "env/pip-freeze.txt").stat().st_size > 0
    # control: the run's environment did reach the record, through the allowlist only
    record = json.loads((run_dir / "run.json").read_text())
    assert record["environment"]["env"]["SLURM_JOB_ID"] == "job-4242"


def test_a_corrupt_compressed_stream_is_refused(archived, tmp_path, capsys):
    _, archive, _ = archived
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "raw.tar.gz").write_bytes(bytes(data))
    rc = repro.main([str(tmp_path / "raw.tar.gz"), "--extract-dir", str(tmp_path / "t")])
    assert rc == 2 and "corrupt" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


# ------------------------------------------------------------------------------ layouts


def test_an_archive_repacked_with_dot_prefixes_is_accepted(archived, tmp_path):
    """`cd <top> && tar -czf x.tar.gz .`: members are ./run/..., no top folder."""
    _, archive, _ = archived
    top = unpack(archive, tmp_path / "u")
    repacked = tmp_path / "repacked.tar.gz"
    if shutil.which("tar"):
        subprocess.run(["tar", "-czf", str(repacked), "."], cwd=top, check=True)
    else:  # pragma: no cover - tarfile writes the same ./ layout
        with tarfile.open(repacked, "w:gz") as tar:
            tar.add(top, arcname=".")
    with tarfile.open(repacked) as tar:
        assert any(m.name.startswith("./run/") for m in tar.getmembers())
    target = tmp_path / "target"
    assert repro.main([str(repacked), "--extract-dir", str(target), "--verify-only"]) == 0
    (root,) = target.iterdir()
    assert (root / "run/run.json").read_bytes() == (top / "run/run.json").read_bytes()
    # a file added while repacking is still caught
    (top / "run/extra.txt").write_text("x")
    subprocess.run(["tar", "-czf", str(tmp_path / "extra.tar.gz"), "."], cwd=top, check=True)
    assert repro.main([str(tmp_path / "extra.tar.gz"), "--verify-only"]) == 2


# ------------------------------------------------------------------------------ history


def test_an_interrupted_archive_compares_the_epochs_it_completed(archived, tmp_path, capsys):
    run_dir, _, _ = archived
    copy = tmp_path / "interrupted"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))
    record = json.loads((copy / "run.json").read_text())
    for key in ("finished_at", "final_weights_sha256", "final_metrics", "epochs_completed"):
        record.pop(key, None)
    (copy / "run.json").write_text(json.dumps({**record, "status": "interrupted"}))
    for name in ("fingerprints.jsonl", "metrics.jsonl"):
        first = (copy / name).read_text().splitlines()[0]
        (copy / name).write_text(first + "\n")
    path, _ = arch.build(copy, tmp_path / "out", allow_incomplete=True)
    assert repro.main([str(path), "--trust", "--epochs", "2"]) == 2
    assert "has 1 completed epoch(s)" in capsys.readouterr().err
    proc = tool(
        "reproduce.reproduce",
        str(path),
        "--trust",
        "--runs-dir",
        str(tmp_path / "runs"),
        cwd=tmp_path,
    )
    out = proc.stdout
    assert proc.returncode in (0, 3), out[-3000:] + proc.stderr[-3000:]
    assert "epoch counts differ" not in out and "DIVERGED" not in out
    assert "REPRODUCED (bitwise): epoch(s) 1-1" in out or "(bits match anyway)" in out
    assert "(run interrupted: comparing those)" in out


def test_a_replay_never_inherits_a_recorded_resume():
    from reprotrain.tools.reproduce import replay_plan

    cfg = {"resume": "auto", "dataset": {"name": "synthetic"}}
    legs = replay_plan.plan_replay(cfg, [])
    job = replay_plan.JobPlan("", None, cfg, legs, {}, ["trainer.device=cpu"])
    cmd = rerun.rerun_command(Path("/c"), Path("/r"), job, None, leg=legs[0])
    assert "resume=null" in cmd and "resume=auto" not in cmd


def test_plan_replay_undoes_changes_then_replays_them_at_their_steps():
    final = {"trainer": {"epochs": 4, "lr": 0.1}}
    resumes = [
        {"global_step": 5, "overrides": {}},  # a plain resume: no leg of its own
        {"global_step": 8, "overrides": {"trainer.epochs": {"from": 2, "to": 3}}},
        {"global_step": 12, "overrides": {"trainer.epochs": {"from": 3, "to": 4}}},
    ]
    legs = replay_plan.plan_replay(final, resumes)
    assert [leg.config["trainer"]["epochs"] for leg in legs] == [2, 3, 4]
    assert [leg.stop_at_global_step for leg in legs] == [8, 12, None]
    assert [leg.resume for leg in legs] == [False, True, True]
    assert legs[1].changes == {"trainer.epochs": 3}
    assert final["trainer"]["epochs"] == 4, "the input is not modified"
    # --epochs: legs starting at or after the last compared step are dropped
    short = replay_plan.plan_replay(final, resumes, until_global_step=8)
    assert len(short) == 1 and short[0].stop_at_global_step is None
    # nothing to replay: one fresh leg
    assert len(replay_plan.plan_replay(final, [{"global_step": 3}])) == 1


@pytest.mark.parametrize(
    "resumes, expect",
    [
        ([{"global_step": 4, "overrides": {"trainer.epochs": 3}}], "previous values"),
        ([{"global_step": 4, "overrides": {"trainer.epochs": {"from": 2, "to": 9}}}], "has 4"),
        ([{"global_step": 4, "overrides": {"nope.key": {"from": 1, "to": 2}}}], "not in"),
        (
            [
                {"global_step": 9, "overrides": {"trainer.epochs": {"from": 2, "to": 3}}},
                {"global_step": 4, "overrides": {"trainer.epochs": {"from": 3, "to": 4}}},
            ],
            "out of order",
        ),
    ],
)
def test_plan_replay_names_what_it_cannot_replay(resumes, expect):
    with pytest.raises(replay_plan.NotReplayable, match=expect):
        replay_plan.plan_replay({"trainer": {"epochs": 4}}, resumes)


# ------------------------------------------------------------------------------ quoting


def _make_ready() -> bool:
    if shutil.which("make") is None:
        return False
    # Never let a test install the venv: only run make when its stamp is up to date.
    stamp = subprocess.run(["make", "-q", ".venv/.installed"], cwd=REPO, capture_output=True)
    return stamp.returncode == 0


@pytest.mark.skipif(not _make_ready(), reason="needs make and an installed .venv")
def test_make_resume_continues_a_run_whose_dir_needs_quoting(archived, tmp_path):
    """`make resume "RUN=<dir with a space, a comma, quotes, brackets and ü>"`, bitwise."""
    run_dir, _, _ = archived
    copy = tmp_path / AWKWARD
    shutil.copytree(run_dir, copy)
    steps = sorted((copy / "checkpoints").glob("step-*.pt"))
    assert len(steps) >= 2, "the epoch-1 checkpoint is kept"
    for later in steps[1:]:
        later.unlink()
    (copy / "checkpoints" / "best.pt").unlink(missing_ok=True)
    record = json.loads((copy / "run.json").read_text())
    (copy / "run.json").write_text(json.dumps({**record, "status": "interrupted"}))
    proc = subprocess.run(
        ["make", "-s", "resume", f"RUN={copy}"],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    resumed = json.loads((copy / "run.json").read_text())
    assert resumed["status"] == "completed"
    assert resumed["final_weights_sha256"] == record["final_weights_sha256"]
    assert not (copy / ".hydra" / "resume.yaml").exists(), "the run dir holds no tool files"


# ------------------------------------------------------------------------------ signals


def test_sigterm_to_reproduce_reaches_the_rerun_and_leaves_no_temp_dir(archived, tmp_path):
    import signal
    import time

    _, archive, _ = archived
    tmp, runs = tmp_path / "tmp", tmp_path / "runs"
    tmp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "reprotrain.tools.reproduce.reproduce", str(archive), "--trust",
         "--runs-dir", str(runs)],
        cwd=tmp_path, env=base_env(TMPDIR=str(tmp)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while True:  # the re-run is training (its stop handler is installed once data is built)
        found = [p for p in runs.glob("*/run.json") if "data_fingerprint" in p.read_text()]
        if found:
            break
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    new_run = found[0].parent
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == rerun.EXIT_STOPPED, out[-2000:] + err[-2000:]
    assert last_line(out).startswith("INTERRUPTED by SIGTERM: re-run leg 0 exited 75")
    report = json.loads((new_run / rerun.REPORT).read_text())
    assert report["status"] == "interrupted" and report["exit_code"] == 75
    assert json.loads((new_run / "run.json").read_text())["status"] == "interrupted"
    assert not list(tmp.glob("reprotrain-*")), "the extracted archive is gone"
    from reprotrain.run.mutex import held_by

    assert held_by(new_run) is None, "the re-run is not left running"
