"""The one-shot GPU check behind ``scripts/gpu_check.sh``: one JSON on stdout.

    bash scripts/gpu_check.sh [--wheels DIR] [--out DIR] [--budget SECONDS]

On one CUDA GPU, in the order that finds bugs first (each section has a timeout, and the
whole run a budget, 540 s by default, so a section left without time is recorded as
skipped instead of running over):

1. ``pytest_gpu``: ``pytest -m gpu`` (tests/test_gpu.py: twins at every precision, kill and
   resume through the resume tool, the CUDA determinism alerts).
2. ``verify``: the reference job (``experiment=cifar10_resnet18 dataset=synthetic``,
   ResNet-18 at batch 512, at its own setting: strict, tf32, channels_last; 50000/10000
   images, 2 epochs) twice in fresh processes through ``python -m reprotrain.tools.runs.verify``:
   identical bits or not. A checkout without that experiment uses the framework's own job
   (``experiment=selfcheck``, the wide 11.0M-parameter net) at the same setting.
3. ``resume_after_kill``: the same job SIGKILLed mid-epoch 2 (``tests/faults.py step:N``),
   resumed with ``resume=auto``, compared with a run of the verify pair.
4. ``precision``: twins of the same job at each ``trainer.precision`` (tf32: the verify
   pair): identical or not, the final test loss and accuracy of each twin, train images/s
   (epoch 2), and the projected 30 epochs of the reference recipe at the default setting.
   docs/gpus.md cites this table for what a precision costs in accuracy.
5. ``bench``: ``scripts/bench.py --device cuda`` P1/P2/P3 and, on CUDA, P1/P3 on the
   reference model and the strict-cost table (precision x deterministic x benchmark x layout).
6. ``invariant``: ``scripts/bench.py --device cuda --only invariant``: step time of a
   ``trainer.world_size_invariant`` run / a plain DDP run of the self-check job, same world
   size (one NCCL rank per GPU, at most 2: W=1 on a one-GPU machine) and micro-batch size,
   the net at the reference model's size; with each step's op counts beside it.

Exit 0 when every check that ran passed, 1 otherwise. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.training import child_env, steady_images_per_s
from reprotrain import REPO_ROOT
from reprotrain.repro.precision import PRECISIONS
from reprotrain.run.record import read_jsonl
from reprotrain.selfcheck.net import WIDE
from reprotrain.tools.runs.run_diff import compare_runs

NUM_TRAIN = 50_000  # a typical small image benchmark's training set
FULL_SIZE = [f"dataset.num_train={NUM_TRAIN}", "dataset.num_test=10000"]
#: The reference job (the user's room: conf/experiment/cifar10_resnet18.yaml) on synthetic
#: CIFAR-shaped data, at its own setting (strict, tf32, channels_last on CUDA).
REFERENCE_JOB = ["experiment=cifar10_resnet18", "dataset=synthetic", "trainer.device=cuda"]
#: Where a project replaced that experiment: the framework's own job at reference size and
#: the same setting, so a GPU check still runs.
SELFCHECK_JOB = [
    "experiment=selfcheck",
    f"model.widths=[{','.join(map(str, WIDE['widths']))}]",
    f"model.convs_per_stage={WIDE['convs_per_stage']}",
    "trainer.device=cuda",
    "trainer.batch_size=512",
    "trainer.precision=tf32",
    "trainer.channels_last=true",
]
DEFAULT_PRECISION = "tf32"  # the reference job's (conf/experiment/cifar10_resnet18.yaml)
BATCH = 512
REFERENCE_EPOCHS = 30
TWO_EPOCHS = ["trainer.epochs=2", "trainer.checkpoint_every_steps=40"]  # a mid-epoch ckpt


def reference_job() -> list[str]:
    """The reference experiment where this checkout has it, else the self-check job."""
    if (REPO_ROOT / "conf" / "experiment" / "cifar10_resnet18.yaml").is_file():
        return [*REFERENCE_JOB, "repro.level=strict"]
    return [*SELFCHECK_JOB, "repro.level=strict"]


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self, wanted: float) -> float:
        return max(1.0, min(wanted, self.left()))


def say(msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], timeout: float, env: dict | None = None, log: Path | None = None):
    """(exit code or 'timeout', combined output); the output is also kept in ``log``."""
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO_ROOT,
            env=env or child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
        )
        rc, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(out)
    return rc, out


def train_cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "reprotrain.train", *overrides, f"hydra.run.dir={run_dir}"]


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def check_verify(work: Path, budget: Budget, job: list[str]) -> dict:
    overrides = [*job, *FULL_SIZE, *TWO_EPOCHS]
    cmd = [sys.executable, "-m", "reprotrain.tools.runs.verify", *overrides]
    t0 = time.monotonic()
    rc, out = run(cmd, budget.timeout(240), log=work / "verify.log")
    runs = re.search(r"^runs: (\S+)\s+(\S+)", out, re.MULTILINE)
    result = {
        "identical": rc == 0,
        "exit": rc,
        "verdict": next(
            (ln for ln in out.splitlines() if ln.startswith(("IDENTICAL", "DIVERGED"))),
            last_line(out),
        ),
        "seconds": round(time.monotonic() - t0, 1),
        "overrides": overrides,
    }
    if runs:
        result["runs"] = [str(REPO_ROOT / runs.group(1)), str(REPO_ROOT / runs.group(2))]
    return result


def check_resume(work: Path, budget: Budget, job: list[str], reference_run: str | None) -> dict:
    if reference_run is None:
        return {"skipped": "no completed verify run to compare with"}
    steps_per_epoch = NUM_TRAIN // BATCH
    kill_at = steps_per_epoch + steps_per_epoch // 3  # epoch 2, after a mid-epoch checkpoint
    overrides = [*job, *FULL_SIZE, *TWO_EPOCHS]
    run_dir = work / "resume"
    t0 = time.monotonic()
    train = train_cmd(run_dir, *overrides)  # [python, -m, reprotrain.train, ...]
    killed, _ = run(
        [train[0], str(REPO_ROOT / "tests" / "faults.py"), f"step:{kill_at}", *train[1:]],
        budget.timeout(150),
        log=work / "resume-killed.log",
    )
    resumed, out2 = run(
        train_cmd(run_dir, *overrides, "resume=auto"), budget.timeout(150), log=work / "resume.log"
    )
    result: dict = {
        "killed_at_step": kill_at,
        "kill_exit": killed,
        "resume_exit": resumed,
        "seconds": round(time.monotonic() - t0, 1),
    }
    if resumed != 0:
        result.update(identical=False, verdict=f"resume failed: {last_line(out2)}")
        return result
    cmp = compare_runs(Path(reference_run), run_dir)
    result.update(identical=cmp.identical and killed != 0, verdict=cmp.verdict())
    if killed == 0:
        result["verdict"] = "the kill hook did not fire (run completed): " + result["verdict"]
    return result


def epoch2_images_per_s(run_dir: Path) -> float:
    return steady_images_per_s(read_jsonl(Path(run_dir) / "metrics.jsonl"))


def final_metrics(run_dir: Path) -> dict:
    """The twin's final weights digest, test loss and accuracy, and epoch-2 images/s."""
    record = json.loads((Path(run_dir) / "run.json").read_text())
    final = record.get("final_metrics") or {}
    return {
        "weights": record.get("final_weights_sha256"),
        "test_loss": final.get("test_loss"),
        "test_acc": final.get("test_acc"),
        "images_per_s": round(epoch2_images_per_s(Path(run_dir)), 1),
    }


