"""P1, P3, portable, the logger slot and the replay: the template's CLI and the bare loop, as
subprocesses.

Only the template's public surface is used (``python -m reprotrain.train`` overrides and the
``epoch``/``images_per_s`` keys of metrics.jsonl), so the trainer's internals can change
without touching the bench. Each side is a fresh process with the same thread count; the
first epoch of every run is warm-up (allocator, lazy init) and left out.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.stats import compare, interleave, median
from reprotrain.repro import checkpoint
from reprotrain.run.record import read_jsonl

WARMUP_EPOCHS = 1


class BenchRunError(RuntimeError):
    """A measured run failed; the message carries its last lines of output."""


@dataclass
class TrainSetup:
    """What both sides of P1 share."""

    device: str = "cpu"
    threads: int = 2
    epochs: int = 3
    num_train: int = 2048
    num_test: int = 256
    batch_size: int = 128
    levels: tuple[str, ...] = ("strict", "warn", "fast")
    repeats: int = 2


def child_env(drop: tuple[str, ...] = ()) -> dict[str, str]:
    """Fixed hash seed (no re-exec), cuBLAS workspace before CUDA init, no test hooks;
    ``drop``: more variables to leave out (a torchrun child must not inherit a rank)."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("REPROTRAIN_TEST") and k not in drop
    }
    env.update(PYTHONHASHSEED="0", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    return env


def run_checked(cmd: list[str], timeout: float = 1800, drop_env: tuple[str, ...] = ()) -> None:
    env = child_env(drop_env)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchRunError(f"over {timeout:.0f} s: {' '.join(cmd[2:])}") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise BenchRunError(f"exit {proc.returncode}: {' '.join(cmd[2:])}\n" + "\n".join(tail))


def steady_images_per_s(rows: list[dict], warmup: int = WARMUP_EPOCHS) -> float:
    """Median train images/s over the epochs after the warm-up ones."""
    steady = [r["images_per_s"] for r in rows if r["epoch"] > warmup]
    if not steady:
        raise BenchRunError(f"no epoch after the {warmup} warm-up epoch(s) was recorded")
    return median(steady)


def template_overrides(setup: TrainSetup, level: str, *more: str) -> list[str]:
    return [
        "experiment=selfcheck",
        f"repro.level={level}",
        f"repro.num_threads={setup.threads}",
        f"trainer.device={setup.device}",
        f"trainer.epochs={setup.epochs}",
        f"trainer.batch_size={setup.batch_size}",
        f"dataset.num_train={setup.num_train}",
        f"dataset.num_test={setup.num_test}",
        *more,
    ]


def run_template(setup: TrainSetup, run_dir: Path, level: str, *more: str) -> float:
    """One template run; its steady train images/s. Checkpoints are deleted afterwards."""
    cmd = [sys.executable, "-m", "reprotrain.train", *template_overrides(setup, level, *more)]
    run_checked([*cmd, f"hydra.run.dir={run_dir}"])
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return steady_images_per_s(read_jsonl(run_dir / "metrics.jsonl"))


def run_bare(setup: TrainSetup, out: Path, level: str, fill: bool = True) -> float:
    """One bare-loop run; its steady train images/s."""
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("bare_loop.py")),  # by path: no package of the project
        f"--level={level}",
        f"--threads={setup.threads}",
        f"--device={setup.device}",
        f"--epochs={setup.epochs}",
        f"--num-train={setup.num_train}",
        f"--num-test={setup.num_test}",
        f"--batch-size={setup.batch_size}",
        f"--out={out}",
        *([] if fill else ["--no-fill"]),
    ]
    run_checked(cmd)
    return steady_images_per_s(read_jsonl(out))


class Counter:
    """Fresh run-directory names: <prefix>-<n>."""

    def __init__(self, root: Path) -> None:
        self.root, self.n = root, 0

    def __call__(self, prefix: str) -> Path:
        self.n += 1
        return self.root / f"{self.n:03d}-{prefix}"


def measure_p1_p3(setup: TrainSetup, root: Path, log=print) -> dict:
    """P1 (template / bare per level) and P3 (strict vs fast; fill on vs off).

    One repeat runs, back to back: the template at strict with
    ``repro.fill_uninitialized_memory=false`` (when strict is among the levels), then for
    each level the template and the bare loop. Each pair that forms a ratio is adjacent.
    """
    fresh = Counter(root)
    sides = {}
    if "strict" in setup.levels:  # first, so it sits right before its pair (template strict)
        sides["template_strict_nofill"] = lambda: _logged(
            log,
            "template strict fill=false",
            run_template(
                setup,
                fresh("template-strict-nofill"),
                "strict",
                "repro.fill_uninitialized_memory=false",
            ),
        )
    for level in setup.levels:
        sides[f"template_{level}"] = lambda lv=level: _logged(
            log, f"template {lv}", run_template(setup, fresh(f"template-{lv}"), lv)
        )
        sides[f"bare_{level}"] = lambda lv=level: _logged(
            log, f"bare {lv}", run_bare(setup, fresh(f"bare-{lv}") / "metrics.jsonl", lv)
        )
    values = interleave(sides, setup.repeats)
    p1 = {
        level: compare(values[f"template_{level}"], values[f"bare_{level}"])
        for level in setup.levels
    }
    p3: dict = {}
    if {"strict", "fast"} <= set(setup.levels):
        # step time ratio strict/fast = images/s fast / images/s strict, paired per repeat
        p3["template_strict_over_fast_step_time"] = compare(
            values["template_fast"], values["template_strict"]
        )
        p3["bare_strict_over_fast_step_time"] = compare(values["bare_fast"], values["bare_strict"])
    if "strict" in setup.levels:
        p3["fill_uninitialized_memory_step_time"] = compare(
            values["template_strict_nofill"], values["template_strict"]
        )
    return {"P1": p1, "P3": p3, "raw_images_per_s": values}


