"""``make compare A=<sweep dir> B=<sweep dir>``: does B's result agree with A's, statistically?

    python -m reprotrain.tools.sweeps.compare_sweeps <sweep A> <sweep B> [--margin M] [--metric K]

Per group, TOST on the monitored final metric; each ordering A supports must hold in B.
docs/when-bits-differ.md.

Exit codes: 0 CONSISTENT; 1 INCONSISTENT (a group, or a conclusion); 3 INCONCLUSIVE;
2 user error.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprotrain import metric_names
from reprotrain.errors import ReprotrainError
from reprotrain.run.readers import read_config
from reprotrain.run.record import RESOLVED_CONFIG, RUN_JSON, atomic_write_text, now_iso
from reprotrain.shown import say, shown
from reprotrain.tools import cli
from reprotrain.tools.sweeps.equivalence import (
    CONSISTENT,
    INCONCLUSIVE,
    INCONSISTENT,
    default_margin,
    tost,
    welch,
)
from reprotrain.tools.sweeps.sweep_summary import find_jobs, group_labels

EXIT = {CONSISTENT: 0, INCONSISTENT: 1, INCONCLUSIVE: 3}
REPORT = "comparison.json"


@dataclass
class Group:
    key: tuple[str, ...]
    label: str
    values: list[float]  # the completed runs' finite final values of the metric
    seeds: list[Any]  # the seed of each value (run.json seeds), in the same order


@dataclass
class Sweep:
    path: Path
    groups: dict[tuple[str, ...], Group]
    metric: str
    mode: str  # max | min: which direction is "better"


def read_sweep(path: Path, metric: str | None = None) -> Sweep:
    """The groups of a sweep directory and their final values of ``metric``."""
    path = Path(path)
    if not path.is_dir():
        raise ReprotrainError(f"{path}: not a directory; give a sweep directory (multirun/...)")
    jobs, _ = find_jobs(path)
    done = [j for j in jobs if j.status == "completed"]
    if not done:
        raise ReprotrainError(f"no completed run ({RUN_JSON}) under {path}; is it a sweep dir?")
    trainer = read_config(done[0].run_dir / RESOLVED_CONFIG).get("trainer") or {}
    monitor, mode = str(trainer.get("monitor", "val_acc")), str(trainer.get("monitor_mode", "max"))
    if metric is not None and metric != monitor:  # test_rmse goes like val_rmse
        mode = metric_names.direction(metric, monitor, mode)
    metric = metric or monitor
    if not any(metric in j.final for j in done):
        known = sorted({k for j in done for k in j.final})
        raise ReprotrainError(
            f"{path}: no run recorded the final metric {metric!r}; pick one with --metric "
            f"(METRIC=): {', '.join(known)}"
        )
    labels = group_labels(sorted({j.group for j in done}))
    groups: dict[tuple[str, ...], Group] = {}
    for j in done:
        v = j.final.get(metric)
        g = groups.setdefault(j.group, Group(j.group, labels[j.group], [], []))
        if isinstance(v, int | float) and math.isfinite(v):
            g.values.append(float(v))
            g.seeds.append(json.dumps(j.record.get("seeds"), sort_keys=True))
    return Sweep(path, groups, metric, mode)


def match_groups(a: Sweep, b: Sweep) -> tuple[list[tuple[Group, Group]], list[str]]:
    """Pairs of groups to compare, and notes about the groups only one side has."""
    if len(a.groups) == 1 and len(b.groups) == 1:
        return [(next(iter(a.groups.values())), next(iter(b.groups.values())))], []
    pairs = [(a.groups[k], b.groups[k]) for k in sorted(a.groups) if k in b.groups]
    notes = [f"only in A: {a.groups[k].label}" for k in sorted(set(a.groups) - set(b.groups))]
    notes += [f"only in B: {b.groups[k].label}" for k in sorted(set(b.groups) - set(a.groups))]
    return pairs, notes


def distinct_seeds(group: Group) -> tuple[Group, list[str]]:
    """One value per seed (its first run) and a note per repeated seed: a rerun adds no n."""
    keep: dict[Any, float] = {}
    for seed, value in zip(group.seeds, group.values, strict=True):
        keep.setdefault(seed, value)
    times = [(s, n) for s, n in Counter(group.seeds).items() if n > 1]
    notes = [f"{group.label}: seed {shown(s, 80)} ran {n} times, counted once" for s, n in times]
    return Group(group.key, group.label, list(keep.values()), list(keep)), notes


def aligned(a: Group, b: Group) -> tuple[list[float], list[float], bool]:
    """The two samples, ordered by seed and paired when both hold the same distinct seeds."""
    if len(set(a.seeds)) == len(a.seeds) and sorted(a.seeds) == sorted(b.seeds):
        order_a = sorted(range(len(a.seeds)), key=lambda i: a.seeds[i])
        order_b = sorted(range(len(b.seeds)), key=lambda i: b.seeds[i])
        return [a.values[i] for i in order_a], [b.values[i] for i in order_b], True
    return a.values, b.values, False


def setting_difference(a: tuple[str, ...], b: tuple[str, ...]) -> str:
    """``A: optimizer.lr=0.2 vs B: optimizer.lr=0.02``: only the overrides that differ."""
    only_a = " ".join(o for o in a if o not in b) or "(its defaults)"
    only_b = " ".join(o for o in b if o not in a) or "(its defaults)"
    return f"A: {only_a} vs B: {only_b}"


def _fmt(x: float, metric: str) -> str:
    """Accuracies are shown in points (x100), anything else as it is."""
    return f"{x * 100.0:.4g} pts" if metric.endswith("_acc") else f"{x * 1.0:.4g}"


def conclusions(a: Sweep, pairs: list[tuple[Group, Group]]) -> list[dict[str, Any]]:
    """A's supported orderings of adjacent groups, checked against B."""
    if len(pairs) < 2:
        return []
    sign = 1.0 if a.mode == "max" else -1.0
    ranked = sorted(
        (p for p in pairs if p[0].values and p[1].values),
        key=lambda p: -sign * sum(p[0].values) / len(p[0].values),
    )
    out = []
    for (a1, b1), (a2, b2) in itertools.pairwise(ranked):
        archived = welch(a2.values, a1.values, 0.95)  # a1 - a2: how much better a1 is
        here = sum(b1.values) / len(b1.values) - sum(b2.values) / len(b2.values)
        gap = sign * archived.diff
        supported = archived.ci is not None and (archived.ci[0] > 0 or archived.ci[1] < 0)
        holds = sign * here > 0
        text = f"{a1.label} better than {a2.label} by {_fmt(gap, a.metric)} (archived) -> "
        if not supported:
            status = "not a conclusion"
            text += (
                f"by {_fmt(sign * here, a.metric)} here (the archived gap is within its own "
                "95% interval of 0: nothing to check)"
            )
        elif holds:
            status = "holds"
            text += f"by {_fmt(sign * here, a.metric)} here: conclusion holds"
        else:
            status = "does not hold"
            text += f"{_fmt(sign * here, a.metric)} here: conclusion does NOT hold"
        gaps = {"archived_gap": gap, "gap_here": sign * here}
        out.append({"better": a1.label, "worse": a2.label, **gaps, "status": status, "text": text})
    return out