def precision_row(runs: list[Path]) -> dict:
    """One precision's twins: identical bits or not, and each twin's final numbers."""
    a, b = (final_metrics(r) for r in runs)
    return {
        "identical": a["weights"] == b["weights"] and a["weights"] is not None,
        "test_loss": [a["test_loss"], b["test_loss"]],
        "test_acc": [a["test_acc"], b["test_acc"]],
        "images_per_s": max(a["images_per_s"], b["images_per_s"]),
    }


def check_precision(work: Path, budget: Budget, job: list[str], pair: list[str] | None) -> dict:
    """Twins of the reference job at each ``trainer.precision`` (the verify pair is the
    default's): the accuracy each precision costs, measured, and whether its twins are
    bitwise; the projected reference recipe (30 epochs, training only) at the default."""
    rows: dict = {}
    if pair:
        rows[DEFAULT_PRECISION] = precision_row([Path(r) for r in pair])
    for precision in (p for p in PRECISIONS if p != DEFAULT_PRECISION):
        if budget.left() < 90:
            rows[precision] = {"skipped": "time budget"}
            continue
        runs = [work / f"precision-{precision}-{twin}" for twin in ("a", "b")]
        failed = None
        for run_dir in runs:
            cmd = train_cmd(run_dir, *job, *FULL_SIZE, *TWO_EPOCHS,  # as the verify pair
                            f"trainer.precision={precision}")  # fmt: skip
            rc, out = run(cmd, budget.timeout(120), log=run_dir.with_suffix(".log"))
            if rc != 0:
                failed = f"exit {rc}: {last_line(out)}"
                break
        rows[precision] = {"failed": failed} if failed else precision_row(runs)
    result: dict = {"job": [*job, *FULL_SIZE, *TWO_EPOCHS], "rows": rows}
    default = rows.get(DEFAULT_PRECISION, {})
    if "images_per_s" in default:
        train_images = NUM_TRAIN * 0.9  # the synthetic data's 10% validation split
        result["projected_reference_recipe"] = {
            "epochs": REFERENCE_EPOCHS,
            "setting": f"strict, {DEFAULT_PRECISION}, channels_last",
            "seconds": round(REFERENCE_EPOCHS * train_images / default["images_per_s"], 1),
            "target_seconds": 60,
            "note": f"training steps only ({int(train_images)} images/epoch at the measured "
            "epoch-2 images/s); eval, checkpoints and start-up excluded",
        }
    return result


