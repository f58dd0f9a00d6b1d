"""``make verify NPROC=N [NPROC_B=M] [KILL=1]``: what it compares is what it says it compared.

Before issue 25, ``make verify NPROC=2`` ran both runs on one process and printed IDENTICAL.
Now each run runs at the world size asked for, the verdict line names the world sizes read
back from the two run.json files, and ``KILL=1`` SIGKILLs run b after its first checkpoint,
resumes it and compares it with the uninterrupted run a.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from conftest import REPO, TINY, base_env, run_json
from reprotrain.errors import ReprotrainError
from reprotrain.tools.runs import verify
from reprotrain.tools.runs.run_diff import Comparison, config_differences

RUN = ["experiment=selfcheck", *TINY, "repro.num_threads=1"]
INVARIANT = ["trainer.microbatch_size=16", "trainer.world_size_invariant=true"]


def make_n(*args: str) -> str:
    """The command ``make verify`` would run (``make -n``; safe under an outer make)."""
    env = {k: v for k, v in base_env().items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", "verify", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, check=True)  # fmt: skip
    line = next(line for line in proc.stdout.splitlines() if "bin/reprotrain " in line)
    return " ".join(shlex.split(line))  # each variable arrives quoted (the Makefile's q)


def test_make_verify_passes_nproc_nproc_b_and_kill_to_the_tool():
    assert "--nproc 2" in make_n("NPROC=2")
    line = make_n("NPROC=2", "NPROC_B=1", "KILL=1")
    assert "--nproc 2" in line and "--nproc-b 1" in line and "--kill" in line
    assert "--nproc 1" in make_n() and "--kill" not in make_n()


def test_every_verdict_line_names_the_world_sizes_it_compared():
    same = Comparison(identical=True, epochs_compared=2)
    assert verify.verdict_line(same, (2, 1), None).startswith(
        "IDENTICAL (world size 2 vs 1): 2 epoch(s)"
    )
    diverged = Comparison(identical=False, epochs_compared=1, divergent_epoch=1, reasons=["w"])
    resume = {"global_step": 3, "bitwise_guarantee": False}
    line = verify.verdict_line(diverged, (1, 1), resume)
    assert line.startswith("DIVERGED at epoch 1 (world size 1 vs 1; b SIGKILLed and resumed")
    assert "global step 3, recorded as not bitwise" in line


def test_verify_and_bisect_name_every_setting_two_runs_differ_in_even_with_identical_bits(
    tmp_path,
):
    """A 32-true and a tf32 run on a CPU compute the same bits: the verdict is IDENTICAL and
    still names the precision (the config key and the float math run.json says was in force),
    and the seeds that ran; not the keys that only say where a run is shown."""
    runs = []
    for name, precision, tf32, seed in (("a", "32-true", False, 7), ("b", "tf32", True, 8)):
        run = _record(tmp_path / name, repro={"precision": precision, "tf32_matmul": tf32},
                      seeds={"base": 1, "init": seed})  # fmt: skip
        config = {"trainer": {"precision": precision, "progress": name}, "name": name}
        (run / "config.resolved.yaml").write_text(json.dumps(config))
        runs.append(run)
    differ = config_differences(*runs)
    assert differ == {
        "trainer.precision": ("32-true", "tf32"),
        "run.json repro.precision": ("32-true", "tf32"),
        "run.json repro.tf32_matmul": (False, True),
        "run.json seeds.init": (7, 8),
    }
    same = Comparison(identical=True, epochs_compared=2)
    assert verify.verdict_line(same, (1, 1), None, differ).startswith(
        "IDENTICAL (world size 1 vs 1; the runs' configs differ in: trainer.precision "
        "('32-true' vs 'tf32'), run.json repro.precision ('32-true' vs 'tf32'), "
        "run.json repro.tf32_matmul (False vs True), run.json seeds.init (7 vs 8)): 2 epoch(s)"
    )


def _record(tmp_path, **fields):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "run.json").write_text(json.dumps({"status": "completed", **fields}))
    return tmp_path


def test_different_world_sizes_are_compared_only_for_an_invariant_run(tmp_path):
    plain = _record(tmp_path / "plain", world_size=2, world_size_invariant=False)
    with pytest.raises(ReprotrainError, match="not world-size-invariant"):
        verify.check_world_sizes(plain, 2, 1)
    verify.check_world_sizes(plain, 2, 2)
    invariant = _record(tmp_path / "inv", world_size=2, world_size_invariant=True)
    verify.check_world_sizes(invariant, 2, 1)


def test_a_run_at_another_world_size_than_asked_is_an_error_not_a_verdict(tmp_path):
    one = _record(tmp_path / "one", world_size=1)
    with pytest.raises(ReprotrainError, match="says world size 1, 2 process"):
        verify.recorded_world_size(one, 2)
    assert verify.recorded_world_size(one, 1) == 1


def run_verify(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "reprotrain.tools.runs.verify", "--out-dir", str(tmp_path), *args]
    return subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=900)  # fmt: skip


def run_dirs(tmp_path) -> tuple:
    (stamp,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return stamp / "a", stamp / "b"


@pytest.mark.slow
def test_verify_nproc_2_runs_both_runs_on_two_processes(tmp_path):
    proc = run_verify(tmp_path, "--nproc", "2", *RUN)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "IDENTICAL (world size 2 vs 2)" in proc.stdout
    a, b = run_dirs(tmp_path)
    assert run_json(a)["world_size"] == 2 and run_json(b)["world_size"] == 2


@pytest.mark.slow
def test_verify_compares_two_processes_with_one_for_an_invariant_config(tmp_path):
    proc = run_verify(tmp_path, "--nproc", "2", "--nproc-b", "1", *RUN, *INVARIANT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "IDENTICAL (world size 2 vs 1)" in proc.stdout
    a, b = run_dirs(tmp_path)
    assert (run_json(a)["world_size"], run_json(b)["world_size"]) == (2, 1)


@pytest.mark.slow
def test_verify_refuses_other_world_sizes_for_a_plain_ddp_config(tmp_path):
    proc = run_verify(tmp_path, "--nproc", "1", "--nproc-b", "2", *RUN)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --nproc-b 2 differs")
    assert "Traceback" not in proc.stderr
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # refused before run a trained


KILLABLE = [*RUN, "trainer.limit_train_steps=8", "trainer.checkpoint_every_steps=2"]


def user_env():
    return base_env(PYTHONPATH=str(REPO / "tests"))


@pytest.mark.slow
def test_verify_kill_resumes_run_b_after_a_sigkill_and_compares_it_bit_for_bit(tmp_path):
    proc = run_verify(tmp_path, "--kill", *KILLABLE)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "IDENTICAL (world size 1 vs 1; b SIGKILLed and resumed from global step" in proc.stdout
    assert "recorded as bitwise" in proc.stdout
    a, b = run_dirs(tmp_path)
    (entry,) = run_json(b)["resumes"]
    assert entry["bitwise_guarantee"] is True and entry["global_step"] >= 2
    assert run_json(b)["status"] == "completed" and run_json(a).get("resumes") == []


@pytest.mark.slow
def test_verify_kill_finds_a_task_whose_resume_loses_state(tmp_path):
    """Without the replay (trainer.verify_resume=false) a resume from the first checkpoint
    loses the task's `preds`, and verify's comparison finds it; with the replay the same
    resume rebuilds them (tests/test_resume_replay.py)."""
    preds = ["task._target_=numpy_user_code.PredictionList", "trainer.allow_unrestored_state=true",
             "trainer.verify_resume=false"]  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "reprotrain.tools.runs.verify",
        "--out-dir",
        str(tmp_path),
        "--kill",
    ]
    proc = subprocess.run([*cmd, *KILLABLE, *preds], cwd=REPO, env=user_env(),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("DIVERGED"))
    assert "recorded as not bitwise" in verdict and "metrics differ (train_seen" in verdict
    (entry,) = run_json(run_dirs(tmp_path)[1])["resumes"]
    assert entry["bitwise_guarantee"] is False and "`preds`" in entry["unrestored"][0]


@pytest.mark.slow
def test_verify_kill_at_two_processes_kills_every_rank_and_resumes_on_two(tmp_path):
    proc = run_verify(tmp_path, "--nproc", "2", "--kill", *KILLABLE)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "IDENTICAL (world size 2 vs 2; b SIGKILLed and resumed from global step" in proc.stdout
    (entry,) = run_json(run_dirs(tmp_path)[1])["resumes"]
    assert entry["bitwise_guarantee"] is True


@pytest.mark.slow
def test_verify_kills_after_each_chosen_step_and_resumes_after_each(tmp_path):
    """A model counting its forwards in a private attribute: killed after its first
    checkpoint only, a resume replays from the start and rebuilds the count (IDENTICAL,
    tests/test_resume_replay.py); killed after step 2 and again after step 4 (issue 45),
    the second resume starts from a checkpoint that lacks it, and run b diverges from run a,
    recorded as not bitwise (allowed here, so that verify compares)."""
    counter = ["model._target_=hidden_state_user_code.PrivateCounterNet",
               "trainer.allow_unrestored_state=true"]  # fmt: skip
    cmd = [sys.executable, "-m", "reprotrain.tools.runs.verify", "--out-dir", str(tmp_path),
           "--kill", "--kill-after-steps", "2,4"]  # fmt: skip
    proc = subprocess.run([*cmd, *KILLABLE, *counter], cwd=REPO, env=user_env(),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("SIGKILLed after its first checkpoint at or past step") == 2
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("DIVERGED"))
    assert "recorded as not bitwise" in verdict
    first, second = run_json(run_dirs(tmp_path)[1])["resumes"]
    assert second["global_step"] >= 4 and second["global_step"] > first["global_step"]


def test_kill_after_steps_goes_with_kill_and_takes_increasing_steps(tmp_path):
    cases = ((["--kill-after-steps", "4"], "goes with --kill"),
             (["--kill", "--kill-after-steps", "6,2"], "positive and increasing"))  # fmt: skip
    for args, said in cases:
        proc = run_verify(tmp_path, *args, *KILLABLE)
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]
