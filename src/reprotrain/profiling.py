"""Profile N training steps with ``torch.profiler``: ``steps.pt.trace.json.gz`` (Perfetto,
TensorBoard) and ``top_ops.txt`` in ``out_dir`` (docs/seeing-a-run.md).

The first ``warmup`` steps run unrecorded (one-off costs); profiling touches no RNG.
"""

from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

TRACE_NAME = "steps.pt.trace.json.gz"
TABLE_NAME = "top_ops.txt"


class Profiler:
    def __init__(
        self, out_dir: Path, steps: int, device: torch.device | str = "cpu", warmup: int = 1
    ) -> None:
        if steps < 1:
            raise ValueError("steps must be >= 1")
        self.out_dir = Path(out_dir)
        self.steps, self.warmup = steps, warmup
        self.cuda = torch.device(device).type == "cuda"
        self.trace_path = self.out_dir / TRACE_NAME
        self.table_path = self.out_dir / TABLE_NAME
        self.table: str | None = None
        self.done = False
        self._seen = 0  # steps taken under the profiler (warm-up included)
        self._prof: Any = None

    def start(self) -> Profiler:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=self.warmup, active=self.steps, repeat=1),
            on_trace_ready=self._ready,
            record_shapes=False,
            with_stack=False,
        )
        self._prof.start()
        return self

    def step(self) -> None:
        """Call once after every training step."""
        if self._prof is None or self.done:
            return
        self._seen += 1
        self._prof.step()  # after warmup + steps calls the schedule saves: _ready runs
        if self.done:
            self.stop()

    def stop(self) -> str | None:
        """End profiling (early, if the run had fewer steps); the table, or None."""
        if self._prof is not None:
            self._prof.stop()  # a partial recording is still saved through _ready
            self._prof = None
        return self.table

    def __enter__(self) -> Profiler:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _ready(self, prof: Any) -> None:
        self.done = True
        recorded = max(0, min(self._seen - self.warmup, self.steps))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.out_dir) as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            partial = self.trace_path.with_name(self.trace_path.name + ".tmp")
            with raw.open("rb") as src, gzip.open(partial, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            partial.replace(self.trace_path)
        self.table = top_ops_table(
            prof.key_averages(), max(recorded, 1), self.cuda, planned=self.steps
        )
        self.table_path.write_text(self.table + "\n")


def top_ops_table(
    averages: Any, recorded: int, cuda: bool, row_limit: int = 15, planned: int | None = None
) -> str:
    """The ops with the most self time (device on CUDA, else CPU; children excluded, so rows
    add up), per profiled step, in one screen (<= 100 columns)."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(averages, key=lambda e: getattr(e, key, 0.0), reverse=True)[:row_limit]
    total = sum(getattr(e, key, 0.0) for e in averages) or 1.0
    name_w = 44
    head = f"{'op':<{name_w}} {'calls':>6} {'self CPU ms':>11} {'CPU ms':>9}"
    if cuda:
        head += f" {'self CUDA ms':>12}"
    head += f" {'share':>6}"
    what = "self CUDA" if cuda else "self CPU"
    note = f" (of {planned} planned)" if planned and planned != recorded else ""
    lines = [
        f"top {len(events)} ops by {what} time, per step, over {recorded} profiled steps{note}",
        head,
        "-" * len(head),
    ]
    for e in events:
        name = e.key if len(e.key) <= name_w else e.key[: name_w - 1] + "…"
        row = (
            f"{name:<{name_w}} {e.count // recorded:>6} "
            f"{e.self_cpu_time_total / 1e3 / recorded:>11.3f} "
            f"{e.cpu_time_total / 1e3 / recorded:>9.3f}"
        )
        if cuda:
            row += f" {getattr(e, 'self_device_time_total', 0.0) / 1e3 / recorded:>12.3f}"
        row += f" {100 * getattr(e, key, 0.0) / total:>5.1f}%"
        lines.append(row)
    return "\n".join(lines)
