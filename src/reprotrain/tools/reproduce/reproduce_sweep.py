"""``make reproduce`` of a sweep archive: replay every archived run, then one verdict.

One replay plan, trusted or refused as a whole. Exit: 0 REPRODUCED, 1 DIVERGED (bitwise) or
0 CONSISTENT, 1 INCONSISTENT, 3 INCONCLUSIVE (statistical); docs/archive-and-reproduce.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from reprotrain.errors import ReproduceRefused, ReprotrainError
from reprotrain.run import schema as run_schema
from reprotrain.run.bounded import load_yaml
from reprotrain.run.readers import parse_json_object, parse_record, parse_yaml_config, read_run_json
from reprotrain.run.record import to_strict_json
from reprotrain.shown import say, shown
from reprotrain.tools import cli
from reprotrain.tools.archive import archive_check
from reprotrain.tools.archive.archive_check import CheckedArchive
from reprotrain.tools.archive.sweep_archive import SWEEP
from reprotrain.tools.debugging.bisect import bisect_command
from reprotrain.tools.reproduce import rerun, study_check
from reprotrain.tools.runs.run_diff import compare_runs, with_metrics
from reprotrain.tools.sweeps import compare_sweeps
from reprotrain.tools.sweeps.sweep_summary import find_jobs


def archived_jobs(checked: archive_check.CheckedArchive) -> list[tuple[str, CheckedArchive]]:
    """(folder under sweep/, the archive as if it held only that run) per job, each checked."""
    meta = parse_json_object(checked.text(archive_check.ARCHIVE_JSON), "archive.json")
    jobs, where = meta.get("jobs"), checked.label("archive.json")
    if not isinstance(jobs, list) or not jobs:
        raise ReproduceRefused(f"{where}: no list of jobs")
    out = []
    for rel in jobs:
        if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/"):
            raise ReproduceRefused(f"{where}: job {shown(rel, 60)} is not a folder under sweep/")
        base = f"{SWEEP}/{rel}"
        check_overrides(checked, f"{base}/.hydra/overrides.yaml")
        files = {}
        for name in ("run.json", "config.resolved.yaml", "fingerprints.jsonl", "git.diff"):
            data = checked.member(f"{base}/{name}")
            if data is not None:
                files[f"run/{name}"] = data
        if "run/run.json" not in files or "run/config.resolved.yaml" not in files:
            raise ReproduceRefused(f"{checked.label(base)}: no run.json or config.resolved.yaml")
        view = dataclasses.replace(checked, files=files)
        label = view.label(f"{base}/run.json")
        view.record = parse_record(view.text("run/run.json"), label, run_schema.REPLAY)
        view.config = parse_yaml_config(view.text("run/config.resolved.yaml"), base)
        config = OmegaConf.to_container(view.config)
        archive_check.check_config_identity(view.record, config, f"{base}/config.resolved.yaml")
        out.append((str(rel), view))
    return out


def check_overrides(checked: CheckedArchive, rel: str) -> None:
    """A job's ``.hydra/overrides.yaml`` (its group) must be a YAML list of strings."""
    data = checked.member(rel)
    if data is None:
        return
    where, damaged = checked.label(rel), "the record was edited or damaged"
    try:
        overrides = load_yaml(data.decode("utf-8"), where)  # bounded
    except (UnicodeDecodeError, yaml.YAMLError):
        overrides = None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ReproduceRefused(f"{where}: not a YAML list of overrides; {damaged}")


def replay(run: rerun.Reproduction, study: dict[str, Any] | None = None) -> int:
    """Re-run every job of a trusted sweep archive's plan; the verdict's exit code."""
    reasons, jobs = run.data_problems(), run.plan.jobs
    say(f"sweep    {len(jobs)} archived run(s)")
    if reasons:
        say(f"data     DIFFERS: {reasons[0]}")
    with run.extracted() as top:
        new_sweep = cli.stamped_dir(run.args.runs_dir)
        (new_sweep / "logs").mkdir(parents=True)
        say(f"re-run   from the archived source ({top / 'source'}), into {new_sweep}")
        for i, job in enumerate(jobs):
            with open(new_sweep / "logs" / f"job-{i}.log", "w") as log:
                into = new_sweep / job.name
                done = rerun.rerun_job(run.trust, job, top, into, None, log, f"job-{i}")
            if isinstance(done, int):
                return done
            reasons += done.reasons
            base = shown(job.record["seeds"]["base"])
            say(f"  {shown(job.name)}: seeds base={base} -> done ({i + 1}/{len(jobs)} runs)")
        return _verdict(run, top / SWEEP, new_sweep, list(dict.fromkeys(reasons)), study)


