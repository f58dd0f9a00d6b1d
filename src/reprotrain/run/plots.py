"""PNG figures of a run and of a sweep, drawn from plain numbers (no training objects).
Matplotlib's object API on an Agg canvas, never ``pyplot``: no global figure state, no GUI
backend picked from the environment. ``None`` or NaN inputs become gaps, never errors."""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 130
TRAIN, VAL, TEST = "#1f77b4", "#ff7f0e", "#2ca02c"
SPLIT_COLOURS = {"train": TRAIN, "val": VAL, "test": TEST}


def _f(v: Any) -> float:
    """None / non-numbers -> NaN, so matplotlib leaves a gap instead of failing."""
    return math.nan if isinstance(v, bool) or not isinstance(v, int | float) else float(v)


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def _style(ax: Any, xlabel: str, ylabel: str, title: str) -> None:
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=11, loc="left")
    ax.grid(True, alpha=0.3, linewidth=0.6)
    ax.spines[["top", "right"]].set_visible(False)


def _maybe_log(ax: Any, values: Sequence[float]) -> None:
    """Log y when the finite values span more than 10x (early losses dwarf later ones)."""
    finite = [v for v in values if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) > 10:
        from matplotlib.ticker import FuncFormatter, LogLocator

        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` finite values (NaN stays a gap)."""
    out, buf = [], []
    for v in values:
        if not math.isfinite(v):
            out.append(math.nan)
            continue
        buf.append(v)
        if len(buf) > window:
            buf.pop(0)
        out.append(sum(buf) / len(buf))
    return out


@dataclass
class RunCurves:
    """What a run figure needs; every list may contain None."""

    title: str
    subtitle: str
    epochs: list[int]
    epoch_steps: list[int]  # global step at the end of each epoch (the x of epoch rows)
    epoch_series: dict[str, list[Any]]  # train_loss, val_acc, lr, ... one value per epoch
    steps: list[int] = field(default_factory=list)  # per-step x (may be empty)
    step_loss: list[Any] = field(default_factory=list)
    step_lr: list[Any] = field(default_factory=list)
    overrides: str = ""  # the run's hyperparameters as given, shown under the title


def _epoch_axis(ax: Any, epochs: list[int], epoch_steps: list[int]) -> None:
    """A top axis in epochs, mapped through the recorded epoch-end steps."""
    if len(epochs) < 1 or not epoch_steps or epoch_steps[-1] <= 0:
        return
    import numpy as np

    xs = np.array([0, *epoch_steps], dtype=float)
    es = np.array([epochs[0] - 1, *epochs], dtype=float)
    if np.any(np.diff(xs) <= 0):
        return
    top = ax.secondary_xaxis(
        "top", functions=(lambda s: np.interp(s, xs, es), lambda e: np.interp(e, es, xs))
    )
    top.set_xlabel("epoch", fontsize=9)
    top.tick_params(labelsize=8)
    if len(epochs) <= 12:
        top.set_xticks(list(es))
    else:
        from matplotlib.ticker import MaxNLocator

        top.xaxis.set_major_locator(MaxNLocator(integer=True))


def metric_names(series: dict[str, Any]) -> list[str]:
    """The task's metric names in ``<split>_<name>`` keys, loss first, then as they appear."""
    names: list[str] = []
    for key in series:
        split, _, name = key.partition("_")
        if split in SPLIT_COLOURS and name and name not in names:
            names.append(name)
    return sorted(names, key=lambda n: n != "loss")


def metric_label(name: str) -> str:
    return "accuracy" if name == "acc" else name


def plot_run(c: RunCurves) -> bytes:
    """Loss, each other metric, and learning rate against the global step (epochs on top)."""
    others = [n for n in metric_names(c.epoch_series) if n != "loss"]
    fig = Figure(figsize=(5 * (2 + len(others)), 4.8), layout="constrained")
    ax_loss, *ax_metrics, ax_lr = fig.subplots(1, 2 + len(others), squeeze=False).ravel()
    xlabel = "global step (optimizer updates)"
    ex = c.epoch_steps

    # Loss: every step (faint), its running mean, then the epoch means and evaluations.
    loss_values: list[float] = []
    if c.steps:
        raw = [_f(v) for v in c.step_loss]
        window = max(1, len(raw) // 40)
        faint = dict(alpha=0.3, lw=0.7) if window > 1 else dict(alpha=0.9, lw=1.0)
        ax_loss.plot(c.steps, raw, color=TRAIN, label="train, per step", **faint)
        if window > 1:
            label = f"train, mean of last {window} steps"
            ax_loss.plot(c.steps, smooth(raw, window), color=TRAIN, lw=1.6, label=label)
        loss_values += raw
        bad = [s for s, v in zip(c.steps, raw, strict=True) if not math.isfinite(v)]
        if bad:  # a gap alone is easy to miss: mark where the loss stopped being a number
            label = f"first non-finite loss (step {bad[0]})"
            ax_loss.axvline(bad[0], color="#d62728", ls="--", lw=1.2, label=label)
    for split, colour in SPLIT_COLOURS.items():
        ys = [_f(v) for v in c.epoch_series.get(f"{split}_loss", [])]
        if any(math.isfinite(v) for v in ys):
            style = dict(marker="o", ms=5, lw=1.2 if split != "train" else 0)
            label = "train, epoch mean" if split == "train" else f"{split}, end of epoch"
            ax_loss.plot(ex, ys, color=colour, label=label, **style)
            loss_values += ys
    _maybe_log(ax_loss, loss_values)
    _style(ax_loss, xlabel, "loss", "Loss")

    # Every other metric: per epoch only (per-step metrics are not recorded).
    for ax, name in zip(ax_metrics, others, strict=True):
        k = 100.0 if name == "acc" else 1.0
        for split, colour in SPLIT_COLOURS.items():
            ys = [k * _f(v) for v in c.epoch_series.get(f"{split}_{name}", [])]
            if any(math.isfinite(v) for v in ys):
                ax.plot(ex, ys, color=colour, marker="o", ms=5, lw=1.4, label=split)
        if name == "acc":
            ax.set_ylim(0, 100)
        unit = " (%)" if name == "acc" else ""
        label = metric_label(name)
        _style(ax, xlabel, f"{label}{unit}", f"{label[:1].upper()}{label[1:]} (per epoch)")

    # Learning rate: per step when recorded, else the value at each epoch's end.
    if c.steps and c.step_lr and any(math.isfinite(_f(v)) for v in c.step_lr):
        ax_lr.plot(c.steps, [_f(v) for v in c.step_lr], color="#9467bd", lw=1.4, label="per step")
    else:
        lrs = [_f(v) for v in c.epoch_series.get("lr", [])]
        if any(math.isfinite(v) for v in lrs):
            # Points only: a line between epoch ends would invent the schedule in between.
            ax_lr.plot(ex, lrs, color="#9467bd", marker="o", ms=6, lw=0, label="end of epoch")
            note = "per-step lr not recorded"
            ax_lr.text(
                0.5, 0.02, note, transform=ax_lr.transAxes, ha="center", fontsize=8, color="0.4"
            )
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    _style(ax_lr, xlabel, "learning rate", "Learning rate")

    last = max([*c.steps, *c.epoch_steps, 1])
    for ax in (ax_loss, *ax_metrics, ax_lr):
        ax.set_xlim(0, last * 1.02)  # one x range for all three panels
        _epoch_axis(ax, c.epochs, c.epoch_steps)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, frameon=False)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes)
    width = 30 * (2 + len(others))
    given = textwrap.wrap(f"overrides: {c.overrides}", width) if c.overrides else []
    fig.suptitle("\n".join([c.title, *given, c.subtitle]), fontsize=10, x=0.01, ha="left")
    return _png(fig)


@dataclass
class Band:
    """One group's per-epoch statistics of one metric across seeds."""

    label: str
    epochs: list[int]
    mean: list[float | None]
    lo: list[float | None]
    hi: list[float | None]
    n: list[int]
    runs: list[list[Any]] = field(default_factory=list)  # each seed's values, for thin lines


#: Characters of a 9-point legend label per inch of figure (a conservative average width).
LEGEND_CHARS_PER_INCH = 12


def legend_layout(labels: list[str], width_in: float) -> tuple[list[str], int]:
    """Labels wrapped to the figure's width, and as many columns (at most 4) as fit in it."""
    room = max(20, int(width_in * LEGEND_CHARS_PER_INCH) - 6)  # 6: the line sample and gap
    wrapped = [textwrap.fill(label, room) for label in labels]
    widest = max((len(line) for w in wrapped for line in w.splitlines()), default=1) + 6
    return wrapped, max(1, min(len(labels), 4, (room + 6) // widest))


def plot_sweep(title: str, panels: dict[str, list[Band]], cols: int, band_note: str) -> bytes:
    """One panel per metric; per group a mean line, a band and faint per-seed lines (up to 10)."""
    names = list(panels)
    cols = max(1, min(cols, len(names)))
    rows = math.ceil(len(names) / cols)
    width = max(6.0 * cols, 8.0)
    fig = Figure(figsize=(width, 4.0 * rows + 1.0), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    handles: dict[str, Any] = {}
    for ax, metric in zip(axes, names, strict=False):
        pct = metric.endswith("_acc")
        k = 100.0 if pct else 1.0
        seen: list[float] = []
        for i, band in enumerate(panels[metric]):
            colour = f"C{i % 10}"  # matplotlib's ten default colours, in turn
            if len(band.runs) <= 10:
                for run in band.runs:
                    ys = [k * _f(v) for v in run]
                    ax.plot(band.epochs[: len(ys)], ys, color=colour, alpha=0.3, lw=0.8)
                    seen += ys
            mean = [k * _f(v) for v in band.mean]
            (line,) = ax.plot(band.epochs, mean, color=colour, lw=2.2, marker="o", ms=4)
            handles.setdefault(f"{band.label}  (n={max(band.n, default=0)})", line)
            lo = [k * _f(v) for v in band.lo]
            hi = [k * _f(v) for v in band.hi]
            ax.fill_between(band.epochs, lo, hi, color=colour, alpha=0.18, lw=0)
            seen += mean + lo + hi
        if not pct:
            _maybe_log(ax, seen)
        elif finite := [v for v in seen if math.isfinite(v)]:
            pad = 0.1 * (max(finite) - min(finite)) or 1.0
            ax.set_ylim(max(0.0, min(finite) - pad), min(100.0, max(finite) + pad))
        ax.xaxis.get_major_locator().set_params(integer=True)
        _style(ax, "epoch", _ylabel(metric), metric.replace("_", " "))
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    fig.suptitle(f"{title}\n{band_note}", fontsize=10, x=0.01, ha="left")
    labels, ncols = legend_layout(list(handles), width)
    where = "outside lower center"
    fig.legend(list(handles.values()), labels, loc=where, ncols=ncols, frameon=False, fontsize=9)
    return _png(fig)


def _ylabel(metric: str) -> str:
    if metric.endswith("_acc"):
        return "accuracy (%)"
    if metric.endswith("_loss"):
        return "loss"
    return metric
