"""``make reproduce`` of a sweep archive: replay every archived run, then one verdict.

One replay plan, trusted or refused as a whole. Exit: 0 REPRODUCED, 1 DIVERGED (bitwise) or
0 CONSISTENT, 1 INCONSISTENT, 3 INCONCLUSIVE (statistical); docs/archive-and-reproduce.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from reprotrain import safetar
from reprotrain.errors import ReproduceRefused, ReprotrainError
from reprotrain.run import schema as run_schema
from reprotrain.run.bounded import load_yaml
from reprotrain.run.readers import parse_json_object, parse_record, parse_yaml_config
from reprotrain.run.record import RUN_JSON, atomic_write_text, now_iso, to_strict_json
from reprotrain.shown import say, shown
from reprotrain.tools.archive import archive_check
from reprotrain.tools.archive.archive_check import CheckedArchive
from reprotrain.tools.archive.sweep_archive import SWEEP
from reprotrain.tools.debugging.bisect import bisect_command
from reprotrain.tools.reproduce import rerun, study_check, trust
from reprotrain.tools.reproduce.replay_plan import ReplayPlan
from reprotrain.tools.runs.run_diff import compare_runs, with_metrics
from reprotrain.tools.sweeps import compare_sweeps
from reprotrain.tools.sweeps.sweep_summary import find_jobs

REPORT = "reproduction.json"


def read_member(checked: archive_check.CheckedArchive, rel: str) -> bytes | None:
    """A member's bytes, checked again against the verified manifest; None if absent."""
    if rel not in checked.manifest:
        return None
    member = checked.members[rel]
    if member.size > archive_check.RECORD_LIMIT_BYTES:
        raise ReproduceRefused(f"{checked.label(rel)}: {member.size} bytes, too large for a record")
    with safetar.open_tar(checked.path, checked.limits) as tar:
        data = tar.extractfile(tar.getmember(member.name)).read()
    if hashlib.sha256(data).hexdigest() != checked.manifest[rel]:
        raise ReproduceRefused(f"manifest check failed: {checked.label(rel)} changed on disk")
    return data


def archived_jobs(checked: archive_check.CheckedArchive) -> list[tuple[str, CheckedArchive]]:
    """(folder under sweep/, the archive as if it held only that run) per job, each checked."""
    meta = parse_json_object(checked.text(archive_check.ARCHIVE_JSON), "archive.json")
    jobs = meta.get("jobs")
    if not isinstance(jobs, list) or not jobs:
        raise ReproduceRefused(f"{checked.label('archive.json')}: no list of jobs")
    out = []
    for rel in jobs:
        if not isinstance(rel, str) or not rel or rel.startswith("/") or ".." in rel.split("/"):
            raise ReproduceRefused(f"{checked.label('archive.json')}: job {shown(rel, 60)} is "
                                   "not a folder under sweep/")  # fmt: skip
        base = f"{SWEEP}/{rel}"
        check_overrides(checked, f"{base}/.hydra/overrides.yaml")
        files = {}
        for name in ("run.json", "config.resolved.yaml", "fingerprints.jsonl", "git.diff"):
            data = read_member(checked, f"{base}/{name}")
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
    data = read_member(checked, rel)
    if data is None:
        return
    try:
        overrides = load_yaml(data.decode("utf-8"), checked.label(rel))  # bounded
    except (UnicodeDecodeError, yaml.YAMLError):
        overrides = None
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ReproduceRefused(f"{checked.label(rel)}: not a YAML list of overrides; the record "
                               "was edited or damaged")  # fmt: skip