def _verdict(run: rerun.Reproduction, archived: Path, new_sweep: Path, reasons, study) -> int:
    """Bitwise, or statistical where bits are not promised; demoted where a record does not hold."""
    mode = run.args.mode
    statistical = mode == "statistical" or (mode == "auto" and bool(reasons))
    for r in reasons:
        say(f"env      {r}")
    report = {"bits_not_promised": reasons, "mode": "statistical" if statistical else "bitwise"}
    rerun.PHASES("compare")
    if statistical:
        code, verdict = _statistical(run.args, archived, new_sweep, run.plan.jobs, report)
    else:
        code, verdict = _bitwise(archived, new_sweep, run.plan.jobs, report)
    head = compare_sweeps.INCONSISTENT if statistical else "DIVERGED"
    if study is not None:
        found = study_check.differences(study, archived, new_sweep, values=not statistical)
        report["study_differences"] = found
        best = shown((study.get("best") or {}).get("job", "none"), 60)
        holds = f"{len(study['trials'])} trial(s), best {best}, recomputed from the runs"
        if not found:
            say(f"study    study.json holds: {holds}")
        code, verdict = _held(found, "study", f"{head}: study.json") or (code, verdict)
    report["summary_differences"] = found = summary_differences(archived)
    demoted = _held(found, "summary", f"{head}: summary.json")
    if demoted and code != 1:
        code, verdict = demoted
    return run.finish(new_sweep, report, code, verdict, f"report   {new_sweep / rerun.REPORT}")


def _held(found: list[str], tag: str, record: str) -> tuple[int, str] | None:
    """Up to ten ``found`` differences said; the verdict they demote to, or None if none."""
    for line in found[:10]:
        say(f"{tag:8} {line}")
    if len(found) > 10:
        say(f"{tag:8} ... and {len(found) - 10} more (reproduction.json)")
    if found:
        return 1, f"{record} does not hold ({len(found)} difference(s)): {found[0]}"
    return None


def _claims_differ(said: Any, here: Any) -> bool:
    """Whether ``said`` differs from ``here``; mappings only over the keys both hold."""
    if isinstance(said, dict) and isinstance(here, dict):
        return any(_claims_differ(v, here[k]) for k, v in said.items() if k in here)
    return said != here


def summary_differences(sweep: Path) -> list[str]:
    """How the archived summary.json differs from one recomputed from the archived runs."""
    from reprotrain.tools.sweeps import sweep_summary

    path = sweep / sweep_summary.SUMMARY_JSON
    if not path.is_file():
        return []
    try:
        said = parse_json_object(path.read_text(), "summary.json")
    except (OSError, UnicodeDecodeError, ValueError, ReprotrainError) as e:
        return [f"summary.json cannot be read ({shown(e, 200)})"]
    here, _ = to_strict_json(sweep_summary.summarize(sweep))  # its JSON form, as written
    here = json.loads(json.dumps(here))
    out = []
    if _claims_differ(said.get("objective"), here.get("objective")):
        a, b = shown(said.get("objective"), 120), shown(here.get("objective"), 120)
        out.append(f"summary.json objective {a}, the archived runs give {b}")
    theirs = {g.get("label"): g for g in said.get("groups") or [] if isinstance(g, dict)}
    ours = {g["label"]: g for g in here["groups"]}
    for label in sorted(set(ours) - set(theirs), key=str):
        out.append(f"group {shown(label, 60)} of the archived runs is not in summary.json")
    for label, group in theirs.items():
        named = f"summary.json group {shown(label, 60)}"
        if label not in ours:
            out.append(f"{named} is not in the archived runs")
            continue
        metrics = group.get("metrics") if isinstance(group.get("metrics"), dict) else {}
        for metric, stats in metrics.items():
            if _claims_differ(stats, ours[label]["metrics"].get(metric)):
                out.append(f"{named} {shown(metric)}: not what the archived runs give")
    return out


def _bitwise(archived: Path, new_sweep: Path, jobs, report) -> tuple[int, str]:
    diverged = []
    for job in jobs:
        there, replayed = archived / job.name, new_sweep / job.name
        result = with_metrics(compare_runs(there, replayed), there, replayed)
        if not result.identical:
            diverged.append((job.name, result.verdict()))
    report["diverged"] = [{"job": j, "verdict": v} for j, v in diverged]
    if not diverged:
        return 0, f"REPRODUCED (bitwise): all {len(jobs)} runs match the archived ones"
    rel, verdict = diverged[0]
    say(f"  first divergent op: {bisect_command(archived / rel, new_sweep / rel)}")
    return 1, f"DIVERGED: {len(diverged)}/{len(jobs)} run(s); {rel}: {verdict}"


def _statistical(args, archived: Path, new_sweep: Path, jobs, report) -> tuple[int, str]:
    reference = compare_sweeps.read_sweep(archived, args.metric)
    candidate = compare_sweeps.Sweep(new_sweep, {}, reference.metric, reference.mode)
    there = {j.run_dir.relative_to(archived).as_posix(): j for j in find_jobs(archived)[0]}
    for job in jobs:
        key = there[job.name].group
        label = reference.groups[key].label if key in reference.groups else " ".join(key)
        group = candidate.groups.setdefault(key, compare_sweeps.Group(key, label, [], []))
        record = read_run_json(new_sweep / job.name)
        value = (record.get("final_metrics") or {}).get(reference.metric)
        if isinstance(value, int | float) and math.isfinite(value):
            group.values.append(float(value))
            group.seeds.append(json.dumps(record.get("seeds"), sort_keys=True))
    verdict, lines, comparison = compare_sweeps.compare(reference, candidate, args.margin)
    for line in lines:
        say(line)
    report["statistical"] = comparison
    return compare_sweeps.EXIT[verdict], compare_sweeps.verdict_line(verdict)
