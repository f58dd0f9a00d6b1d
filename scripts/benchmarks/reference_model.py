"""What users run, measured on CUDA (issue 44): P1 and P3 on the reference model, the
strict-cost table, and the projected reference recipe.

- ``reference``: the template on the reference job (``experiment=cifar10_resnet18
  dataset=synthetic``: ResNet-18, batch 512, its own precision and layout) against the bare
  loop with the same model, batch, precision and layout (P1), at strict and fast; strict /
  fast step time at the same precision (P3, target <= 1.10); the projected 30 epochs of the
  reference recipe at the default strict setting, training only (target <= 60 s on one H200).
- ``strict_cost``: where strict's cost goes: one ResNet-18 train step at batch 512, images/s
  under each combination of precision, deterministic algorithms (+ cuDNN deterministic),
  cuDNN benchmark and memory layout, in this process (flags put back afterwards).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.stats import compare, fmt, interleave
from benchmarks.training import Counter, _logged, run_checked, steady_images_per_s
from reprotrain.run.record import read_jsonl

TARGET_STRICT_OVER_FAST = 1.10
TARGET_RECIPE_SECONDS = 60
RECIPE_EPOCHS = 30
TRAIN_IMAGES = 45_000  # CIFAR-10's 50,000 less the reference job's 10% validation split


@dataclass
class ReferenceSetup:
    """Both sides of the reference figures: the reference job's model, batch and setting."""

    device: str = "cuda"
    threads: int = 2
    epochs: int = 2
    num_train: int = 25_000
    batch_size: int = 512
    precision: str = "tf32"  # conf/experiment/cifar10_resnet18.yaml
    channels_last: bool = True
    repeats: int = 2


