"""bench.json (everything measured) and bench.md (one table row per ratio)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.reference_model import reference_rows
from benchmarks.stats import fmt
from reprotrain.run.record import atomic_write_text

TARGETS = {  # issue 11's targets, shown next to the measurement
    "P1 strict": ">= 0.97",
    "P2 device": ">= 5 (CPU), >= 10 (GPU)",
    "P3 strict/fast": "<= 1.05 on a GPU",
    "P5": "<= 0.02 on a GPU",
    "invariant": "<= 1.15 at W=2",
    "overhead": "<= 100 us (2-core CPU)",
}


def _row(figure: str, measure: str, result: dict, a: str, b: str, unit: str, **kw) -> dict:
    return {
        "figure": figure,
        "measure": measure,
        "ratio": fmt(result["ratio"]),
        "best": fmt(result["best_ratio"]),
        "sides": f"{a} {result['a_median']:{unit}} / {b} {result['b_median']:{unit}}",
        "repeats": str(len(result["paired_ratios"])),
        "target": kw.get("target", ""),
    }


def table_rows(results: dict) -> list[dict]:
    """The bench.md rows, from the bench.json content (missing figures are skipped)."""
    figures = (_p1_rows, _p2_rows, _p3_rows, _portable_rows, _p4_rows, _p5_rows, _logger_rows,
               _replay_rows, _invariant_rows, _overhead_rows, reference_rows)  # fmt: skip
    return [row for figure in figures for row in figure(results)]


def _p1_rows(results: dict) -> list[dict]:
    """P1: the template against the bare loop, per determinism level."""
    rows: list[dict] = []
    for level, r in results.get("P1", {}).items():
        rows.append(
            _row(
                f"P1 {level}",
                "template / bare loop, train images/s",
                r,
                "template",
                "bare",
                ".0f",
                target=TARGETS.get(f"P1 {level}", ""),
            )
        )
    return rows


def _p2_rows(results: dict) -> list[dict]:
    """P2: each pipeline against torchvision's PIL DataLoader."""
    rows: list[dict] = []
    p2 = results.get("P2", {})
    for key, r in p2.items():
        if key.endswith("_vs_torchvision"):
            name = key.removesuffix("_vs_torchvision")
            rows.append(
                _row(
                    f"P2 {name.split('_')[0]}",
                    f"{name.replace('_', ' ')} / torchvision PIL DataLoader, images/s",
                    r,
                    name.split("_")[0],
                    "torchvision",
                    ".0f",
                    target=TARGETS["P2 device"] if name == "device" else "",
                )
            )
    return rows


def _p3_rows(results: dict) -> list[dict]:
    """P3: strict against fast, and fill_uninitialized_memory on against off."""
    rows: list[dict] = []
    p3 = results.get("P3", {})
    labels = {
        "template_strict_over_fast_step_time": (
            "P3 strict/fast",
            "template step time, strict / fast",
        ),
        "bare_strict_over_fast_step_time": ("P3 bare", "bare loop step time, strict / fast"),
        "fill_uninitialized_memory_step_time": (
            "P3 fill",
            "step time, fill_uninitialized_memory on / off (strict)",
        ),
    }
    for key, (figure, measure) in labels.items():
        if key in p3:
            a, b = ("fast", "strict") if "over_fast" in key else ("off", "on")
            row = _row(figure, measure, p3[key], a, b, ".0f", target=TARGETS.get(figure, ""))
            row["sides"] += " images/s"
            rows.append(row)
    return rows


def _portable_rows(results: dict) -> list[dict]:
    """repro=portable against strict: the cost of the x86-64-wide CPU paths."""
    r = results.get("portable", {})
    measure = "template step time, portable / strict"
    if "skipped" in r:
        return [{"figure": "portable", "measure": measure, "ratio": "skipped", "best": "",
                 "sides": r["skipped"], "repeats": "0", "target": ""}]  # fmt: skip
    if not r:
        return []
    row = _row("portable", measure, r, "strict", "portable", ".0f")
    row["sides"] += " images/s"
    return [row]


def _p4_rows(results: dict) -> list[dict]:
    """P4: the augmentation fast path against the reference gather."""
    rows: list[dict] = []
    if "P4" in results:
        r = results["P4"]
        row = _row(
            "P4",
            f"augment time per batch of {r['batch_size']}, reference gather / fast path",
            r,
            "reference",
            "fast",
            ".4f",
        )
        row["sides"] += " s" + ("" if r.get("bit_identical") else " (NOT bit-identical!)")
        rows.append(row)
    return rows


def _p5_rows(results: dict) -> list[dict]:
    """P5: checkpoint save+load against one (estimated) epoch."""
    rows: list[dict] = []
    if "P5" in results:
        r = results["P5"]
        model = f"{r['params'] / 1e6:.1f}M params"
        row = _row(
            "P5",
            f"checkpoint save+load / one epoch ({model}; epoch ESTIMATED as "
            f"{r['steps_per_epoch']} x step time)",
            r,
            "ckpt",
            "epoch",
            ".2f",
            target=TARGETS["P5"],
        )
        row["ratio"], row["best"] = f"{r['ratio']:.4f}", f"{r['best_ratio']:.4f}"
        row["sides"] += " s"
        rows.append(row)
    return rows


