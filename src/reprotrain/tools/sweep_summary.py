"""Aggregate a seed sweep: mean, std, min, max and a 95% confidence interval per metric.

Reads each job's ``run.json`` under the sweep directory (so it works with any Hydra
launcher, or with runs gathered by hand) and writes ``summary.json`` and ``summary.md``.
Runs as a Hydra callback at the end of ``--multirun`` and as a command:

    python -m reprotrain.tools.sweep_summary multirun/<name>/<stamp>
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from reprotrain.repro.record import RUN_JSON, atomic_write_text

# Two-sided 95% Student-t quantiles t_{0.975, df}, df = 1..30 (standard table values).
_T975 = [
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
]


def t975(df: int) -> float:
    """t quantile; beyond the table, the Cornish-Fisher expansion around z=1.96."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def describe(values: list[float]) -> dict[str, Any]:
    n = len(values)
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if n > 1 else 0.0
    half = t975(n - 1) * std / math.sqrt(n) if n > 1 else float("nan")
    return {
        "n": n,
        "mean": mean,
        "std": std,
        "min": min(values),
        "max": max(values),
        "ci95": [mean - half, mean + half],
    }


def summarize(sweep_dir: Path) -> dict[str, Any]:
    runs = []
    for path in sorted(Path(sweep_dir).rglob(RUN_JSON)):
        data = json.loads(path.read_text())
        if data.get("status") == "completed":
            runs.append(data)
    metrics = sorted(  # accuracies and losses; step counts and the final lr are not outcomes
        {k for r in runs for k in r.get("final_metrics", {}) if k.endswith(("_acc", "_loss"))}
    )
    return {
        "sweep_dir": str(sweep_dir),
        "runs": [
            {
                "run_dir": r["run_dir"],
                "seed": r["seeds"]["base"],
                **{m: r["final_metrics"].get(m) for m in metrics},
            }
            for r in runs
        ],
        "metrics": {
            m: describe([r["final_metrics"][m] for r in runs if m in r["final_metrics"]])
            for m in metrics
        },
    }


def to_markdown(summary: dict[str, Any]) -> str:
    metrics = list(summary["metrics"])
    lines = ["| seed | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for r in summary["runs"]:
        lines.append(f"| {r['seed']} | " + " | ".join(f"{r[m]:.4f}" for m in metrics) + " |")
    for stat in ("mean", "std", "min", "max"):
        vals = [summary["metrics"][m][stat] for m in metrics]
        lines.append(f"| **{stat}** | " + " | ".join(f"{v:.4f}" for v in vals) + " |")
    cis = [summary["metrics"][m]["ci95"] for m in metrics]
    lines.append("| **95% CI** | " + " | ".join(f"[{lo:.4f}, {hi:.4f}]" for lo, hi in cis) + " |")
    return "\n".join(lines) + "\n"


def write_summary(sweep_dir: Path) -> dict[str, Any]:
    summary = summarize(sweep_dir)
    atomic_write_text(Path(sweep_dir) / "summary.json", json.dumps(summary, indent=2))
    atomic_write_text(Path(sweep_dir) / "summary.md", to_markdown(summary))
    return summary


class SweepSummaryCallback(Callback):
    """Hydra callback: summarise the sweep directory when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        summary = write_summary(sweep_dir)
        print(f"sweep summary ({len(summary['runs'])} runs): {sweep_dir / 'summary.md'}")
        print(to_markdown(summary))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    args = parser.parse_args(argv)
    summary = write_summary(args.sweep_dir)
    if not summary["runs"]:
        print(f"error: no completed run.json under {args.sweep_dir}", file=sys.stderr)
        return 1
    print(to_markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
