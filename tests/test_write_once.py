"""Write-once, everywhere (issue 26, points 4, 5 and 7): what a refused or finished start
leaves behind is exactly what was there, bytes and modification times, ``.hydra/`` included.

- a refused ``resume=auto`` and the "already completed" exit are decided before Hydra
  writes anything; a run that is continued keeps the ``.hydra/`` it started with;
- of two sweeps started at once into one directory, one runs and one is refused before it
  writes anything;
- a directory holding checkpoints but no ``run.json`` is refused for any start;
- a completed run is never reopened from an older checkpoint of its own (``train
  resume=<ckpt>``, ``reprotrain resume``), and a directory holding another run's files
  (metrics, config, fingerprints) but no ``run.json`` is never trained into (issue 45.6);
- ``make eval`` evaluates only checkpoints of the run (pruning's guard);
- ``make train NPROC=<bad>`` and an unbalanced quote in ``ARGS`` are one ``error:`` line.

One real run (the session's reference run, copied) and one one-job sweep; the rest reads.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml

import conftest
from conftest import REPO, TINY, assert_ok, base_env, run_json, train
from reprotrain.errors import CheckpointError, ReprotrainError
from reprotrain.quoting import hydra_override
from reprotrain.repro import checkpoint
from reprotrain.run import directory as run_dirs
from reprotrain.tools.runs import eval as evaluation


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file's bytes and every entry's modification time (a rewrite with the same bytes
    still shows)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        out[p.relative_to(root).as_posix()] = (
            p.read_bytes() if p.is_file() else "dir",
            st.st_mtime_ns,
        )
    return out


def one_error(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == code and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


@pytest.fixture
def old_run(reference_run, tmp_path) -> Path:
    run = tmp_path / "old run"
    shutil.copytree(reference_run, run)
    assert (run / ".hydra" / "config.yaml").is_file() and run_json(run)["status"] == "completed"
    return run


def test_refused_and_already_completed_resumes_leave_the_run_as_it_was(old_run):
    before = snapshot(old_run)
    done = train(old_run, "resume=auto")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "already completed" in done.stderr and "error" not in done.stderr
    assert snapshot(old_run) == before, "the 'already completed' exit rewrote something"
    line = one_error(train(old_run, "resume=auto", "seed.base=7"))
    assert "config differs from the recorded one in seed.base" in line
    assert snapshot(old_run) == before, "a refused resume rewrote something (.hydra/?)"


def test_a_continued_run_keeps_the_hydra_record_it_started_with(old_run):
    hydra = {k: v for k, v in snapshot(old_run).items() if k.startswith(".hydra")}
    assert_ok(train(old_run, "resume=auto", "trainer.epochs=3"))
    record = run_json(old_run)
    assert record["status"] == "completed" and record["epochs_completed"] == 3
    assert {k: v for k, v in snapshot(old_run).items() if k.startswith(".hydra")} == hydra


def test_a_dir_with_checkpoints_but_no_run_json_is_refused_for_any_start(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    run_dirs.refuse_reuse(run, None)  # an empty checkpoints/ holds nothing to protect
    (run / "checkpoints" / "step-00000003.pt").write_bytes(b"x")
    for resume in (None, "auto", str(run / "checkpoints" / "step-00000003.pt"), "/elsewhere.pt"):
        with pytest.raises(run_dirs.RunDirUsed, match=r"but no run\.json"):
            run_dirs.refuse_reuse(run, resume)
    (run / "run.json").write_text('{"status": "interrupted"}')
    run_dirs.refuse_reuse(run, "auto")  # with its record it is a run: resume continues it


def test_a_completed_run_is_never_reopened_from_an_older_checkpoint(old_run):
    """Before: status back to running, metrics.jsonl cut to one row, best.pt deleted."""
    before = snapshot(old_run)
    ckpts = checkpoint.list_step_checkpoints(old_run / "checkpoints")
    older = [p for p in ckpts if torch.load(p, weights_only=True)["loop"]["epoch_step"]]
    assert older, "the reference run keeps mid-epoch checkpoints"
    through_train = train(old_run, hydra_override("resume", older[0]))
    last = hydra_override("resume", older[-1])
    through_resume = conftest.resume(old_run, last, "trainer.epochs=3")
    for refused in (through_train, through_resume):
        line = one_error(refused)
        assert "is a completed run" in line and "never reopened" in line, line
        assert "fork it into a new directory" in line, line
        assert snapshot(old_run) == before, "a refused reopening rewrote something"


def test_a_dir_with_another_runs_files_but_no_run_json_is_never_trained_into(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"epoch": 1, "val_acc": 0.9}\n')
    (run / "config.resolved.yaml").write_text("name: someone\n")
    before = snapshot(run)
    line = one_error(train(run, *TINY))
    assert "holds metrics.jsonl, config.resolved.yaml but no run.json" in line, line
    assert snapshot(run) == before, "a refused start wrote into the directory"
    for name in run_dirs.RUN_FILES:  # each alone is refused, for every start
        alone = tmp_path / name.replace(".", "_")
        alone.mkdir()
        (alone / name).write_text("x")
        for how in (None, "auto", "/elsewhere.pt"):
            with pytest.raises(run_dirs.RunDirUsed, match=rf"holds {name} but no run\.json"):
                run_dirs.refuse_reuse(alone, how)


def test_a_sweep_dir_is_claimed_by_exactly_one_of_many_at_once(tmp_path):
    sweep = tmp_path / "sweep"
    results: list[str] = []

    def claim() -> None:
        try:
            run_dirs.claim_sweep_dir(sweep)
            results.append("won")
        except run_dirs.RunDirUsed as e:
            results.append(str(e))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("won") == 1, results
    assert all("another sweep" in r or "already holds a sweep" in r for r in results if r != "won")
    assert sorted(os.listdir(sweep)) == ["multirun.yaml"], "losers wrote nothing"


@pytest.mark.slow  # the default tier keeps the cheaper sibling test of this claim
def test_two_sweeps_started_at_once_into_one_dir_one_runs_one_is_refused(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "reprotrain.train", "--multirun", "experiment=selfcheck",
           *TINY, "seed.base=0", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    procs = [
        subprocess.Popen(
            cmd, cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [(*p.communicate(timeout=300), p.returncode) for p in procs]
    outs = [(code, out, err) for out, err, code in outs]
    codes = sorted(code for code, _, _ in outs)
    assert codes == [0, 2], [(c, err[-1500:]) for c, _, err in outs]
    loser = next(err for code, _, err in outs if code == 2)
    lines = [x for x in loser.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: hydra.sweep.dir={sweep} "), loser
    multirun = yaml.safe_load((sweep / "multirun.yaml").read_text())
    assert multirun["hydra"]["mode"] == "MULTIRUN", "the winner's own multirun.yaml"
    assert run_json(sweep / "0")["status"] == "completed" and not (sweep / "1").exists()


def _stray(run: Path, own: Path) -> Path:
    """A copy of ``own`` as another run's (another seed) newer step checkpoint."""
    state = torch.load(own, weights_only=True)
    state["seeds"] = {**state["seeds"], "base": state["seeds"]["base"] + 1}
    step = state["loop"]["global_step"] + 1
    state["loop"]["global_step"] = step
    stray = checkpoint.step_path(run / "checkpoints", step)
    torch.save(state, stray)
    return stray