def replay(
    args,
    archive: Path,
    plan: ReplayPlan,
    verdict_trust: trust.Verdict,
    study: dict[str, Any] | None = None,
) -> int:
    """Replay a sweep archive's plan (trusted by ``verdict_trust``); the verdict's exit code."""
    say(f"trust    {verdict_trust.line()}")
    # After the trust verdict: fingerprinting the data builds each dataset config (code).
    found = (rerun.check_archived_data(j.view.config.get("dataset"), j.record,
                                       args.allow_data_drift) for j in plan.jobs)  # fmt: skip
    problems = [p for p in found if p]
    say(f"sweep    {len(plan.jobs)} archived run(s)")
    if problems:
        say(f"data     DIFFERS: {problems[0]}")
    # From here on a stop signal is passed on to the re-run, and the cleanup still runs.
    rerun.PHASES("re-run")
    with rerun.extraction_dir(args, "reprotrain-reproduce-") as extract, rerun.FORWARD:
        top = archive_check.extract(plan.jobs[0].view, extract.resolve())
        return _rerun(args, archive, top, plan, problems, verdict_trust, study)


def _rerun(args, archive, top: Path, plan: ReplayPlan, problems, verdict_trust, study) -> int:
    source = top / "source"
    new_sweep = rerun.new_run_dir(args.runs_dir)
    logs = new_sweep / "logs"
    logs.mkdir(parents=True)
    reasons: list[str] = list(problems)
    for i, job in enumerate(plan.jobs):
        env = rerun.rerun_env(source, job)
        if i == 0:
            rerun.imported_from(source, env)
            say(f"re-run   from the archived source ({source}), into {new_sweep}")
        run_dir = new_sweep / job.name
        with open(logs / f"job-{i}.log", "w") as log:
            failed = rerun.run_legs(job, None, top / "rerun-config", run_dir, source, env,
                                 f"job-{i}", log)  # fmt: skip
        if failed is not None:
            return failed
        blocking = rerun.rerun_record(run_dir, job.record)[1]
        reasons += [f"environment differs: {b}" for b in blocking]
        reasons += rerun.not_comparable_reasons(job.record)
        done = f"{i + 1}/{len(plan.jobs)} runs"
        say(
            f"  {shown(job.name)}: seeds base={shown(job.record['seeds']['base'])} -> done ({done})"
        )
    reasons = list(dict.fromkeys(reasons))
    statistical = args.mode == "statistical" or (args.mode == "auto" and bool(reasons))
    for r in reasons:
        say(f"env      {r}")
    report: dict[str, Any] = {
        "created_at": now_iso(),
        "archive": str(archive),
        "trust": {"rule": verdict_trust.rule, "detail": verdict_trust.detail},
        "bits_not_promised": reasons,
        "mode": "statistical" if statistical else "bitwise",
    }
    rerun.PHASES("compare")
    if statistical:
        code, verdict = _statistical(args, top, new_sweep, plan.jobs, report)
    else:
        code, verdict = _bitwise(top, new_sweep, plan.jobs, report)
    if study is not None:
        code, verdict = _study_verdict(study, top, new_sweep, statistical, code, verdict, report)
    code, verdict = _summary_verdict(top / SWEEP, statistical, code, verdict, report)
    verdict += f" [trust {verdict_trust.rule}]"
    report |= {"verdict": verdict, "exit_code": code}
    atomic_write_text(new_sweep / REPORT, json.dumps(report, indent=2, sort_keys=True) + "\n")
    say(f"report   {new_sweep / REPORT}")
    say(verdict)
    return code


