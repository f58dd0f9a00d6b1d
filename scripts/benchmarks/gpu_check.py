"""The one-shot GPU check behind ``scripts/gpu_check.sh``: one JSON on stdout.

    bash scripts/gpu_check.sh [--wheels DIR] [--out DIR] [--budget SECONDS]

On one CUDA GPU, in this order (each section has a timeout, and the whole run a budget,
540 s by default, so a slow section is recorded as skipped instead of running over):

1. ``verify``: the framework's own job at reference size (``experiment=selfcheck`` with the
   wide 11.0M-parameter net, batch 512, SGD, one-cycle, strict) on its synthetic 3x32x32
   images at 50000/10000, 2 epochs, twice in fresh processes through
   ``python -m reprotrain.tools.runs.verify``: identical bits or not.
2. ``resume_after_kill``: the same config SIGKILLed mid-epoch 2
   (``tests/faults.py step:N``), resumed with ``resume=auto``, compared with a run
   of the verify pair: identical bits or not.
3. ``throughput``: train images/s (epoch 2 of 2) of that net at strict, fast, bf16
   autocast, channels_last and both; the projected time of 30 epochs at that size.
4. ``bench``: ``scripts/bench.py --device cuda`` P1/P2/P3 (levels strict and fast).
5. ``pytest_gpu``: ``pytest -m gpu``.
6. ``invariant``: ``scripts/bench.py --device cuda --only invariant``: step time of a
   ``trainer.world_size_invariant`` run / a plain DDP run of the self-check job, same world
   size (one NCCL rank per GPU, at most 2: W=1 on a one-GPU machine) and micro-batch size.

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
from reprotrain.paths import REPO_ROOT
from reprotrain.run.record import read_jsonl
from reprotrain.selfcheck.net import WIDE
from reprotrain.tools.runs.run_diff import compare_runs

NUM_TRAIN = 50_000  # a typical small image benchmark's training set
FULL_SIZE = [f"dataset.num_train={NUM_TRAIN}", "dataset.num_test=10000"]
THROUGHPUT_DATA = ["dataset.num_train=25000", "dataset.num_test=2000", "trainer.epochs=2"]
# The framework's own job (src/reprotrain/selfcheck) at reference size, on the GPU: never the
# user's model or data, so a project that replaced them still has a working GPU check.
REFERENCE = [
    "experiment=selfcheck",
    f"model.widths=[{','.join(map(str, WIDE['widths']))}]",
    f"model.convs_per_stage={WIDE['convs_per_stage']}",
    "trainer.device=cuda",
    "trainer.batch_size=512",
    "repro.level=strict",
]
BATCH = 512
REFERENCE_EPOCHS = 30
TWO_EPOCHS = ["trainer.epochs=2", "trainer.checkpoint_every_steps=40"]  # a mid-epoch ckpt
THROUGHPUT = {  # name -> extra overrides; strict comes from the verify run
    "fast": ["repro.level=fast"],
    "bf16": ["trainer.amp=true", "trainer.amp_dtype=bf16"],
    "channels_last": ["trainer.channels_last=true"],
    "bf16_channels_last": [
        "trainer.amp=true",
        "trainer.amp_dtype=bf16",
        "trainer.channels_last=true",
    ],
}


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


def check_verify(work: Path, budget: Budget) -> dict:
    overrides = [*REFERENCE, *FULL_SIZE, *TWO_EPOCHS]
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


def check_resume(work: Path, budget: Budget, reference_run: str | None) -> dict:
    if reference_run is None:
        return {"skipped": "no completed verify run to compare with"}
    steps_per_epoch = NUM_TRAIN // BATCH
    kill_at = steps_per_epoch + steps_per_epoch // 3  # epoch 2, after a mid-epoch checkpoint
    overrides = [*REFERENCE, *FULL_SIZE, *TWO_EPOCHS]
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


def check_throughput(work: Path, budget: Budget, strict_run: str | None) -> dict:
    """Images/s per option; a rejected override (option not in this version) is skipped."""
    result: dict = {}
    if strict_run:
        result["strict"] = round(epoch2_images_per_s(Path(strict_run)), 1)
    for name, extra in THROUGHPUT.items():
        if budget.left() < 60:
            result[name] = {"skipped": "time budget"}
            continue
        run_dir = work / f"throughput-{name}"
        rc, out = run(
            train_cmd(run_dir, *REFERENCE, *THROUGHPUT_DATA, *extra),
            budget.timeout(120),
            log=work / f"throughput-{name}.log",
        )
        if rc == 0:
            result[name] = round(epoch2_images_per_s(run_dir), 1)
        elif rc == 2 and "error:" in out:
            result[name] = {"skipped": last_line(out)}
        else:
            result[name] = {"failed": f"exit {rc}: {last_line(out)}"}
    measured = {k: v for k, v in result.items() if isinstance(v, float)}
    if "strict" in measured:
        per_epoch = {k: NUM_TRAIN / v for k, v in measured.items()}
        result["projected_reference_recipe"] = {
            "epochs": REFERENCE_EPOCHS,
            "strict_minutes": round(REFERENCE_EPOCHS * per_epoch["strict"] / 60, 1),
            "fastest": min(per_epoch, key=per_epoch.get),
            "fastest_minutes": round(REFERENCE_EPOCHS * min(per_epoch.values()) / 60, 1),
            "note": f"training steps only ({NUM_TRAIN} images/epoch at the measured images/s); "
            "eval, checkpoints and start-up excluded",
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
        "--only=P1,P2,P3",
        "--levels=strict,fast",
        "--repeats=2",
        f"--out={out_dir}",
    ]
    rc, out = run(cmd, budget.timeout(240), log=work / "bench.log")
    if rc != 0:
        return {"failed": f"exit {rc}: {last_line(out)}"}
    data = json.loads((out_dir / "bench.json").read_text())
    summary: dict = {"bench_json": str(out_dir / "bench.json")}
    for fig in ("P1", "P2", "P3"):
        summary[fig] = {
            k: {
                "ratio": round(v["ratio"], 3),
                "a": round(v["a_median"], 1),
                "b": round(v["b_median"], 1),
            }
            for k, v in data.get(fig, {}).items()
            if isinstance(v, dict) and "ratio" in v
        }
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
    }


def check_pytest(work: Path, budget: Budget) -> dict:
    if budget.left() < 30:
        return {"skipped": "time budget"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    rc, out = run(cmd, budget.timeout(150), log=work / "pytest-gpu.log")
    if "Unknown marker" in out:  # --strict-markers and no test suite with GPU tests yet
        return {"skipped": "no `gpu` marker registered in this checkout", "exit": rc}
    # 5: nothing selected (no test carries the gpu marker), not a failure
    return {"exit": rc, "passed": rc in (0, 5), "summary": last_line(out)}


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

    say("verify (11.0M-param self-check net, 50k synthetic, 2 epochs, strict, twice)")
    report["verify"] = check_verify(work, budget)
    first_run = report["verify"].get("runs", [None])[0]
    say("resume after a kill")
    trusted = first_run if report["verify"]["identical"] else None  # else nothing to match
    report["resume_after_kill"] = check_resume(work, budget, trusted)
    say("throughput: strict / fast / bf16 / channels_last")
    report["throughput"] = check_throughput(work, budget, first_run)
    say("bench.py --device cuda (P1, P2, P3)")
    report["bench"] = check_bench(work, budget)
    say("pytest -m gpu")
    report["pytest_gpu"] = check_pytest(work, budget)
    say("bench.py --device cuda --only invariant (invariant / plain DDP step time)")
    report["invariant"] = check_invariant(work, budget)

    report["ok"] = bool(
        report["verify"]["identical"]
        and report["resume_after_kill"].get("identical")
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
