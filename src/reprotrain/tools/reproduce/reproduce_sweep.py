"""``make reproduce`` of a sweep archive: replay every archived run, then one verdict.

The checks are the single-run ones (``tools/reproduce/reproduce.py``), through the same code:
every job's record is read through the run.json schema, the replay plan holds every job (each
leg of its resume history, its environment entries; ``tools/reproduce/replay_plan.py``) and is
trusted or refused as a whole, then the data fingerprints, then each job is re-run leg by leg
from the archived source with its own config and seeds into ``<runs-dir>/<stamp>/<job>`` (its
output in ``logs/job-<i>.log``), a stop signal passed on to it as for one run.

The verdict:

- **bitwise** (``--mode bitwise``, or ``auto`` where the comparability rule promises bits):
  every job's fingerprints and final weights against the archived ones; 0 REPRODUCED, 1
  DIVERGED (with the ``make bisect`` line for the first divergent job);
- **statistical** (``--mode statistical``, or ``auto`` where bits are not promised: another
  device, driver, CPU capability, thread count, a ``fast`` run...): per group, TOST of the
  monitored final metric against the margin (``tools/sweeps/compare_sweeps.py``,
  ``tools/sweeps/equivalence.py``), and the archived conclusions checked: 0 CONSISTENT,
  1 INCONSISTENT, 3 INCONCLUSIVE.

The report is ``reproduction.json`` in the new sweep directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from reprotrain import safetar
from reprotrain.errors import ReproduceRefused
from reprotrain.paths import REPO_ROOT
from reprotrain.repro import requirements_lock, run_schema
from reprotrain.repro.record import RUN_JSON, atomic_write_text, now_iso
from reprotrain.tools.archive import archive_check
from reprotrain.tools.archive.archive_check import CheckedArchive
from reprotrain.tools.archive.sweep_archive import SWEEP
from reprotrain.tools.debugging.bisect import bisect_command
from reprotrain.tools.reproduce import rerun, trust
from reprotrain.tools.reproduce.replay_plan import ReplayPlan
from reprotrain.tools.runs.readers import parse_json_object, parse_record, parse_yaml_config
from reprotrain.tools.runs.run_diff import compare_runs
from reprotrain.tools.shown import say, shown
from reprotrain.tools.sweeps import compare_sweeps
from reprotrain.tools.sweeps.sweep_summary import find_jobs

REPORT = "reproduction.json"
EXIT_CODES = {"REPRODUCED": 0, "DIVERGED": 1, **compare_sweeps.EXIT}


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
    """(the job's folder under sweep/, the archive as if it held only that run), for every
    job archive.json lists, each record read and checked."""
    meta = parse_json_object(checked.text(archive_check.ARCHIVE_JSON), "archive.json")
    jobs = meta.get("jobs")
    if not isinstance(jobs, list) or not jobs:
        raise ReproduceRefused(f"{checked.label('archive.json')}: no list of jobs")
    out = []
    for rel in jobs:
        base = f"{SWEEP}/{rel}"
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
        out.append((str(rel), view))
    return out


def replay(args, archive: Path, plan: ReplayPlan, verdict_trust: trust.Verdict) -> int:
    """Replay a sweep archive's plan (trusted by ``verdict_trust``); the verdict's exit code."""
    say(f"trust    {verdict_trust.line()}")
    # After the trust verdict: fingerprinting the data builds each dataset config (code).
    problems = [rerun.check_archived_data(j.view.config, j.record, args.allow_data_drift)
                for j in plan.jobs]  # fmt: skip
    problems = [p for p in problems if p]
    say(f"sweep    {len(plan.jobs)} archived run(s)")
    if problems:
        say(f"data     DIFFERS: {problems[0]}")
    # From here on a stop signal is passed on to the re-run, and the cleanup still runs.
    rerun.PHASES("re-run")
    with rerun.extraction_dir(args, "reprotrain-reproduce-") as extract, rerun.FORWARD:
        top = archive_check.extract(plan.jobs[0].view, extract.resolve())
        return _rerun(args, archive, top, plan, problems, verdict_trust)


def _rerun(args, archive, top: Path, plan: ReplayPlan, problems, verdict_trust) -> int:
    source = top / "source"
    new_sweep = Path(args.runs_dir) / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{os.getpid()}"
    new_sweep = new_sweep.resolve()
    logs = new_sweep / "logs"
    logs.mkdir(parents=True)
    reasons: list[str] = list(problems)
    for i, job in enumerate(plan.jobs):
        env = rerun.rerun_env(source, job)
        if i == 0:
            where = rerun.imported_from(source, env)
            if not where.is_relative_to(source.resolve()):
                raise ReproduceRefused(f"the re-run would import reprotrain from {where}")
            say(f"re-run   from the archived source ({source}), into {new_sweep}")
        run_dir = new_sweep / job.name
        with open(logs / f"job-{i}.log", "w") as log:
            failed = rerun.run_legs(job, None, top / "rerun-config", run_dir, source, env,
                                 f"job-{i}", log)  # fmt: skip
        if failed is not None:
            return failed
        new_record = json.loads((run_dir / RUN_JSON).read_text())
        current = {**new_record, "lock_sha256": requirements_lock.lock_sha256(REPO_ROOT)}
        blocking, _ = rerun.environment_differences(job.record, current)
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
    verdict += f" [trust {verdict_trust.rule}]"
    report |= {"verdict": verdict, "exit_code": code}
    atomic_write_text(new_sweep / REPORT, json.dumps(report, indent=2, sort_keys=True) + "\n")
    say(f"report   {new_sweep / REPORT}")
    say(verdict)
    return code


def _bitwise(top: Path, new_sweep: Path, jobs, report) -> tuple[int, str]:
    diverged = []
    for job in jobs:
        result = compare_runs(top / SWEEP / job.name, new_sweep / job.name)
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
    archived = {j.run_dir.relative_to(top / SWEEP).as_posix(): j for j in _jobs(top / SWEEP)}
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


def _jobs(sweep_dir: Path):
    return find_jobs(sweep_dir)[0]