def _replay_rows(results: dict) -> list[dict]:
    """A resume's replay against the interval it replays."""
    if "replay" not in results:
        return []
    row = _row("replay", "resume replay / checkpoint interval (1 epoch), seconds",
               results["replay"], "replay", "interval", ".2f")  # fmt: skip
    row["sides"] += " s"
    return [row]


def _logger_rows(results: dict) -> list[dict]:
    """The default logger against logger=none."""
    rows: list[dict] = []
    logger = results.get("logger", {})
    if "skipped" in logger:
        rows.append(
            {
                "figure": "logger",
                "measure": "template step time, default logger / logger=none",
                "ratio": "skipped",
                "best": "",
                "sides": logger["skipped"],
                "repeats": "0",
                "target": "",
            }
        )
    elif logger:
        rows.append(
            _row(
                "logger",
                "template step time, default logger / logger=none",
                logger,
                "none",
                "default",
                ".0f",
            )
        )
    return rows


def _invariant_rows(results: dict) -> list[dict]:
    """The world-size-invariant step against a plain DDP step."""
    rows: list[dict] = []
    if "invariant" in results:
        r = results["invariant"]
        row = _row(
            "invariant",
            f"step time, world-size-invariant / plain DDP (W={r['world_size']}, micro-batch "
            f"{r['microbatch_size']}, k={r['microbatches_per_step']}, "
            f"{r['threads_per_rank']} thread/rank)",
            r,
            "ddp",
            "invariant",
            ".0f",
            target=TARGETS["invariant"],
        )
        row["sides"] += " images/s"
        rows.append(row)
        rows += _invariant_ops_rows(r.get("ops_per_step", {}))
    return rows


def _invariant_ops_rows(counts: dict) -> list[dict]:
    """Beside the invariant figure: each step's kernel-launching ops (a GPU's cost for small
    tensors), invariant / plain DDP, per model (``invariance_cost.count_ops``)."""
    rows = []
    for model, sides in counts.items():
        if not isinstance(sides, dict):
            continue
        ddp, inv = sides["ddp"], sides["invariant"]
        rows.append({
            "figure": "invariant ops",
            "measure": f"kernel-launching ops per step, world-size-invariant / plain DDP "
                       f"(W=1, k={counts['microbatches_per_step']}, {model}, counted on CPU)",
            "ratio": fmt(inv["kernels"] / ddp["kernels"]),
            "best": "",
            "sides": f"ddp {ddp['kernels']} / invariant {inv['kernels']} ops (views and "
                     f"allocations: {ddp['metadata']} / {inv['metadata']})",
            "repeats": "1",
            "target": "",
        })  # fmt: skip
    return rows


def _us(value: float) -> str:
    return f"{value:.0f} us"


def _overhead_rows(results: dict) -> list[dict]:
    """The template's work per step on a null model, in microseconds (not a ratio)."""
    r = results.get("overhead")
    if not r:
        return []
    measure = (f"template - bare loop per step, null model (batch {r['batch_size']}, "
               f"{r['threads']} thread), microseconds")  # fmt: skip
    sides = (f"template {_us(r['template_us_per_step'])} / bare {_us(r['bare_us_per_step'])} "
             f"per step ({r['ratio']:.2f}x)")  # fmt: skip
    repeats = str(len(r["paired_us_per_step"]))
    return [{"figure": "overhead", "measure": measure, "ratio": _us(r["us_per_step"]),
             "best": _us(r["best_us_per_step"]), "sides": sides, "repeats": repeats,
             "target": TARGETS["overhead"]}]  # fmt: skip


COLUMNS = ("figure", "measure", "ratio", "best", "sides", "repeats", "target")


def markdown_table(rows: list[dict]) -> str:
    """A GitHub-markdown table; a '|' inside a cell is escaped so columns stay aligned."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [str(row.get(c, "")).replace("|", "\\|") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: Path, results: dict) -> tuple[Path, Path]:
    """bench.json, then bench.md; both written atomically (no half file looks complete)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "bench.json", out_dir / "bench.md"
    atomic_write_text(json_path, json.dumps(results, indent=2, sort_keys=True) + "\n")
    host = results.get("host", {})
    header = (
        f"# make bench ({results.get('suite', '?')}, device {results.get('device', '?')})\n\n"
        f"{host.get('device_name', '')}, torch {host.get('torch', '')}, "
        f"{host.get('threads', '')} threads, {results.get('stamp', '')}; "
        f"{results.get('seconds', 0):.0f} s wall, {results.get('cpu_seconds', 0):.0f} CPU-s\n\n"
        "`ratio`: the median of per-repeat ratios, the two sides measured back to back "
        "(A, B, A, B, ...). `best`: best repeat of A / best repeat of B (other work on the "
        "machine only slows a side down). `sides`: each side's median.\n\n"
    )
    atomic_write_text(md_path, header + markdown_table(table_rows(results)))
    return json_path, md_path
