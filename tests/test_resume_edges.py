"""Resume at its edges: history that reproduce replays, refusals that write nothing, forks,
and a completed run that stays as it was."""

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, assert_ok, jsonl, run_json, tool, train
from reprotrain.resume.guard import FORK_KEEPS


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    copy = Path(shutil.copytree(run_dir, tmp_path / "copy"))
    (copy / ".lock").unlink(missing_ok=True)
    return copy


def test_resume_that_extends_the_schedule_is_recorded_and_reproduces_bitwise(tmp_path):
    run = tmp_path / "run"
    assert_ok(train(run, "trainer.epochs=1"))
    first_id = run_json(run)["experiment_id"]
    assert_ok(tool("runs.resume", str(run), "trainer.epochs=2"))
    record = run_json(run)
    entry = record["resumes"][-1]
    assert entry["global_step"] == 8
    assert entry["overrides"]["trainer.epochs"] == {"from": 1, "to": 2}
    # the steps before the extension replayed under the schedule they ran with (1 epoch)
    assert entry["bitwise_guarantee"] is True and entry["verified"].endswith("identical")
    assert record["experiment_id"] != first_id  # follows the config that ran
    assert record["experiment_id"].startswith(record["config_sha256"][:8])
    # the schedule was stretched mid-run: not the 2-epoch run from scratch's identity
    assert record["extended_from"] == [{"trainer.epochs": 1, "global_step": 8}]
    out = tmp_path / "archives"
    assert_ok(tool("archive.archive", str(run), "--out-dir", str(out)))
    archive = next(out.glob("*.tar.gz"))
    proc = tool("reproduce.reproduce", str(archive), "--trust", "--runs-dir", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "REPRODUCED (bitwise)" in proc.stdout


def test_completed_run_says_already_completed_and_rewrites_nothing(tmp_path, reference_run):
    run = copy_of(reference_run, tmp_path)
    before = snapshot(run)
    proc = tool("runs.resume", str(run))
    assert proc.returncode == 0 and "already completed" in proc.stderr
    assert snapshot(run) == before


def test_resume_with_checkpoints_gone_refuses_and_touches_nothing(tmp_path, reference_run):
    run = copy_of(reference_run, tmp_path)
    shutil.rmtree(run / "checkpoints")
    before = snapshot(run)
    proc = tool("runs.resume", str(run))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no checkpoint" in lines[0] and "Traceback" not in proc.stderr
    assert snapshot(run) == before


def test_checkpoints_without_a_record_are_refused_in_one_line(tmp_path, reference_run):
    run = tmp_path / "orphan"
    shutil.copytree(reference_run / "checkpoints", run / "checkpoints")
    proc = train(run, "trainer.checkpoint_every_steps=3", "resume=auto")
    assert proc.returncode == 2
    assert "no run.json" in proc.stderr and "Traceback" not in proc.stderr
    assert not (run / "run.json").exists()


def test_resume_from_another_runs_checkpoint_forks_a_new_run(tmp_path, reference_run):
    ckpt = reference_run / "checkpoints" / "step-00000012.pt"
    fork = tmp_path / "fork"
    assert_ok(train(fork, "trainer.checkpoint_every_steps=3", f"resume={ckpt}"))
    record = run_json(fork)
    assert record["status"] == "completed" and record["forked_from"]["global_step"] == 12
    assert len(record["forked_from"]["sha256"]) == 64 and record["resumes"] == []
    assert record["final_weights_sha256"] == run_json(reference_run)["final_weights_sha256"]
    assert jsonl(fork / "fingerprints.jsonl") == jsonl(reference_run / "fingerprints.jsonl")


def test_a_fork_with_another_config_is_refused_as_docs_resume_md_says(tmp_path, reference_run):
    """docs/resume.md presents the fork (``resume=<checkpoint> hydra.run.dir=<new dir>``) as
    the parent's config continued: a fork that changes another key is refused in one line
    that says so (not a resume's "start a new run instead"), and nothing is written."""
    ckpt = reference_run / "checkpoints" / "step-00000012.pt"
    fork = tmp_path / "fork"
    proc = train(fork, "trainer.checkpoint_every_steps=3", "optimizer.lr=0.05", f"resume={ckpt}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: refusing to fork {ckpt}: config differs from the recorded")
    assert line.endswith(f"{FORK_KEEPS}; to train with another config, start a new run")
    assert not fork.exists()
    docs = " ".join((REPO / "docs" / "resume.md").read_text().split())
    assert f"{FORK_KEEPS}; to train with another config, start a new run" in docs


def test_a_yaml_syntax_error_in_conf_is_named_with_file_and_line(tmp_path):
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    (conf / "broken.yaml").write_text("_target_: x.Y\nwidths: [1, 2\n")
    search = f"hydra.searchpath=[file://{tmp_path / 'conf'},pkg://reprotrain.selfcheck.conf]"
    proc = train(tmp_path / "run", search, "model=broken")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "YAML" in lines[0] and "broken.yaml:" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


def test_stop_at_global_step_checkpoints_there_and_exits_75(tmp_path, reference_run):
    run = tmp_path / "leg"
    proc = train(run, "trainer.checkpoint_every_steps=3", "trainer.stop_at_global_step=5")
    assert proc.returncode == 75
    assert (run / "checkpoints" / "step-00000005.pt").is_file()
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"
    assert_ok(train(run, "trainer.checkpoint_every_steps=3", "resume=auto"))
    assert run_json(run)["final_weights_sha256"] == run_json(reference_run)["final_weights_sha256"]


@pytest.mark.slow  # its unit: test_what_a_completed_run_has_left_to_run
def test_a_run_that_ended_at_stop_after_epoch_is_completed_until_a_resume_asks_for_more(
    tmp_path,
):
    """It trained one more epoch on each resume (issue 34.5). Now a resume with the same
    settings is "already completed", exit 0, nothing rewritten; one that lifts the stop
    (trainer.stop_after_epoch=0) continues to trainer.epochs."""
    run = tmp_path / "run"
    assert_ok(train(run, "trainer.stop_after_epoch=1"))
    before = (run / "run.json").read_bytes(), (run / "metrics.jsonl").read_bytes()
    again = train(run, "trainer.stop_after_epoch=1", "resume=auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already completed (1 of 2 epochs done, trainer.stop_after_epoch=1)" in again.stderr
    assert ((run / "run.json").read_bytes(), (run / "metrics.jsonl").read_bytes()) == before
    assert_ok(train(run, "trainer.stop_after_epoch=0", "resume=auto"))
    assert run_json(run)["epochs_completed"] == 2


@pytest.mark.parametrize(
    "loop, trainer, why",
    [
        ({"epoch": 3}, {"epochs": 2}, "2 of 2 epochs done"),
        ({"epoch": 3}, {"epochs": 4}, None),  # trainer.epochs extended: it continues
        ({"epoch": 2}, {"epochs": 4, "stop_after_epoch": 1}, "1 of 4 epochs done, trainer.stop"),
        ({"epoch": 2}, {"epochs": 4, "stop_after_epoch": 3}, None),
        ({"epoch": 2, "early_stopped": {"epoch": 1}}, {"epochs": 9}, "early stopping ended it"),
    ],
)
def test_what_a_completed_run_has_left_to_run(loop, trainer, why):
    from reprotrain.resume.guard import already_completed

    got = already_completed(loop, trainer)
    assert got is None if why is None else got.startswith(why)


def test_a_checkpoint_written_before_a_loop_field_existed_is_refused_in_one_line():
    """Adding a loop-state field made resuming an older checkpoint a bare ``KeyError``: now
    the missing entries are named in one line, and nothing of the checkpoint is loaded."""
    import torch

    from reprotrain.errors import CheckpointError
    from reprotrain.state import TrainerState
    from test_microbatch import tiny

    state = TrainerState(*tiny(), torch.device("cpu"))
    old = state.state_dict()
    del old["loop"]["best_epoch"], old["scaler"]  # as an older version wrote it
    state.loop.global_step = 7
    with pytest.raises(CheckpointError) as refused:
        state.load_state_dict(old)
    assert str(refused.value).startswith("the checkpoint has no scaler, loop.best_epoch:")
    assert "\n" not in str(refused.value) and state.loop.global_step == 7
    state.load_state_dict(TrainerState(*tiny(), torch.device("cpu")).state_dict())  # a whole one