def compare(a: Sweep, b: Sweep, margin: float | None) -> tuple[str, list[str], dict[str, Any]]:
    """(verdict, screen lines, report) for candidate ``b`` against reference ``a``."""
    if b.metric != a.metric:
        raise ReprotrainError(f"the sweeps monitor different metrics ({a.metric} vs {b.metric})")
    pairs, notes = match_groups(a, b)
    unique = []
    for ga, gb in pairs:
        (ga, notes_a), (gb, notes_b) = distinct_seeds(ga), distinct_seeds(gb)
        notes += [f"A {n}" for n in notes_a] + [f"B {n}" for n in notes_b]
        unique.append((ga, gb))
    pairs = unique
    if not pairs:
        raise ReprotrainError(
            "the sweeps have no group in common (groups are the non-seed overrides); "
            + "; ".join(notes[:4])
        )
    lines, groups = [f"metric   {a.metric} (final value per seed; {a.mode} is better)"], []
    for ga, gb in pairs:
        m, how = (margin, "MARGIN=") if margin is not None else default_margin(ga.values)
        ref, cand, pair = aligned(ga, gb)
        eq = tost(ref, cand, m, pair=pair)
        d = eq.difference
        ci = f"[{_fmt(d.ci[0], a.metric)}, {_fmt(d.ci[1], a.metric)}]" if d.ci else "none"
        name = ga.label if ga.key == gb.key else setting_difference(ga.key, gb.key)
        lines += [
            f"group    {name}: {eq.verdict} ({eq.why})",
            f"         A {_fmt(d.mean_reference, a.metric)} (n={d.n_reference})  "
            f"B {_fmt(d.mean_candidate, a.metric)} (n={d.n_candidate})  "
            f"B-A {_fmt(d.diff, a.metric)}, 90% CI {ci}{' (paired by seed)' if pair else ''}",
            f"         margin ±{_fmt(m, a.metric)} ({how})",
        ]
        groups.append({"a": ga.label, "b": gb.label, "margin_from": how, **eq.as_dict()})
    verdicts = [g["verdict"] for g in groups]
    found = conclusions(a, pairs)
    lines += [f"claim    {c['text']}" for c in found] + [f"note     {n}" for n in notes]
    if any(min(len(ga.values), len(gb.values)) < 2 for ga, gb in pairs):  # no spread to judge by
        verdict = INCONCLUSIVE
    elif INCONSISTENT in verdicts or any(c["status"] == "does not hold" for c in found):
        verdict = INCONSISTENT
    elif INCONCLUSIVE in verdicts:
        verdict = INCONCLUSIVE
    else:
        verdict = CONSISTENT
    report = {
        "created_at": now_iso(),
        "reference": str(a.path),
        "candidate": str(b.path),
        "metric": a.metric,
        "mode": a.mode,
        "test": "TOST (two one-sided Welch t tests, alpha 0.05: the 90% CI inside ±margin)",
        "groups": groups,
        "conclusions": found,
        "notes": notes,
        "verdict": verdict,
        "exit_code": EXIT[verdict],
    }
    return verdict, lines, report


