"""The code a run started with is recorded (``code_sha256``) and compared at every resume:
a resume under other code keeps going but its history line does not promise the bits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MICRO, REPO, TINY, assert_ok, base_env, run_json, tool, train
from reprotrain.repro.gitinfo import code_sha256
from reprotrain.resume.guard import code_differences


def project(root: Path) -> Path:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "pkg" / "model.py").write_text("WIDTH = 8\n")
    (root / "conf").mkdir()
    (root / "conf" / "train.yaml").write_text("epochs: 2\n")
    (root / "README.md").write_text("a readme\n")
    return root


def test_the_code_digest_follows_source_and_config_and_nothing_else(tmp_path):
    root = project(tmp_path / "p")  # no git: the digest holds in a container too
    start = code_sha256(root)
    assert start == code_sha256(root)
    (root / "README.md").write_text("edited\n")
    (root / "outputs").mkdir()
    (root / "outputs" / "run.json").write_text("{}\n")
    (root / "src" / "pkg" / "__pycache__").mkdir()
    (root / "src" / "pkg" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    assert code_sha256(root) == start  # docs, outputs and bytecode are not code
    (root / "src" / "pkg" / "model.py").write_text("WIDTH = 16\n")
    edited = code_sha256(root)
    assert edited != start
    (root / "src" / "pkg" / "helper.py").write_text("X = 1\n")  # untracked code counts too
    assert code_sha256(root) != edited
    (root / "src" / "pkg" / "helper.py").unlink()
    (root / "conf" / "train.yaml").write_text("epochs: 3\n")
    assert code_sha256(root) not in (start, edited)


def test_a_module_reached_through_a_symlink_is_digested_by_its_content(tmp_path):
    """A user module linked into src/ (a file or a whole directory) and edited before a
    resume changed nothing: the digest hashed the link's text (issue 34)."""
    root = project(tmp_path / "p")
    elsewhere = tmp_path / "shared_code"
    (elsewhere / "lib").mkdir(parents=True)
    (elsewhere / "layers.py").write_text("DEPTH = 3\n")
    (elsewhere / "lib" / "blocks.py").write_text("KIND = 'a'\n")
    (root / "src" / "pkg" / "layers.py").symlink_to(elsewhere / "layers.py")
    (root / "src" / "lib").symlink_to(elsewhere / "lib", target_is_directory=True)
    (root / "src" / "loop").symlink_to(root / "src", target_is_directory=True)  # a loop ends
    start = code_sha256(root)
    (elsewhere / "layers.py").write_text("DEPTH = 4\n")
    after_file = code_sha256(root)
    assert after_file != start
    (elsewhere / "lib" / "blocks.py").write_text("KIND = 'b'\n")
    assert code_sha256(root) not in (start, after_file)


def test_a_resume_names_changed_or_unrecorded_code_and_is_silent_when_it_is_the_same():
    assert code_differences("a" * 64, "a" * 64) == []
    (line,) = code_differences("a" * 64, "b" * 64)
    assert line.startswith("code: the source") and "aaaaaaaaaaaa -> bbbbbbbbbbbb" in line
    (line,) = code_differences(None, "b" * 64)
    assert "not compared" in line


