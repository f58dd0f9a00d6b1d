"""Trust before execution: ``make reproduce`` runs an archive's code only under rule a, b or c.

No training here: a small git repository stands in for "this repository", a hand-made run
record (with the real smoke config) is archived from it, and the archived package's
``__init__.py`` is the code under test. Planted code writes a marker file when imported;
a refusal must leave no marker (the code never ran) and nothing extracted.
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from conftest import REPO, base_env
from reprotrain.config import config_sha256
from reprotrain.errors import ReprotrainError
from reprotrain.hashing import file_sha256
from reprotrain.tools.archive import archive as arch
from reprotrain.tools.archive.archive_check import MANIFEST, SIGNATURE
from reprotrain.tools.reproduce import reproduce as repro
from reprotrain.tools.reproduce import rerun
from test_shown import SPOOF, assert_no_raw_control

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
SELFCHECK_CONF = "src/reprotrain/selfcheck/conf"  # the framework's own configs

BENIGN = (
    "import os\n"
    "if os.environ.get('TRUST_TEST_MARKER'):\n"
    "    open(os.environ['TRUST_TEST_MARKER'], 'w').write('ran')\n"
)


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@pytest.fixture(scope="module")
def job_config() -> str:
    """The composed self-check config, resolved, as the trainer would record it."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "reprotrain.train",
            "experiment=selfcheck",
            "--cfg",
            "job",
            "--resolve",
        ],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    (repo / "src/reprotrain").mkdir(parents=True)
    (repo / "src/reprotrain/__init__.py").write_text(BENIGN)
    # The real config trees (conf/ and the framework's own, on hydra.searchpath): rule (a)
    # allows the `_target_`s they name, per group.
    shutil.copytree(REPO / "conf", repo / "conf")
    shutil.copytree(REPO / SELFCHECK_CONF, repo / SELFCHECK_CONF)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    return repo