def verdict_line(verdict: str) -> str:
    return {
        CONSISTENT: "CONSISTENT: equivalent within the margin (not a promise of the same bits)",
        INCONSISTENT: "INCONSISTENT: different beyond the margin, or an archived conclusion "
        "does not hold",
        INCONCLUSIVE: "INCONCLUSIVE: too few seeds or too noisy to tell (add seeds, or set "
        "MARGIN=)",
    }[verdict]


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    p = cli.parser("reprotrain.tools.sweeps.compare_sweeps", __doc__)
    p.add_argument("a", type=cli.user_path, help="reference sweep directory")
    p.add_argument("b", type=cli.user_path, help="candidate sweep directory")
    p.add_argument("--margin", type=cli.positive_float, default=None, help="equivalence margin")
    p.add_argument("--metric", default=None, help="final metric (default: trainer.monitor)")
    args = p.parse_args(argv)
    a = read_sweep(args.a, args.metric)
    b = read_sweep(args.b, args.metric or a.metric)
    verdict, lines, report = compare(a, b, args.margin)
    atomic_write_text(args.b / REPORT, json.dumps(report, indent=2, sort_keys=True) + "\n")
    for line in lines:
        say(line)
    say(f"report   {args.b / REPORT}")
    say(verdict_line(verdict))
    return EXIT[verdict]


if __name__ == "__main__":
    sys.exit(main())