@pytest.mark.slow
def test_a_resume_under_changed_code_is_recorded_as_not_bitwise(tmp_path):
    """The run's start digest is edited to stand for other code (the checkout cannot change
    under a running test suite): the resume completes and its line says why it is not
    bitwise; `make reproduce` then lists it as a reason the replay is not comparable."""
    run = tmp_path / "run"
    stopped = train(run, "trainer.checkpoint_every_steps=3", "trainer.stop_at_global_step=5")
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    record = json.loads((run / "run.json").read_text())
    record["code_sha256"] = "0" * 64
    (run / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    assert_ok(train(run, "trainer.checkpoint_every_steps=3", "resume=auto", env=base_env()))
    (entry,) = run_json(run)["resumes"]
    assert entry["bitwise_guarantee"] is False
    assert any(m.startswith("code: the source") for m in entry["mismatch"])
    from reprotrain.tools.reproduce.rerun import not_comparable_reasons

    (reason,) = not_comparable_reasons(run_json(run))
    assert "code: the source" in reason


def test_a_resume_keeps_the_starts_data_fingerprint_and_names_a_change():
    """Image files edited between a kill and a resume: run.json's data_fingerprint was
    overwritten with the new data's and the resume called bitwise (issue 34)."""
    from reprotrain.resume.guard import data_differences
    from reprotrain.start import Fresh, Resume

    class Record:
        def __init__(self) -> None:
            self.updates: list[dict] = []

        def update(self, **fields) -> None:
            self.updates.append(fields)

    kept, fresh = Record(), Record()
    resume = Resume(point=None)
    resume.record_data(kept, {"sha256": "b" * 64})
    assert kept.updates == [] and resume.data_now == {"sha256": "b" * 64}
    Fresh().record_data(fresh, {"sha256": "a" * 64})
    assert fresh.updates == [{"data_fingerprint": {"sha256": "a" * 64}}]
    assert data_differences({"sha256": "a" * 64}, {"sha256": "a" * 64}) == []
    (line,) = data_differences({"sha256": "a" * 64}, {"sha256": "b" * 64})
    assert line.startswith("data: the dataset changed since the run started")
    assert data_differences(None, {"sha256": "b" * 64})[0].endswith("was not compared")


def test_a_module_imported_from_outside_src_is_digested_and_an_edit_is_named(tmp_path, monkeypatch):
    """Issue 34.4: a user module on PYTHONPATH (here tmp_path), or linked from there, edited
    between a kill and a resume, was compared by nobody: code_sha256 covers src/ and conf/."""
    import importlib
    import sys

    from reprotrain.resume.guard import imported_differences
    from reprotrain.start.provenance import imported_code

    real = tmp_path / "elsewhere" / "user_layers.py"
    real.parent.mkdir()
    real.write_text("SCALE = 1.0\n")
    (tmp_path / "linked_layers.py").symlink_to(real)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("linked_layers",):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importlib.import_module("linked_layers")
    start = imported_code()
    key = str(tmp_path / "linked_layers.py")
    assert key in start and not any("site-packages" in k for k in start)
    assert not any(k.startswith("src/") for k in start)  # those are code_sha256's
    assert imported_differences(start, imported_code()) == []
    real.write_text("SCALE = 2.0\n")  # the link's target edited: the link's text is the same
    assert imported_differences(start, imported_code()) == [
        f"code: imported from outside src/ and changed since the run started: {key}"
    ]
    assert imported_differences(None, start)[0].startswith("code: the run's start recorded no")


@pytest.mark.slow
def test_a_reproduce_names_a_module_the_archived_run_imported_from_outside_src(tmp_path):
    """Code on the run's PYTHONPATH (here a sitecustomize.py, which Python runs at every
    start) is in no archive, and a reproduce's re-run never gets the archived PYTHONPATH:
    its re-run imports other code, so the verdict is NOT COMPARABLE with the module named,
    by the same comparison a resume makes (issue 34.4)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sitecustomize.py").write_text("SCALE = 1.0  # imported at every start\n")
    run = tmp_path / "run"
    assert_ok(train(run, *MICRO, *TINY, micro=False, env=base_env(PYTHONPATH=str(outside))))
    assert str(outside / "sitecustomize.py") in run_json(run)["imported_code"]

    assert_ok(tool("archive.archive", str(run), "--out-dir", str(tmp_path / "archives")))
    (archive,) = (tmp_path / "archives").glob("*.tar.gz")
    runs = str(tmp_path / "runs")
    proc = tool("reproduce.reproduce", str(archive), "--trust", "--runs-dir", runs)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = proc.stdout.strip().splitlines()[-1]
    assert verdict.startswith("NOT COMPARABLE")
    assert "imported from outside src/ and changed from the archived run's" in verdict
    assert "sitecustomize.py" in verdict


def test_every_replayed_job_names_a_module_the_archived_run_imported_from_outside_src(tmp_path):
    """One per-job check for a run and each job of a sweep (rerun._rerun_record): a module
    the archived run imported from outside src/ that the re-run did not is a reason, not a
    silent pass (before, a sweep's jobs were not compared)."""
    from reprotrain.tools.reproduce import rerun

    (tmp_path / "run.json").write_text(json.dumps({"imported_code": {}}))
    done = rerun._rerun_record(tmp_path, {"imported_code": {"/x/sitecustomize.py": "a" * 64}})
    assert any(
        "imported from outside src/ and changed from the archived run's: /x/sitecustomize.py" in r
        for r in done.reasons
    ), done.reasons


# ------------------------------------------- what counts as dirty (docs/run-directory.md)


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo),
                          *args], capture_output=True, text=True, check=True)  # fmt: skip
    return out.stdout


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


