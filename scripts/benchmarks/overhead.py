"""The template's own work per step: the template against the bare loop on a null model.

    python scripts/bench.py --only overhead

Both sides train the null model (``model=selfcheck_null``: a linear head on each image's
channel means, no augmentation) on the selfcheck images, so a step is almost all loop work:
the template through its CLI (``python -m reprotrain.train``, ``logger=none``: a logger's
cost is the ``logger`` figure), the bare loop by hand (``bare_loop.py --null``: the same
model, loss, optimizer, schedule, batches and determinism flags). The figure is the
difference of the two sides' seconds per step, in microseconds: what the template adds to
every step. One thread on both sides (tiny tensors gain nothing from a second one, and a
busy machine makes idle threads wait). Each repeat runs the template, then the bare loop
(interleaved); the epochs after the first (warm-up) give each side's seconds per step; the
figure is the median over repeats of the paired differences.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.stats import compare, interleave, median
from benchmarks.training import WARMUP_EPOCHS, BenchRunError, Counter, run_checked
from reprotrain.run.record import read_jsonl

TARGET_US = 100.0  # issue 44: template work per step on the 2-core CPU


@dataclass
class OverheadSetup:
    """What both sides share."""

    device: str = "cpu"
    steps: int = 1000  # per epoch
    epochs: int = 3  # the first is warm-up
    batch_size: int = 8
    repeats: int = 3
    threads: int = 1


def seconds_per_step(rows: list[dict], warmup: int = WARMUP_EPOCHS) -> float:
    """Median seconds per step over the epochs after the warm-up ones. A row's steps are
    its own ``steps`` (the bare loop) or the difference of ``global_step`` (the template)."""
    previous, per_step = 0, []
    for row in rows:
        steps = row.get("steps", row.get("global_step", 0) - previous)
        previous = row.get("global_step", 0)
        if row["epoch"] > warmup and steps > 0:
            per_step.append(row["seconds"] / steps)
    if not per_step:
        raise BenchRunError(f"no epoch after the {warmup} warm-up epoch(s) was recorded")
    return median(per_step)


def template_command(setup: OverheadSetup, run_dir: Path) -> list[str]:
    n = setup.steps * setup.batch_size
    overrides = [
        "experiment=selfcheck",
        "model=selfcheck_null",
        "dataset.augment=false",
        "dataset.val_fraction=0",
        f"dataset.num_train={n}",
        f"dataset.num_test={setup.batch_size}",
        "logger=none",
        "trainer.monitor=train_loss",
        "trainer.monitor_mode=min",
        f"trainer.device={setup.device}",
        f"trainer.epochs={setup.epochs}",
        f"trainer.batch_size={setup.batch_size}",
        f"repro.num_threads={setup.threads}",
        f"hydra.run.dir={run_dir}",
    ]
    return [sys.executable, "-m", "reprotrain.train", *overrides]


def run_template(setup: OverheadSetup, run_dir: Path) -> float:
    run_checked(template_command(setup, run_dir))
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return seconds_per_step(read_jsonl(run_dir / "metrics.jsonl"))


def run_bare(setup: OverheadSetup, out: Path) -> float:
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("bare_loop.py")),
        "--null",
        "--level=strict",
        f"--threads={setup.threads}",
        f"--device={setup.device}",
        f"--epochs={setup.epochs}",
        f"--num-train={setup.steps * setup.batch_size}",
        f"--num-test={setup.batch_size}",
        f"--batch-size={setup.batch_size}",
        f"--out={out}",
    ]
    run_checked(cmd)
    return seconds_per_step(read_jsonl(out))


def measure_overhead(setup: OverheadSetup, root: Path, log=print) -> dict:
    """Microseconds of template work per step: template minus bare loop, paired per repeat."""
    fresh = Counter(root)

    def side(name: str, measure) -> float:
        value = measure(fresh(name))
        log(f"  {name:<10} {value * 1e6:8.1f} us/step")
        return value

    values = interleave(
        {
            "template": lambda: side("template", lambda d: run_template(setup, d)),
            "bare": lambda: side("bare", lambda d: run_bare(setup, d / "metrics.jsonl")),
        },
        setup.repeats,
    )
    template, bare = values["template"], values["bare"]
    extra = [(t - b) * 1e6 for t, b in zip(template, bare, strict=True)]
    return {
        "us_per_step": median(extra),
        "paired_us_per_step": extra,
        "best_us_per_step": (min(template) - min(bare)) * 1e6,
        "template_us_per_step": median(template) * 1e6,
        "bare_us_per_step": median(bare) * 1e6,
        "ratio": compare(template, bare, higher_is_better=False)["ratio"],  # template / bare time
        "target_us": TARGET_US,
        "steps_per_epoch": setup.steps,
        "batch_size": setup.batch_size,
        "threads": setup.threads,
    }
