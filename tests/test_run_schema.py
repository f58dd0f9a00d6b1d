# ruff: noqa: F811  (the fixtures imported from test_trust are parameters here)
"""One schema for run.json, read through one reader: a record that contradicts itself is
refused in one line, exit 2, by ``make archive`` (run and sweep), ``make reproduce`` (run and
sweep) and every tool that reads a run directory; older and newer records stay readable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reprotrain.errors import RecordError
from reprotrain.run import readers
from reprotrain.run import schema as run_schema
from reprotrain.tools.archive import archive as arch
from reprotrain.tools.archive import sweep_archive
from test_trust import fake_run, job_config, one_error_line, repack, repo, reproduce, unpack  # noqa: F401

#: (change to a valid record, what the one line names)
CONTRADICTIONS = [
    ({"world_size": "two"}, "world_size 'two' is not a positive integer"),
    ({"world_size": 0}, "world_size 0 is not a positive integer"),
    ({"seeds": None}, "seeds is None, not an object"),
    ({"world_size": 1, "ranks": 7}, "ranks is 7, not a list of objects"),
    ({"world_size": 1, "ranks": [{"rank": i} for i in range(7)]},
     "world_size 1 but 7 rank(s) recorded"),
    ({"environment": {"gpu_env": [1]}}, "environment.gpu_env is a list, not an object"),
    ({"environment": {"gpu_env": {"CUBLAS_WORKSPACE_CONFIG": 4096}}},
     "environment.gpu_env is a dict, not an object of {variable name: string or null}"),
    ({"seeds": {"base": "1"}}, "seeds.base '1' is not an integer"),
    ({"repro": {"level": 3}}, "repro.level 3 is not a level name"),
    ({"epochs_completed": -1}, "epochs_completed -1 is not an integer >= 0"),
    ({"resumes": [{"global_step": "5"}]}, "resumes[0].global_step '5' is not an integer >= 0"),
    ({"resumes": [{"global_step": 5, "mismatch": [1]}]}, "resumes[0].mismatch is a list"),
    ({"git": {"commit": "c", "not_archived": 3}}, "git.not_archived is 3, not a list of strings"),
    ({"status": "done"}, "status 'done' is not one of running, completed"),
    ({"imported_code": {"/x/m.py": 5}}, "imported_code is a dict, not an object of {file: sha256}"),
]  # fmt: skip
VALID = {
    "status": "completed",
    "seeds": {"base": 1, "source": "config", "init": 3},
    "repro": {"level": "strict", "pythonhashseed": 0},
    "world_size": 2,
    "ranks": [{"rank": 0}, {"rank": 1}],
    "environment": {
        "gpu_env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVIDIA_TF32_OVERRIDE": None}
    },
    "epochs_completed": 1,
}


@pytest.mark.parametrize(("change", "named"), CONTRADICTIONS)
def test_a_record_that_contradicts_itself_is_named_in_one_line(change, named):
    with pytest.raises(RecordError) as e:
        run_schema.check({**VALID, **change}, "run.json")
    assert named in str(e.value) and "\n" not in str(e.value)


def test_older_and_newer_records_are_accepted():
    """No field older records lack is required; unknown keys (issue 24's CPU identity
    block) and the `portable` level are fine."""
    assert run_schema.problems({"status": "failed", "config_sha256": "ab"}) == []
    newer = {**VALID, "repro": {"level": "portable"}, "new_top_level_key": [1, 2]}
    newer["environment"] = {**VALID["environment"], "cpu": {"vendor": "x", "flags": ["avx2"]}}
    assert run_schema.problems(newer) == []
    assert run_schema.problems({"seeds": {}}, run_schema.REPLAY) == [
        "no integer seeds.base; the record is incomplete",
        "no repro.level; the record is incomplete",
    ]


@pytest.mark.parametrize(("change", "named"), CONTRADICTIONS[:6])
def test_archive_refuses_a_contradicting_record(tmp_path, repo, job_config, capsys, monkeypatch,
                                               change, named):  # fmt: skip
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    run = fake_run(tmp_path, repo, job_config)
    record = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**record, **change}))
    rc = arch.main([str(run), "--out-dir", str(tmp_path / "out"), "--repo", str(repo)])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and named in line and str(run / "run.json") in line
    assert not (tmp_path / "out").exists(), "nothing written"


def _with_record(archive: Path, tmp_path: Path, rel: str, change: dict) -> Path:
    """The archive with ``change`` merged into the run.json at ``rel``, manifest regenerated."""
    top = unpack(archive, tmp_path / "u")
    path = top / rel
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    return repack(top, tmp_path / "changed.tar.gz")


@pytest.mark.parametrize(("change", "named"), CONTRADICTIONS[:6])
def test_reproduce_refuses_a_contradicting_record_exit_2(
    tmp_path, repo, job_config, capsys, monkeypatch, change, named
):
    """Was: gpu_env [1] an AttributeError traceback and exit 1 (DIVERGED); "two" REPRODUCED."""
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    path, _ = arch.build(fake_run(tmp_path, repo, job_config), tmp_path / "out", repo=repo)
    changed = _with_record(path, tmp_path, "run/run.json", change)
    rc = reproduce(changed, tmp_path, repo, "--trust")
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and named in line and "run/run.json" in line
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs").exists()


def _sweep(tmp_path: Path, repo: Path, job_config: str) -> Path:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for i in range(2):
        fake_run(tmp_path, repo, job_config).rename(sweep / str(i))
    return sweep


def test_a_sweep_archive_and_its_replay_read_records_through_the_same_schema(
    tmp_path, repo, job_config, capsys, monkeypatch
):
    monkeypatch.setattr("reprotrain.tools.archive.pack.pip_freeze", lambda: "")
    sweep = _sweep(tmp_path, repo, job_config)
    path, _ = sweep_archive.build(sweep, tmp_path / "out", repo)
    changed = _with_record(path, tmp_path, "sweep/1/run.json", {"environment": {"gpu_env": [1]}})
    rc = reproduce(changed, tmp_path, repo, "--trust")
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "sweep/1/run.json: environment.gpu_env is a list" in line
    record = json.loads((sweep / "1/run.json").read_text())
    (sweep / "1/run.json").write_text(json.dumps({**record, "world_size": 0}))
    rc = arch.main([str(sweep), "--out-dir", str(tmp_path / "out2"), "--repo", str(repo)])
    line = one_error_line(capsys.readouterr().err)
    assert rc == 2 and "world_size 0 is not" in line and not (tmp_path / "out2").exists()


def test_every_reader_of_a_run_dir_applies_the_schema(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({**VALID, "world_size": "two"}))
    with pytest.raises(RecordError, match="world_size 'two' is not"):
        readers.read_run_json(run)
    with pytest.raises(RecordError, match="world_size 'two' is not"):
        readers.parse_record((run / "run.json").read_text(), "r")