RECORD = json.dumps({"status": "completed", "experiment_id": "x"})
#: A run directory as the trainer leaves it: its record, Hydra's, a log, a checkpoint.
RUN_FILES = {"run.json": RECORD, ".hydra/config.yaml": "a: 1\n", ".hydra/overrides.yaml": "[]\n",
             "train.log": "log\n", "checkpoints/step-00000003.pt": "x"}  # fmt: skip


def _run_dir(rel: str, **changes: str) -> dict[str, str]:
    return {f"{rel}/{name}": text for name, text in {**RUN_FILES, **changes}.items()}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize(
    ("files", "dirty", "counted"),
    [
        ({}, False, []),
        (_run_dir("runs/blobs-v1"), False, []),  # the reported case: a run dir in the project
        (_run_dir("a/b/c/deep"), False, []),  # anywhere
        (_run_dir("runs/now", **{"run.json": '{"status": "running"}'}), False, []),  # starting
        ({**_run_dir("sw/s1/0"), **_run_dir("sw/s1/1"), "sw/s1/multirun.yaml": "x: 1\n",
          "sw/s1/.submitit/1/log": "l"}, False, []),  # a sweep: its record and its jobs
        ({"notes.txt": "n"}, True, ["notes.txt"]),  # an untracked file outside code and conf
        ({**_run_dir("runs/r"), "notes.txt": "n"}, True, ["notes.txt"]),
        ({"src/pkg/extra.py": "E = 1\n"}, True, ["src/pkg/extra.py"]),  # the user's code
        ({"conf/extra.yaml": "e: 1\n"}, True, ["conf/extra.yaml"]),  # the user's config
        # not by name: a folder called outputs/ with no record, a run.json of another tool
        ({"outputs/x/.hydra/config.yaml": "a\n", "outputs/x/app.log": "l"}, True,
         ["outputs/x/.hydra/config.yaml", "outputs/x/app.log"]),
        ({"o/run.json": '{"anything": 1}', "o/f": "x"}, True, ["o/f", "o/run.json"]),
        ({"m/multirun.yaml": "x: 1\n", "m/0/a.log": "l"}, True, ["m/0/a.log", "m/multirun.yaml"]),
    ],
)  # fmt: skip
def test_what_counts_as_dirty_framework_outputs_never_user_files_always(
    tmp_path, files, dirty, counted
):
    """Was: a clean committed clone trained with hydra.run.dir=runs/blobs-v1 recorded
    git.dirty true (its own .hydra/*.yaml untracked), and so did every later run."""
    from reprotrain.repro.gitinfo import git_info

    repo = project(tmp_path / "repo")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    _plant(repo, files)
    info, diff = git_info(repo)
    assert info["dirty"] is dirty, info
    assert [u["path"] for u in info["untracked"]] == counted
    assert diff == ""


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_tracked_change_is_dirty_with_or_without_run_dirs(tmp_path):
    from reprotrain.repro.gitinfo import git_info

    repo = project(tmp_path / "repo")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    _plant(repo, _run_dir("runs/r"))
    (repo / "src" / "pkg" / "model.py").write_text("WIDTH = 9\n")
    info, diff = git_info(repo)
    assert info["dirty"] is True and "+WIDTH = 9" in diff
    assert info["outputs_not_counted"] == ["runs/r"] and info["untracked"] == []


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_runs_in_a_clean_committed_project_record_it_clean_run_after_run(tmp_path):
    """The reported case end to end: a copy of this project committed clean, two runs with
    hydra.run.dir=runs/blobs-v1 and -v2 inside it; each records git.dirty false."""
    clone = tmp_path / "clone"
    tracked = _git(REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for rel in filter(None, tracked.split("\0")):
        if (REPO / rel).is_file() and not rel.startswith("tests/"):
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, clone / rel)
    _git(clone, "init", "-q")
    _git(clone, "add", ".")
    _git(clone, "commit", "-qm", "clean")
    env = base_env(PYTHONPATH=str(clone / "src"))
    for name in ("blobs-v1", "blobs-v2"):
        proc = subprocess.run([sys.executable, "-m", "reprotrain.train", *MICRO, *TINY,
                               f"hydra.run.dir=runs/{name}"], cwd=clone, env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert_ok(proc)
        git = run_json(clone / "runs" / name)["git"]
        assert git["dirty"] is False and git["untracked"] == [], git
        assert "+dirty" not in run_json(clone / "runs" / name)["experiment_id"]
    assert _git(clone, "status", "--porcelain", "--", "src", "conf") == ""