def fake_run(tmp_path: Path, repo: Path, config: str, diff: str = "") -> Path:
    run = tmp_path / "run"
    run.mkdir()
    commit = _git(repo, "rev-parse", "HEAD")
    record = {
        "status": "completed",
        "experiment_id": "trusttest",
        "seeds": {"base": 1, "source": "config"},
        "repro": {"level": "strict"},
        "git": {"commit": commit, "short": commit[:8], "dirty": bool(diff)},
        "data_fingerprint": {"sha256": "0" * 64},
        "epochs_completed": 1,
        "config_sha256": config_sha256(yaml.safe_load(config)),  # as the trainer writes it
    }
    (run / "run.json").write_text(json.dumps(record))
    (run / "config.resolved.yaml").write_text(config)
    row = {"epoch": 1, "global_step": 1, "weights_sha256": "0" * 64, "step_losses": [1.0]}
    (run / "fingerprints.jsonl").write_text(json.dumps(row) + "\n")
    (run / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train_loss": 1.0}) + "\n")
    if diff:
        (run / "git.diff").write_text(diff)
    return run


@pytest.fixture
def archived(tmp_path, repo, job_config, monkeypatch) -> Path:
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    path, _ = arch.build(fake_run(tmp_path, repo, job_config), tmp_path / "out", repo=repo)
    return path


def unpack(archive: Path, dest: Path) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    (top,) = dest.iterdir()
    return top


def repack(top: Path, out: Path) -> Path:
    """Regenerate MANIFEST.sha256 the way archive.py does, as an attacker would."""
    digests = {
        p.relative_to(top).as_posix(): file_sha256(p)
        for p in sorted(top.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, SIGNATURE)
    }
    (top / MANIFEST).write_text(arch.manifest_text(digests))
    with tarfile.open(out, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    return out


def planted(archive: Path, tmp_path: Path, marker: Path, rel: str = "src/reprotrain/__init__.py"):
    top = unpack(archive, tmp_path / "unpacked")
    target = top / "source" / rel
    target.write_text(target.read_text() + f"\nopen({str(marker)!r}, 'w').write('pwned')\n")
    return top


def reproduce(archive: Path, tmp_path: Path, repo: Path, *extra: str, monkeypatch=None):
    return repro.main(
        [
            str(archive),
            "--repo",
            str(repo),
            "--allow-data-drift",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--extract-dir",
            str(tmp_path / "x"),
            *extra,
        ]
    )


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_an_untouched_archive_of_a_commit_here_runs_under_rule_a(
    archived, tmp_path, repo, capsys, monkeypatch
):
    marker = tmp_path / "benign-ran"
    monkeypatch.setenv("TRUST_TEST_MARKER", str(marker))
    rc = reproduce(archived, tmp_path, repo)
    out = capsys.readouterr().out
    assert "trust    (a) source/ is commit" in out and "files identical" in out
    assert marker.read_text() == "ran", "the archived code ran"
    assert rc == rerun.EXIT_RERUN_FAILED  # the stand-in package has no trainer


def test_edited_source_with_a_regenerated_manifest_is_refused_before_any_code_runs(
    archived, tmp_path, repo, capsys
):
    marker = tmp_path / "PWNED"
    changed = repack(planted(archived, tmp_path, marker), tmp_path / "edited.tar.gz")
    assert repro.main([str(changed), "--verify-only"]) == 0, "the manifest matches"
    capsys.readouterr()
    rc = reproduce(changed, tmp_path, repo)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "refusing to run the archive's code (nothing extracted)" in line
    assert "differs from commit" in line and "TRUST=1" in line and "TRUSTED_SIGNERS" in line
    assert not marker.exists(), "no archived code ran"
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs").exists()


def test_trust_1_runs_it_and_says_so(archived, tmp_path, repo, capsys):
    marker = tmp_path / "PWNED"
    changed = repack(planted(archived, tmp_path, marker), tmp_path / "edited.tar.gz")
    reproduce(changed, tmp_path, repo, "--trust")
    out = capsys.readouterr().out
    assert "trust    (c) TRUST=1: the archive's code runs unchecked" in out
    assert marker.read_text() == "pwned", "TRUST=1 means exactly that"


@pytest.fixture
def keys(tmp_path) -> dict[str, Path]:
    if shutil.which("ssh-keygen") is None:
        pytest.skip("needs ssh-keygen (OpenSSH)")
    out = {}
    for who in ("alice", "mallory"):
        key = tmp_path / "keys" / who
        key.parent.mkdir(exist_ok=True)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", who, "-f", str(key)], check=True
        )
        allowed = tmp_path / "keys" / f"{who}.allowed"
        pub = (key.parent / f"{who}.pub").read_text().strip()
        allowed.write_text(f'{who}@example namespaces="reprotrain-archive" {pub}\n')
        out[who], out[f"{who}.allowed"] = key, allowed
    return out


def test_a_trusted_signature_runs_it_and_says_so(archived, tmp_path, repo, capsys, keys):
    marker = tmp_path / "signed-ran"
    top = planted(archived, tmp_path, marker)
    # The signer repacks and signs: `make archive SIGN=key` does the same on the original.
    repack(top, tmp_path / "unsigned.tar.gz")
    subprocess.run(
        ["ssh-keygen", "-Y", "sign", "-f", str(keys["alice"]), "-n", "reprotrain-archive",
         str(top / MANIFEST)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    signed = tmp_path / "signed.tar.gz"
    with tarfile.open(signed, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    reproduce(signed, tmp_path, repo, "--trusted-signers", str(keys["alice.allowed"]))
    out = capsys.readouterr().out
    assert "trust    (b) signed by alice@example" in out and "Good" in out
    assert marker.exists()


def test_a_signature_by_a_key_not_trusted_or_over_another_manifest_is_refused(
    archived, tmp_path, repo, capsys, keys
):
    marker = tmp_path / "PWNED"
    top = planted(archived, tmp_path, marker)
    repack(top, tmp_path / "a.tar.gz")
    subprocess.run(
        ["ssh-keygen", "-Y", "sign", "-f", str(keys["mallory"]), "-n", "reprotrain-archive",
         str(top / MANIFEST)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    signed = tmp_path / "mallory.tar.gz"
    with tarfile.open(signed, "w:gz") as tar:
        tar.add(top, arcname=top.name)
    rc = reproduce(signed, tmp_path, repo, "--trusted-signers", str(keys["alice.allowed"]))
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "(b) no: the archive's signing key is not in" in line
    assert not marker.exists()
    # Alice's signature over the original manifest does not cover an edited one.
    (top / "source/src/reprotrain/__init__.py").write_text("# edited after signing\n")
    (top / SIGNATURE).unlink()
    subprocess.run(
        ["ssh-keygen", "-Y", "sign", "-f", str(keys["alice"]), "-n", "reprotrain-archive",
         str(top / MANIFEST)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    resigned_then_edited = repack(top, tmp_path / "b.tar.gz")  # new manifest, old signature
    shutil.rmtree(tmp_path / "x", ignore_errors=True)
    rc = reproduce(resigned_then_edited, tmp_path, repo, "--trusted-signers",
                   str(keys["alice.allowed"]))  # fmt: skip
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "does not verify" in line


def test_a_patch_carried_by_the_archive_is_not_rule_a(tmp_path, repo, job_config, capsys,
                                                      monkeypatch):  # fmt: skip
    """source/ == commit + run/git.diff, but the diff is the archive's word, not this repo's."""
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    marker = tmp_path / "PWNED"
    (repo / "src/reprotrain/__init__.py").write_text(
        BENIGN + f"open({str(marker)!r}, 'w').write('pwned')\n"
    )
    diff = subprocess.run(
        ["git", "-C", str(repo), "diff", "--binary", "HEAD"], capture_output=True, text=True
    ).stdout
    _git(repo, "checkout", "--", ".")
    path, meta = arch.build(fake_run(tmp_path, repo, job_config, diff), tmp_path / "o", repo=repo)
    assert meta["source"]["diff_applied"]
    rc = reproduce(path, tmp_path, repo)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "uncommitted patch carried by the archive" in line
    assert "src/reprotrain/__init__.py" in line and not marker.exists()


def test_a_config_naming_an_outside_callable_is_not_rule_a(archived, tmp_path, repo, capsys):
    top = unpack(archived, tmp_path / "u")
    cfg = top / "run/config.resolved.yaml"
    cfg.write_text(cfg.read_text() + "evil:\n  _target_: os.system\n  command: touch PWNED\n")
    record = json.loads((top / "run/run.json").read_text())  # the forger re-hashes it too
    record["config_sha256"] = config_sha256(yaml.safe_load(cfg.read_text()))
    (top / "run/run.json").write_text(json.dumps(record))
    changed = repack(top, tmp_path / "cfg.tar.gz")
    rc = reproduce(changed, tmp_path, repo)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "evil._target_ names 'os.system'" in line


def test_a_commit_this_repository_lacks_is_not_rule_a(archived, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    _git(other, "init", "-q")
    _git(other, "commit", "-q", "--allow-empty", "-m", "x")
    rc = reproduce(archived, tmp_path, other)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "is not in" in line and "fetch it" in line


def test_archive_sign_writes_a_signature_that_verifies(tmp_path, repo, job_config, keys,
                                                      monkeypatch, capsys):  # fmt: skip
    """`make archive SIGN=key` end to end: the signature member checks out under rule b."""
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    run = fake_run(tmp_path, repo, job_config)
    path, meta = arch.build(run, tmp_path / "o", repo=repo, sign_key=keys["alice"])
    assert meta["signed"]
    with tarfile.open(path) as tar:
        assert any(m.name.endswith("/" + SIGNATURE) for m in tar.getmembers())
    other = tmp_path / "elsewhere"  # a checkout without the commit: only (b) can hold
    other.mkdir()
    _git(other, "init", "-q")
    reproduce(path, tmp_path, other, "--trusted-signers", str(keys["alice.allowed"]))
    assert "trust    (b) signed by alice@example" in capsys.readouterr().out


# ------------------------------------------------------------------ the config is code too


def archived_config(tmp_path: Path, repo: Path, job_config: str, monkeypatch, **groups) -> Path:
    """An untouched archive of a commit here whose config replaces the given groups."""
    import yaml

    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    cfg = yaml.safe_load(job_config)
    cfg.update(groups)
    run = fake_run(tmp_path, repo, yaml.safe_dump(cfg))
    path, _ = arch.build(run, tmp_path / "out", repo=repo)
    return path


def test_a_command_runner_target_under_rule_a_runs_nothing(
    tmp_path, repo, job_config, capsys, monkeypatch
):
    """source/ is an untouched commit (rule (a) holds for the code), but the config names a
    callable the package ships for running commands: refused before anything is built."""
    marker = tmp_path / "PWNED"
    runner = {
        "_target_": "reprotrain.tools.runs.resume.run_forwarding_signals",
        "cmd": ["sh", "-c", f"id > {marker}"],
        "env": {},
    }
    path = archived_config(tmp_path, repo, job_config, monkeypatch, model=runner)
    rc = reproduce(path, tmp_path, repo)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "refusing to run the archive's code (nothing extracted)" in line
    assert "(a) no: the archived config model._target_ names " in line
    assert "'reprotrain.tools.runs.resume.run_forwarding_signals'" in line and "never names" in line
    assert not marker.exists(), "no command ran"
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs").exists()


def test_a_builtins_dataset_target_is_refused_before_the_data_is_fingerprinted(
    tmp_path, repo, job_config, capsys, monkeypatch
):
    victim = tmp_path / "victim.rc"
    victim.write_text("# the victim's file\n")
    before = (victim.read_bytes(), victim.stat().st_mtime_ns)
    dataset = {
        "_target_": "builtins.print",
        "pwned": True,
        "file": {"_target_": "builtins.open", "file": str(victim), "mode": "a"},
    }
    path = archived_config(tmp_path, repo, job_config, monkeypatch, dataset=dataset)
    built = []
    monkeypatch.setattr(rerun, "check_data", lambda *a, **k: built.append(a))
    rc = reproduce(path, tmp_path, repo)
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "dataset._target_ names 'builtins.print'" in line
    assert (victim.read_bytes(), victim.stat().st_mtime_ns) == before, "nothing was opened"
    assert built == [], "the archived dataset config was not built before the trust verdict"


def test_rule_a_config_check_per_group_nested_partial_and_interpolations():
    from reprotrain.tools.reproduce import config_trust

    dirs = config_trust.trusted_conf_dirs(REPO)
    assert dirs == [REPO / "conf", REPO / "src/reprotrain/conf", REPO / SELFCHECK_CONF]
    allowed = config_trust.conf_targets(*dirs)
    assert "reprotrain.selfcheck.net.TinyConvNet" in allowed["model"]
    assert "torchvision.transforms.v2.RandomResizedCrop" in allowed["dataset"]  # a nested list
    assert "torch.optim.SGD" in allowed["optimizer"] and "torch.optim.SGD" not in allowed["model"]
    good = {
        "optimizer": {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1},
        "dataset": {
            "_target_": "reprotrain.data.image_folder.ImageFolderData",
            "train_transforms": [{"_target_": "torchvision.transforms.v2.Resize", "size": 8}],
        },
    }
    assert config_trust.problems(good, allowed, "c" * 40) == []
    bad = {
        "model": {"_target_": "torch.optim.SGD"},  # allowed elsewhere, not as a model
        "loss": {
            "_target_": "torch.nn.CrossEntropyLoss",
            "_args_": [{"_target_": "os.system", "_args_": ["id"]}],
        },
        "trainer": {"epochs": "${oc.decode:'{_target_: os.system}'}"},
        "name": "${oc.env:AWS_SECRET_ACCESS_KEY}",
        "scheduler": {"_target_": ["reprotrain.optim.cosine"]},
        "hydra": {"callbacks": {"x": {"_target_": "os.system"}}},
    }
    found = config_trust.problems(bad, allowed, "c" * 40)
    assert found[0] == "it sets top-level 'hydra'"
    text = "; ".join(found)
    expected_parts = (
        "model._target_ names 'torch.optim.SGD'",
        "loss._args_[0]._target_ names 'os.system'",
        "trainer.epochs is an interpolation",
        "name is an interpolation",
        "scheduler._target_ names",
        "not a plain dotted name",
    )
    for expected in expected_parts:
        assert expected in text, (expected, found)
    assert len(found) == 6, found  # the hydra subtree is refused once, as a whole


# ------------------------------------------- what an archive says, and what a verdict reads
# (issue 37): its strings are escaped on the terminal, its records are checked before any
# re-run, and archiving cleans up after a killed archiver and names the file a full disk hit.


def test_a_spoofing_experiment_id_prints_escaped_in_reproduce(archived, tmp_path, repo, capsys):
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


def test_a_resume_entry_of_the_wrong_shape_is_refused_before_the_rerun(
    archived,
    tmp_path,
    repo,
    capsys,
):
    top = unpack(archived, tmp_path / "unpacked")
    record = json.loads((top / "run" / "run.json").read_text())
    record["resumes"] = [{"global_step": 1, "bitwise_guarantee": False, "unrestored": 5}]
    (top / "run" / "run.json").write_text(json.dumps(record))
    rc = reproduce(repack(top, tmp_path / "bad.tar.gz"), tmp_path, repo)
    err = capsys.readouterr().err
    assert rc == 2 and "resumes[0].unrestored is 5" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists(), "nothing re-ran"


def fake_sweep_archive(tmp_path: Path, repo_dir: Path, config: str, study: dict | None = None,
                       overrides: str | None = None, monkeypatch=None) -> Path:  # fmt: skip
    """A sweep archive of two hand-made runs (test_trust's record), as make archive packs it."""
    from reprotrain.tools.archive import sweep_archive

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for n in range(2):
        (tmp_path / f"r{n}").mkdir()
        src = fake_run(tmp_path / f"r{n}", repo_dir, config)
        (src / ".hydra").mkdir()
        (src / ".hydra" / "overrides.yaml").write_text(overrides or yaml.safe_dump([f"x={n}"]))
        shutil.move(src, sweep / str(n))
    if study is not None:
        (sweep / "study.json").write_text(json.dumps(study))
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    path, _ = sweep_archive.build(sweep, tmp_path / "out", repo=repo_dir)
    return path


@pytest.mark.parametrize(
    ("study", "overrides", "says"),
    [
        ({"metric": "val_acc", "trials": "all"}, None, "study.json: metric_mode is missing"),
        (None, "{a: [1", "overrides.yaml: not a YAML list of overrides"),
        (None, yaml.safe_dump([{"a": 1}]), "overrides.yaml: not a YAML list of overrides"),
    ],
)
def test_a_malformed_sweep_record_is_refused_before_anything_reruns(
    tmp_path,
    repo,
    job_config,
    monkeypatch,
    capsys,
    study,
    overrides,
    says,
):
    path = fake_sweep_archive(tmp_path, repo, job_config, study, overrides, monkeypatch)
    capsys.readouterr()
    rc = reproduce(path, tmp_path, repo)
    err = capsys.readouterr().err
    assert rc == 2 and says in err and "Traceback" not in err, err
    assert not (tmp_path / "runs").exists(), "nothing re-ran"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_archivers_staging_dir_is_removed_by_the_next_archive(
    tmp_path,
    repo,
    job_config,
    monkeypatch,
):
    out = tmp_path / "out"
    stale = out / f".archive-{dead_pid()}-x1y2"
    (stale / "run").mkdir(parents=True)
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    arch.build(fake_run(tmp_path, repo, job_config), out, repo=repo)
    assert not stale.exists()
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_a_full_disk_while_archiving_names_the_file_being_written(
    tmp_path,
    repo,
    job_config,
    monkeypatch,
):
    def full(src, dst, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(src), None, str(dst))

    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    monkeypatch.setattr(shutil, "copy2", full)
    run = fake_run(tmp_path, repo, job_config)
    with pytest.raises(ReprotrainError) as failed:
        arch.build(run, tmp_path / "out", repo=repo)
    where = str(failed.value).split(" failed at ")[1].split(":")[0]
    assert ".archive-" in where and not where.startswith(str(run)), failed.value