def _study_verdict(study, top: Path, new_sweep: Path, statistical: bool, code: int,
                   verdict: str, report: dict) -> tuple[int, str]:  # fmt: skip
    """The verdict, demoted when study.json does not hold for the archived or replayed runs."""
    found = study_check.differences(study, top / SWEEP, new_sweep, values=not statistical)
    report["study_differences"] = found
    if not found:
        best = study.get("best") or {}
        say(f"study    study.json holds: {len(study['trials'])} trial(s), best "
            f"{shown(best.get('job', 'none'), 60)}, recomputed from the runs")  # fmt: skip
        return code, verdict
    for line in found[:10]:
        say(f"study    {line}")
    if len(found) > 10:
        say(f"study    ... and {len(found) - 10} more (reproduction.json)")
    head = compare_sweeps.INCONSISTENT if statistical else "DIVERGED"
    return 1, f"{head}: study.json does not hold ({len(found)} difference(s)): {found[0]}"


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
        out.append(f"summary.json objective {shown(said.get('objective'), 120)}, the archived "
                   f"runs give {shown(here.get('objective'), 120)}")  # fmt: skip
    theirs = {g.get("label"): g for g in said.get("groups") or [] if isinstance(g, dict)}
    ours = {g["label"]: g for g in here["groups"]}
    for label in sorted(set(ours) - set(theirs), key=str):
        out.append(f"group {shown(label, 60)} of the archived runs is not in summary.json")
    for label, group in theirs.items():
        if label not in ours:
            out.append(f"summary.json group {shown(label, 60)} is not in the archived runs")
            continue
        metrics = group.get("metrics") if isinstance(group.get("metrics"), dict) else {}
        for metric, stats in metrics.items():
            if _claims_differ(stats, ours[label]["metrics"].get(metric)):
                out.append(f"summary.json group {shown(label, 60)} {shown(metric)}: not what "
                           "the archived runs give")  # fmt: skip
    return out


def _summary_verdict(sweep: Path, statistical: bool, code: int, verdict: str,
                     report: dict) -> tuple[int, str]:  # fmt: skip
    """The verdict, demoted when summary.json does not hold for the archived runs."""
    found = summary_differences(sweep)
    report["summary_differences"] = found
    for line in found[:10]:
        say(f"summary  {line}")
    if not found or code == 1:
        return code, verdict
    head = compare_sweeps.INCONSISTENT if statistical else "DIVERGED"
    return 1, f"{head}: summary.json does not hold ({len(found)} difference(s)): {found[0]}"


def _bitwise(top: Path, new_sweep: Path, jobs, report) -> tuple[int, str]:
    diverged = []
    for job in jobs:
        archived, replayed = top / SWEEP / job.name, new_sweep / job.name
        result = with_metrics(compare_runs(archived, replayed), archived, replayed)
        if not result.identical:
            diverged.append((job.name, result.verdict()))
    report["diverged"] = [{"job": j, "verdict": v} for j, v in diverged]
    if not diverged:
        return 0, f"REPRODUCED (bitwise): all {len(jobs)} runs match the archived ones"
    rel, verdict = diverged[0]
    say(f"  first divergent op: {bisect_command(top / SWEEP / rel, new_sweep / rel)}")
    return 1, f"DIVERGED: {len(diverged)}/{len(jobs)} run(s); {rel}: {verdict}"


def _statistical(args, top: Path, new_sweep: Path, jobs, report) -> tuple[int, str]:
    reference = compare_sweeps.read_sweep(top / SWEEP, args.metric)
    candidate = compare_sweeps.Sweep(new_sweep, {}, reference.metric, reference.mode)
    jobs_there = find_jobs(top / SWEEP)[0]
    archived = {j.run_dir.relative_to(top / SWEEP).as_posix(): j for j in jobs_there}
    for job in jobs:
        key = archived[job.name].group
        label = reference.groups[key].label if key in reference.groups else " ".join(key)
        group = candidate.groups.setdefault(key, compare_sweeps.Group(key, label, [], []))
        record = json.loads((new_sweep / job.name / RUN_JSON).read_text())
        value = (record.get("final_metrics") or {}).get(reference.metric)
        if isinstance(value, int | float) and math.isfinite(value):
            group.values.append(float(value))
            group.seeds.append(json.dumps(record.get("seeds"), sort_keys=True))
    verdict, lines, comparison = compare_sweeps.compare(reference, candidate, args.margin)
    for line in lines:
        say(line)
    report["statistical"] = comparison
    return compare_sweeps.EXIT[verdict], compare_sweeps.verdict_line(verdict)