def template_run(setup: ReferenceSetup, run_dir: Path, level: str) -> float:
    cmd = [
        sys.executable, "-m", "reprotrain.train", "experiment=cifar10_resnet18",
        "dataset=synthetic", f"dataset.num_train={setup.num_train}", "dataset.num_test=1024",
        f"repro.level={level}", f"repro.num_threads={setup.threads}",
        f"trainer.device={setup.device}", f"trainer.epochs={setup.epochs}",
        f"trainer.batch_size={setup.batch_size}", f"trainer.precision={setup.precision}",
        f"trainer.channels_last={str(setup.channels_last).lower()}", "logger=none",
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    run_checked(cmd)
    return steady_images_per_s(read_jsonl(run_dir / "metrics.jsonl"))


def bare_run(setup: ReferenceSetup, out: Path, level: str) -> float:
    cmd = [
        sys.executable, str(Path(__file__).with_name("bare_loop.py")), f"--level={level}",
        f"--threads={setup.threads}", f"--device={setup.device}", f"--epochs={setup.epochs}",
        f"--num-train={setup.num_train}", "--num-test=1024",
        f"--batch-size={setup.batch_size}", "--model=resnet18",
        f"--precision={setup.precision}", *(["--channels-last"] if setup.channels_last else []),
        f"--out={out}",
    ]  # fmt: skip
    run_checked(cmd)
    return steady_images_per_s(read_jsonl(out))


def measure_reference(setup: ReferenceSetup, root: Path, log=print) -> dict:
    """P1 (template / bare) and P3 (strict / fast step time) on the reference model at its
    precision, interleaved; the projected reference recipe from the strict template."""
    fresh, levels = Counter(root), ("strict", "fast")
    sides = {}
    for level in levels:
        sides[f"template_{level}"] = lambda lv=level: _logged(
            log, f"reference template {lv}", template_run(setup, fresh(f"ref-template-{lv}"), lv)
        )
        sides[f"bare_{level}"] = lambda lv=level: _logged(
            log, f"reference bare {lv}", bare_run(setup, fresh(f"ref-bare-{lv}") / "m.jsonl", lv)
        )
    values = interleave(sides, setup.repeats)
    best_strict = max(values["template_strict"])
    return {
        "setting": f"ResNet-18, batch {setup.batch_size}, {setup.precision}"
        + (", channels_last" if setup.channels_last else ""),
        "P1": {lv: compare(values[f"template_{lv}"], values[f"bare_{lv}"]) for lv in levels},
        # step time strict / fast = images/s fast / images/s strict, paired per repeat
        "P3": compare(values["template_fast"], values["template_strict"]),
        "recipe": {
            "epochs": RECIPE_EPOCHS,
            "seconds": RECIPE_EPOCHS * TRAIN_IMAGES / best_strict,
            "images_per_s": best_strict,
            "note": "training steps only, at the strict template's best epoch-2 images/s",
        },
        "raw_images_per_s": values,
    }  # fmt: skip


#: (precision, deterministic, cuDNN benchmark, channels_last) rows of the strict-cost table.
STRICT_COST_ROWS = (
    ("tf32", False, True, False),  # fast at tf32
    ("tf32", True, False, False),  # strict at tf32
    ("32-true", False, True, False),  # fast at 32-true
    ("32-true", True, False, False),  # strict at 32-true (strict before issue 44)
    ("32-true", True, False, True),
    ("tf32", True, False, True),  # the reference job's setting
    ("bf16-mixed", True, False, True),
    ("bf16-mixed", False, True, True),
)


def measure_strict_cost(device: str, batch: int = 512, steps: int = 25, warm: int = 8,
                        log=print) -> dict:  # fmt: skip
    """Images/s of one ResNet-18 train step per row of ``STRICT_COST_ROWS``."""
    if device != "cuda":
        return {"skipped": "CUDA only (TF32, cuDNN and the layout are GPU choices)"}
    from benchmarks.bare_loop import build_model  # conf/model/resnet18.yaml, as a run builds it

    before = _flags()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    rows = []
    try:
        for precision, det, benchmark, cl in STRICT_COST_ROWS:
            _set(precision, det, benchmark)
            torch.manual_seed(0)
            layout = torch.channels_last if cl else torch.contiguous_format
            model = build_model("resnet18", [], 0)
            model = model.to("cuda", memory_format=layout)
            ips = _step_rate(model, precision, layout, batch, steps, warm)
            row = {"precision": precision, "deterministic": det, "cudnn_benchmark": benchmark,
                   "layout": "channels_last" if cl else "NCHW", "images_per_s": ips}  # fmt: skip
            log(f"  strict cost {row}")
            rows.append(row)
    finally:
        _restore(before)
    return {"batch": batch, "steps": steps, "rows": rows}


def _step_rate(model, precision: str, layout, batch: int, steps: int, warm: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    x = torch.randn(batch, 3, 32, 32, device="cuda").contiguous(memory_format=layout)
    y = torch.randint(0, 10, (batch,), device="cuda")
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return batch * steps / (time.perf_counter() - t0)


def _set(precision: str, deterministic: bool, benchmark: bool) -> None:
    from reprotrain.repro import precision as float_math

    float_math.apply(precision)
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = benchmark


def _flags() -> tuple:
    b = torch.backends
    return (torch.are_deterministic_algorithms_enabled(), b.cudnn.deterministic,
            b.cudnn.benchmark, b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32,
            torch.get_float32_matmul_precision())  # fmt: skip


def _restore(flags: tuple) -> None:
    b = torch.backends
    torch.use_deterministic_algorithms(flags[0])
    b.cudnn.deterministic, b.cudnn.benchmark = flags[1], flags[2]
    torch.set_float32_matmul_precision(flags[5])
    b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32 = flags[3], flags[4]


def reference_rows(results: dict) -> list[dict]:
    """bench.md rows: P1/P3 on the reference model, the projected recipe, the cost table."""
    rows: list[dict] = []
    r = results.get("reference") or {}
    if "skipped" in r:
        rows.append({"figure": "P1/P3 reference", "measure": "ResNet-18, batch 512", "ratio":
                     "skipped", "best": "", "sides": r["skipped"], "repeats": "0",
                     "target": ""})  # fmt: skip
    elif r:
        setting = r["setting"]
        for level, pair in r["P1"].items():
            rows.append(_ratio_row(f"P1 reference {level}",
                                   f"template / bare loop, train images/s ({setting})", pair,
                                   f"template {pair['a_median']:.0f} / bare {pair['b_median']:.0f}",
                                   ">= 0.97" if level == "strict" else ""))  # fmt: skip
        p3 = r["P3"]
        rows.append(_ratio_row("P3 reference", f"template step time, strict / fast ({setting})",
                               p3, f"fast {p3['a_median']:.0f} / strict {p3['b_median']:.0f} "
                               "images/s", f"<= {TARGET_STRICT_OVER_FAST:.2f}"))  # fmt: skip
        recipe = r["recipe"]
        rows.append({"figure": "recipe", "measure": f"projected {recipe['epochs']} epochs of the "
                     f"reference recipe at strict ({setting}), training only, seconds",
                     "ratio": f"{recipe['seconds']:.0f} s", "best": "",
                     "sides": f"{recipe['images_per_s']:.0f} images/s", "repeats": "",
                     "target": f"<= {TARGET_RECIPE_SECONDS} s on one H200"})  # fmt: skip
    cost = results.get("strict_cost") or {}
    for row in cost.get("rows", []):
        rows.append({"figure": "strict cost", "measure": f"ResNet-18 step, batch {cost['batch']}:"
                     f" {row['precision']}, deterministic {'on' if row['deterministic'] else 'off'}"
                     f", cuDNN benchmark {'on' if row['cudnn_benchmark'] else 'off'}, "
                     f"{row['layout']}", "ratio": f"{row['images_per_s']:.0f} images/s",
                     "best": "", "sides": "", "repeats": "1", "target": ""})  # fmt: skip
    if "skipped" in cost:
        rows.append({"figure": "strict cost", "measure": "ResNet-18 step table", "ratio":
                     "skipped", "best": "", "sides": cost["skipped"], "repeats": "0",
                     "target": ""})  # fmt: skip
    return rows


def _ratio_row(figure: str, measure: str, pair: dict, sides: str, target: str) -> dict:
    return {"figure": figure, "measure": measure, "ratio": fmt(pair["ratio"]),
            "best": fmt(pair["best_ratio"]), "sides": sides,
            "repeats": str(len(pair["paired_ratios"])), "target": target}  # fmt: skip


FIGURES = ("reference", "strict_cost")


def measure(only: set[str], device: str, threads: int, suite: str, repeats: int | None,
            root: Path, log=print) -> dict:  # fmt: skip
    """bench.py's entry: the figures of ``FIGURES`` that ``only`` asks for (CUDA only: on
    the CPU each is recorded as skipped with the reason)."""
    out: dict = {}
    if "reference" in only:
        if device != "cuda":
            out["reference"] = {"skipped": "CUDA only (the reference model at batch 512)"}
        else:
            full = suite == "full"
            setup = ReferenceSetup(device, threads, 3 if full else 2,
                                   50_000 if full else 25_000,
                                   repeats=repeats or (3 if full else 2))  # fmt: skip
            log("reference: P1/P3 on ResNet-18 at batch 512, the reference setting")
            out["reference"] = measure_reference(setup, root, log)
    if "strict_cost" in only:
        log("strict_cost: ResNet-18 step per precision x deterministic x benchmark x layout")
        out["strict_cost"] = measure_strict_cost(device, log=log)
    return out