def _logged(log, label: str, value: float) -> float:
    log(f"  {label:<28} {value:10.1f} images/s")
    return value


def logger_supported(setup: TrainSetup) -> tuple[bool, str]:
    """Does the current config accept ``logger=none``? (composed only, nothing trains)"""
    cmd = [
        sys.executable,
        "-m",
        "reprotrain.train",
        *template_overrides(setup, "strict", "logger=none"),
        "--cfg",
        "job",
    ]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600)
    if proc.returncode == 0:
        return True, ""
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    return False, (errors or lines or [f"exit {proc.returncode}"])[0]


def measure_logger(setup: TrainSetup, root: Path, log=print) -> dict:
    """Template at strict with the default logger vs ``logger=none``: the logger's cost."""
    ok, why = logger_supported(setup)
    if not ok:
        return {"skipped": f"logger=none is rejected by the current config ({why})"}
    fresh = Counter(root)
    values = interleave(
        {
            "default": lambda: _logged(
                log,
                "template logger=default",
                run_template(setup, fresh("logger-default"), "strict"),
            ),
            "none": lambda: _logged(
                log,
                "template logger=none",
                run_template(setup, fresh("logger-none"), "strict", "logger=none"),
            ),
        },
        setup.repeats,
    )
    # step time with the logger / without it
    result = compare(values["none"], values["default"])
    result["overhead"] = result["ratio"] - 1.0
    return result


def portable_supported() -> tuple[bool, str]:
    """repro=portable covers x86-64 CPUs with AVX2 (``hashseed.portable_problem``)."""
    from reprotrain.repro import hashseed

    problem = hashseed.portable_problem(cpu_flags=hashseed.cpu_flags())
    return problem is None, problem or ""


def measure_portable(setup: TrainSetup, root: Path, log=print) -> dict:
    """Template step time at repro=portable against strict (same threads, interleaved):
    what pinning CPU dispatch to the x86-64-wide paths costs."""
    ok, why = portable_supported()
    if not ok:
        return {"skipped": why}
    fresh = Counter(root)
    values = interleave(
        {
            "strict": lambda: _logged(
                log, "template strict", run_template(setup, fresh("strict"), "strict")
            ),
            "portable": lambda: _logged(
                log, "template portable", run_template(setup, fresh("portable"), "portable")
            ),
        },
        setup.repeats,
    )
    return compare(values["strict"], values["portable"])  # step time portable / strict


def measure_replay(setup: TrainSetup, root: Path, log=print) -> dict:
    """A resume's replay against the interval it replays, measured in the same pair of runs.

    Each repeat trains with checkpoints at epoch ends and stops after epoch 2
    (``trainer.stop_after_epoch=2``), then resumes it for the rest of the schedule
    (``trainer.stop_after_epoch=0``). The resume replays epoch 2 from the epoch-1 checkpoint
    and compares the state with the epoch-2 one; its ``replay.seconds`` (the steps, epoch 2's
    validation and the comparison) over the interval, the wall time from the epoch-1
    checkpoint to the epoch-2 one (epoch 2's steps, its validation and its checkpoint write,
    by the two files' mtimes), is the figure: what verifying a resume costs per checkpoint
    interval.
    """
    fresh = Counter(root)
    interval, replay = [], []
    for _ in range(setup.repeats):
        run_dir = fresh("replay")
        epochs = f"trainer.epochs={max(setup.epochs, 3)}"  # the stop must not be the end
        overrides = template_overrides(setup, "strict", "logger=none", epochs)
        base = [sys.executable, "-m", "reprotrain.train", *overrides, f"hydra.run.dir={run_dir}"]
        run_checked([*base, "trainer.stop_after_epoch=2"])
        run_checked([*base, "resume=auto", "trainer.stop_after_epoch=0"])
        entry = json.loads((run_dir / "run.json").read_text())["resumes"][-1]
        rows = read_jsonl(run_dir / "metrics.jsonl")
        first, second = rows[0]["global_step"], rows[1]["global_step"]
        got = (entry["replay"].get("first_step"), entry["replay"].get("last_step"))
        if not entry["replay"].get("identical") or got != (first + 1, second):
            raise BenchRunError(f"the measured resume did not replay epoch 2: {entry['verified']}")
        ckpts = {
            checkpoint.step_of(c): c
            for c in checkpoint.list_step_checkpoints(run_dir / "checkpoints")
        }
        interval.append(ckpts[second].stat().st_mtime - ckpts[first].stat().st_mtime)
        replay.append(entry["replay"]["seconds"])
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        log(f"  replay {replay[-1]:.2f} s / interval {interval[-1]:.2f} s")
    # replay / interval: compare(a, b) pairs a / b, and for times the best is the least
    result = compare(replay, interval, higher_is_better=False)
    result["best_ratio"] = min(replay) / min(interval)
    return result