def check_bench(work: Path, budget: Budget) -> dict:
    if budget.left() < 90:
        return {"skipped": "time budget"}
    out_dir = work / "bench"
    cmd = [
        sys.executable,
        str(REPO_ROOT / "scripts" / "bench.py"),
        "--device=cuda",
        "--only=P1,P3,reference,strict_cost",
        "--levels=strict,fast",
        "--repeats=1",  # one pair per ratio: the budget's; make bench --device cuda repeats
        f"--out={out_dir}",
    ]
    rc, out = run(cmd, budget.timeout(200), log=work / "bench.log")
    if rc != 0:
        return {"failed": f"exit {rc}: {last_line(out)}"}
    data = json.loads((out_dir / "bench.json").read_text())
    summary: dict = {"bench_json": str(out_dir / "bench.json")}
    for fig in ("P1", "P3"):
        summary[fig] = {
            k: {
                "ratio": round(v["ratio"], 3),
                "a": round(v["a_median"], 1),
                "b": round(v["b_median"], 1),
            }
            for k, v in data.get(fig, {}).items()
            if isinstance(v, dict) and "ratio" in v
        }
    reference = data.get("reference") or {}
    if "P3" in reference:
        summary["reference"] = {
            "setting": reference["setting"],
            "P1": {k: round(v["ratio"], 3) for k, v in reference["P1"].items()},
            "P3_strict_over_fast": round(reference["P3"]["ratio"], 3),
            "projected_recipe_seconds": round(reference["recipe"]["seconds"], 1),
        }
    summary["strict_cost"] = (data.get("strict_cost") or {}).get("rows")
    return summary


def check_invariant(work: Path, budget: Budget) -> dict:
    """The bench's ``invariant`` figure on CUDA/NCCL: invariant / plain DDP step time."""
    if budget.left() < 90:
        return {"skipped": "time budget"}
    out_dir = work / "bench-invariant"
    cmd = [
        sys.executable,
        str(REPO_ROOT / "scripts" / "bench.py"),
        "--device=cuda",
        "--only=invariant",
        "--repeats=2",
        f"--out={out_dir}",
    ]
    rc, out = run(cmd, budget.timeout(200), log=work / "bench-invariant.log")
    if rc != 0:
        return {"failed": f"exit {rc}: {last_line(out)}"}
    r = json.loads((out_dir / "bench.json").read_text())["invariant"]
    return {
        "bench_json": str(out_dir / "bench.json"),
        "invariant_over_ddp_step_time": round(r["ratio"], 3),
        "best": round(r["best_ratio"], 3),
        "ddp_images_per_s": round(r["a_median"], 1),
        "invariant_images_per_s": round(r["b_median"], 1),
        "world_size": r["world_size"],
        "microbatch_size": r["microbatch_size"],
        "microbatches_per_step": r["microbatches_per_step"],
        "model_widths": r.get("widths"),
        "ops_per_step": r.get("ops_per_step"),
    }


def check_pytest(work: Path, budget: Budget) -> dict:
    if budget.left() < 30:
        return {"skipped": "time budget"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider"]
    rc, out = run(cmd, budget.timeout(180), log=work / "pytest-gpu.log")
    if "Unknown marker" in out:  # --strict-markers and no test suite with GPU tests yet
        return {"skipped": "no `gpu` marker registered in this checkout", "exit": rc}
    # 5: nothing selected (no test carries the gpu marker), not a failure
    failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return {"exit": rc, "passed": rc in (0, 5), "summary": last_line(out), "failed": failed}


def gpu_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one-shot GPU check; prints one JSON")
    p.add_argument("--out", type=Path, help="also write gpu_check.json into this folder")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all checks")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: gpu_check needs a CUDA GPU and torch sees none", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    budget = Budget(args.budget)
    work = REPO_ROOT / "outputs" / "gpu_check" / time.strftime("%Y-%m-%d_%H-%M-%S")
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"gpu": gpu_info(), "work_dir": str(work)}

    say("pytest -m gpu")
    report["pytest_gpu"] = check_pytest(work, budget)
    job = reference_job()
    say(f"verify: {' '.join(job)}, 50k synthetic, 2 epochs, twice")
    report["verify"] = check_verify(work, budget, job)
    pair = report["verify"].get("runs") if report["verify"]["identical"] else None
    say("resume after a kill")
    report["resume_after_kill"] = check_resume(work, budget, job, pair[0] if pair else None)
    say("precision: twins at each trainer.precision (final loss/accuracy, images/s)")
    report["precision"] = check_precision(work, budget, job, pair)
    say("bench.py --device cuda (P1, P2, P3, the reference model, the strict-cost table)")
    report["bench"] = check_bench(work, budget)
    say("bench.py --device cuda --only invariant (invariant / plain DDP step time)")
    report["invariant"] = check_invariant(work, budget)

    report["ok"] = bool(
        report["verify"]["identical"]
        and report["resume_after_kill"].get("identical")
        and all(r.get("identical", True) for r in report["precision"]["rows"].values())
        and "failed" not in report["bench"]
        and "failed" not in report["invariant"]
        and report["pytest_gpu"].get("passed", True)
    )
    report["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(report, indent=2, sort_keys=True)
    (work / "gpu_check.json").write_text(text + "\n")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