def test_eval_takes_only_the_runs_own_checkpoints(old_run):
    own = checkpoint.list_step_checkpoints(old_run / "checkpoints")[-1]
    stray = _stray(old_run, own)
    result = evaluation.evaluate_run(old_run, "last")
    assert result["checkpoint"] == str(own), "a checkpoint copied in from another run was 'last'"
    assert result["metrics"]["test_loss"] == run_json(old_run)["final_metrics"]["test_loss"]
    with pytest.raises(evaluation.EvalError, match="not a checkpoint of this run"):
        evaluation.evaluate_run(old_run, str(stray))


def test_a_file_that_is_no_checkpoint_is_called_that_and_code_is_refused(tmp_path):
    text = tmp_path / "hostname"
    text.write_text("myhost\n")
    with pytest.raises(CheckpointError, match=r"hostname is not a checkpoint \(not a file"):
        checkpoint.load(text)

    class Runs:  # what a hostile pickle does: name code to call on load
        def __reduce__(self):
            return (os.system, ("true",))

    evil = tmp_path / "evil.pt"
    for write in (lambda: torch.save({"x": Runs()}, evil),  # torch's zip, and a bare pickle
                  lambda: evil.write_bytes(pickle.dumps({"x": Runs()}))):  # fmt: skip
        write()
        with pytest.raises(CheckpointError, match="outside the safe set"):
            checkpoint.load(evil)
    cut = tmp_path / "cut.pt"
    real = tmp_path / "real.pt"
    torch.save({"format_version": 2}, real)
    cut.write_bytes(real.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        checkpoint.load(cut)


@pytest.mark.parametrize("text", ["0", "-1", "abc", "2;touch x"])
def test_nproc_is_checked_before_torchrun(text):
    from reprotrain import preflight

    with pytest.raises(ReprotrainError, match=r"^NPROC="):
        preflight.check_nproc(text)
    assert preflight.check_nproc("2") == 2


def _make_ready() -> bool:
    if shutil.which("make") is None:
        return False
    proc = subprocess.run(["make", "-q", ".venv/.installed"], cwd=REPO, capture_output=True)
    return proc.returncode == 0  # never let a test install the venv


@pytest.mark.skipif(not _make_ready(), reason="needs make and an installed .venv")
@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["train", "NPROC=0"], "NPROC=0: give at least 1 process"),
        (["train", "NPROC=-1"], "NPROC=-1: give at least 1 process"),
        (["train", "NPROC=abc"], "NPROC=abc: not a number of processes"),
        (["train", "ARGS=trainer.epochs='3"], "has a quote that is not closed"),
        (["sweep", 'ARGS=name="x'], "has a quote that is not closed"),
        (["eval", "RUN=x", "ARGS=a='b"], "has a quote that is not closed"),
    ],
)
def test_make_refuses_a_bad_value_in_one_line(args, expect, tmp_path):
    if not any(a.startswith("ARGS=") for a in args):
        args = [*args, f"ARGS=experiment=selfcheck hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(
        ["make", "-s", "--no-print-directory", "-C", str(REPO), *args],
        cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Syntax error" not in proc.stderr, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and expect in errors[0], proc.stderr
    assert not list(tmp_path.iterdir()), "nothing was written"


def test_data_settings_the_trainer_refuses_are_refused_before_hydra_and_valid_ones_pass():
    """Controls for the bad-input rows: each refusal is the data rule, not a blanket one."""
    from reprotrain import preflight
    from reprotrain.config import register_configs

    register_configs()
    preflight.register_resolvers()

    preflight.check(["experiment=smoke_sequence", "trainer.num_workers=2"])  # a loader dataset
    preflight.check(["experiment=selfcheck", "trainer.num_workers=2", "trainer.pipeline=loader"])
    preflight.check(["experiment=selfcheck", "model.num_classes=10", "dataset.mean=[0,0,0]"])
    preflight.check(["experiment=selfcheck", "+dataset.num_classes=4", "model.num_classes=4"])
    with pytest.raises(ReprotrainError, match="the dataset has 4 classes"):
        preflight.check(["experiment=selfcheck", "+dataset.num_classes=4"])  # model: 10


def foreign_app_dir(root: Path) -> Path:
    """Another Hydra app's output directory: its ``.hydra/`` record and its log, nothing of
    reprotrain's."""
    out = root / "other app output"
    (out / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (out / ".hydra" / name).write_text(f"# the other app's {name}\nlr: 0.5\n")
    (out / "train.log").write_text("[other app] epoch 1 done\n")
    return out


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_a_non_empty_dir_reprotrain_did_not_make_is_refused_and_left_byte_for_byte(tmp_path, mode):
    """Was: training into another Hydra app's output dir replaced its .hydra/config.yaml and
    overrides.yaml (that dir holds no run.json, no checkpoints, no metrics)."""
    other = foreign_app_dir(tmp_path)
    before = snapshot(other)
    key = "hydra.run.dir" if mode == "run" else "hydra.sweep.dir"
    argv = [*conftest.MICRO, *TINY, hydra_override(key, other)]
    argv = argv if mode == "run" else ["--multirun", *argv]
    proc = subprocess.run([sys.executable, "-m", "reprotrain.train", *argv], cwd=REPO,
                          env=base_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    line = one_error(proc)
    assert f"{key}=" in line and "holds no reprotrain record" in line, line
    assert snapshot(other) == before, "a byte of the other app's directory changed"


def test_eval_under_overrides_writes_its_own_file_and_never_the_recorded_settings_one(old_run):
    """Was: `eval <run> trainer.precision=...` replaced the evaluation written at the
    recorded precision (evals/<ckpt>-step<N>.json and eval.json)."""
    recorded = evaluation.evaluate_run(old_run, "last")
    own = evaluation.result_path(old_run, Path(recorded["checkpoint"]), recorded["global_step"])
    kept = {p: p.read_bytes() for p in (own, old_run / evaluation.EVAL_JSON)}
    other = ["trainer.precision=bf16-mixed"]
    changed = evaluation.evaluate_run(old_run, "last", other)
    assert {p: p.read_bytes() for p in kept} == kept, "the recorded settings' result changed"
    beside = evaluation.result_path(old_run, Path(changed["checkpoint"]), changed["global_step"],
                                    other)  # fmt: skip
    assert beside != own and beside.parent == own.parent
    assert yaml.safe_load(beside.read_text())["overrides"] == other
    third = evaluation.result_path(old_run, Path(recorded["checkpoint"]), recorded["global_step"],
                                   ["trainer.precision=32-true"])  # fmt: skip
    assert third not in (own, beside), "one file per set of overrides"
