"""The re-run of an archived job and the checks around it, shared by one run and a sweep."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from reprotrain import REPO_ROOT
from reprotrain.errors import ReproduceRefused, one_line
from reprotrain.progress import Phases, say
from reprotrain.quoting import hydra_override
from reprotrain.repro import comparability, levels, requirements_lock
from reprotrain.resume.guard import imported_differences
from reprotrain.run.readers import read_run_json
from reprotrain.run.record import RUN_JSON, atomic_write_text, now_iso
from reprotrain.tools import cli
from reprotrain.tools.archive import archive_check
from reprotrain.tools.reproduce import replay_env
from reprotrain.tools.reproduce.replay_plan import JobPlan, Leg, ReplayPlan, current_data_dir
from reprotrain.tools.reproduce.run_trust import Permit, permitted
from reprotrain.tools.runs.resume import wired

EXIT_REPRODUCED, EXIT_DIVERGED, EXIT_REFUSED, EXIT_NOT_COMPARABLE, EXIT_RERUN_FAILED = range(5)
EXIT_STOPPED = 75  # the trainer's "interrupted, resume me" code
PRIMARY = "reproduce"
REPORT = "reproduction.json"
#: A replay, in order (progress lines on stdout: ``reproduce [2/5] build the replay plan``).
PHASES = Phases(
    "reproduce",
    ("verify the archive", "build the replay plan", "decide trust", "re-run", "compare"),
    emit=say,
)


def check_data(dataset_cfg, recorded: dict | None, allow_drift: bool) -> str | None:
    """None if the data here is what the run saw; else a NOT COMPARABLE reason, or refused."""
    from reprotrain.components import data_fingerprint  # no engine: the working tree may not import

    try:
        here = data_fingerprint(dataset_cfg)
    except Exception as e:  # the archived config is data from elsewhere: say what failed
        raise ReproduceRefused(
            f"cannot fingerprint the archived dataset config here ({type(e).__name__}: "
            f"{one_line(str(e))[:200]})"
        ) from None
    want = (recorded or {}).get("sha256")
    if want is not None and here.get("sha256") == want:
        return None
    got = here.get("sha256") or f"none (missing: {', '.join(here.get('missing', [])) or '?'})"
    msg = f"data differs from the archived run: recorded sha256 {want}, here {got}"
    if not allow_drift:
        raise ReproduceRefused(msg + " (pass --allow-data-drift to re-run anyway)")
    return msg


def check_archived_data(dataset_cfg, record: dict, allow_drift: bool) -> str | None:
    """:func:`check_data` on the archived ``dataset``; builds its ``_target_``: after trust only."""
    data_cfg = OmegaConf.merge(dataset_cfg, {}) if dataset_cfg is not None else OmegaConf.create({})
    if data_cfg.get("root") is not None:
        data_cfg.root = str(current_data_dir(str(data_cfg.root)))
    return check_data(data_cfg, record.get("data_fingerprint"), allow_drift)


def environment_differences(recorded: dict, current: dict) -> tuple[list[str], list[str]]:
    """(differences that rule out identical bits, informational ones), both as text."""
    renv, cenv = recorded.get("environment") or {}, current.get("environment") or {}
    invariant = recorded.get("world_size_invariant") is True  # bits on any world size
    blocking = comparability.differences(renv, cenv, invariant)  # the one rule resume uses
    if "repro" in current:  # the re-run's own record (a preview has applied no precision)
        changed = comparability.precision_difference(recorded.get("repro"), current["repro"])
        blocking += [changed] if changed else []
    if recorded.get("lock_sha256") != current.get("lock_sha256"):
        blocking.append(
            f"lock_sha256: recorded {str(recorded.get('lock_sha256'))[:12]}, this checkout's "
            f"requirements.lock {str(current.get('lock_sha256'))[:12]}"
        )
    drift = current.get("env_drift") or {}
    if drift.get("status") == "drift":
        names = drift.get("missing", []) + drift.get("extra", [])
        names += [d["name"] for d in drift.get("different", [])]
        blocking.append(f"installed packages differ from the archived lock: {', '.join(names)}")
    return blocking, comparability.notes(renv, cenv)


def not_comparable_reasons(record: dict) -> list[str]:
    reasons = []
    name = (record.get("repro") or {}).get("level")
    if name not in levels.LEVELS:  # a record this version cannot read the promise of
        reasons.append(f"repro level {name!r} is unknown here: identical bits are not promised")
    elif not levels.LEVELS[name].deterministic:
        reasons.append(f"repro level {name!r}: seeds only, identical bits are not promised")
    if record.get("nondeterministic_ops"):
        ops = ", ".join(record["nondeterministic_ops"][:3])
        reasons.append(f"the run recorded nondeterministic ops ({ops})")
    for entry in record.get("resumes") or []:
        if isinstance(entry, dict) and entry.get("bitwise_guarantee") is False:
            why = "; ".join(entry.get("mismatch") or entry.get("unrestored") or [])
            why = why or "environment changed"
            reasons.append(f"resumed at global step {entry.get('global_step')} with {why}")
    return reasons


def rerun_command(
    config_dir: Path,
    run_dir: Path,
    job: JobPlan,
    stop_after_epoch: int | None,
    config_name: str = PRIMARY,
    leg: Leg | None = None,
) -> list[str]:
    """The trainer command for one leg; ``resume=null`` on a fresh leg, never the archive's."""
    overrides = [hydra_override("hydra.run.dir", run_dir)]
    overrides.append("resume=auto" if leg is not None and leg.resume else "resume=null")
    overrides += job.overrides
    if leg is not None and leg.stop_at_global_step is not None:
        overrides.append(f"trainer.stop_at_global_step={int(leg.stop_at_global_step)}")
    elif stop_after_epoch is not None:
        overrides.append(f"trainer.stop_after_epoch={int(stop_after_epoch)}")
    trainer = [sys.executable, "-m", "reprotrain.train", f"--config-path={config_dir}"]
    return [*trainer, f"--config-name={config_name}", *overrides]


def rerun_env(source: Path, job: JobPlan) -> dict[str, str]:
    """This user's environment, the archive's checked entries, then the replay's own, last."""
    env = replay_env.apply(dict(os.environ), job.env)
    env["PYTHONPATH"] = str(source / "src")  # replaces, never extends: no other reprotrain
    # The snapshot is not a checkout: keep git from finding an enclosing repo's HEAD.
    env["GIT_CEILING_DIRECTORIES"] = str(source.resolve().parent)
    return env


def imported_from(source: Path, env: dict[str, str]) -> Path:
    """Where the re-run imports reprotrain from (archive code: after trust); refused outside."""
    cmd = [sys.executable, "-c", "import reprotrain; print(reprotrain.__file__)"]
    out = subprocess.run(cmd, cwd=source, env=env, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        first = one_line(out.stderr)[-200:]
        raise ReproduceRefused(f"the archived source does not import: {first}")
    where = Path(out.stdout.strip()).resolve()
    if not where.is_relative_to(source.resolve()):
        raise ReproduceRefused(f"the re-run would import reprotrain from {where}, not the archive")
    return where


@contextlib.contextmanager
def extraction_dir(args, prefix: str) -> Iterator[Path]:
    """``--extract-dir``, or a temp dir removed however the block ends."""
    if args.extract_dir is not None:
        yield Path(args.extract_dir)
        return
    with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as tmp:
        yield Path(tmp)


class SignalForwarder:
    """Stop signals sent to ``make reproduce`` passed to the re-run (in its own session)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.received: str | None = None

    @contextlib.contextmanager
    def forwarding(self) -> Iterator[None]:
        """Inside: each stop signal is noted and passed on (``cli.stopping``'s handlers)."""
        self.received = None
        with cli.stopping(self._handle):
            yield

    def _handle(self, signum: int, frame: object) -> None:
        self.received = self.received or signal.Signals(signum).name
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def call(self, cmd: list[str], cwd: Path, env: dict[str, str], log=None) -> int:
        """Run ``cmd`` to its end (its output to ``log``, else the terminal)."""
        out = {} if log is None else {"stdout": log, "stderr": subprocess.STDOUT}
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, start_new_session=True, preexec_fn=_term_with_parent, **out
        )
        try:
            return self.proc.wait()
        finally:
            self.proc = None


def _term_with_parent() -> None:
    """In the re-run, before exec: SIGTERM when the parent dies (Linux; else nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


FORWARD = SignalForwarder()


def write_report(run_dir: Path, report: dict) -> Path:
    """``reproduction.json`` in ``run_dir``: what was compared and the verdict."""
    text = json.dumps({"created_at": now_iso(), **report}, indent=2, sort_keys=True)
    atomic_write_text(run_dir / REPORT, text + "\n")
    return run_dir / REPORT


def _interrupted(new_run: Path, record: dict, leg: int, rc: int | None) -> int:
    """The reproduction stopped by a signal: say so in reproduction.json and the verdict."""
    ran = "before the re-run started" if rc is None else f"re-run leg {leg} exited {rc}"
    verdict = f"INTERRUPTED by {FORWARD.received}: {ran}; nothing was compared"
    if (new_run / RUN_JSON).is_file():
        archived = {"archived_experiment_id": record.get("experiment_id"), "verdict": verdict}
        stopped = {"status": "interrupted", "interrupted_by": FORWARD.received}
        write_report(new_run, {**archived, **stopped, "exit_code": EXIT_STOPPED})
        verdict += f" (the re-run's checkpoint is in {new_run})"
    print(verdict, flush=True)
    return EXIT_STOPPED


@dataclass
class Reproduction:
    """One ``make reproduce``: its command line, the archive, the plan and its trust verdict."""

    args: argparse.Namespace
    archive: Path
    plan: ReplayPlan
    trust: Permit  # the gate's decision on the whole plan: nothing re-runs without it

    def data_problems(self) -> list[str]:
        """Every job's data check; it builds the dataset config: after the trust verdict only."""
        allow, jobs = self.args.allow_data_drift, self.plan.jobs
        found = [check_archived_data(j.view.config.get("dataset"), j.record, allow) for j in jobs]
        return [p for p in found if p]

    @contextlib.contextmanager
    def extracted(self) -> Iterator[Path]:
        """The archive's top folder, extracted (removed after); stop signals reach the re-run."""
        PHASES("re-run")
        with extraction_dir(self.args, "reprotrain-reproduce-") as extract, FORWARD.forwarding():
            yield archive_check.extract(self.plan.jobs[0].view, extract.resolve())

    def finish(self, run_dir: Path, report: dict, code: int, verdict: str, *lines: str) -> int:
        """reproduction.json written, ``lines`` and the verdict (with its trust rule) said."""
        verdict += f" [trust {self.trust.rule}]"
        trusted = {"archive": str(self.archive), "trust": dataclasses.asdict(self.trust)}
        write_report(run_dir, {**report, **trusted, "verdict": verdict, "exit_code": code})
        for line in lines:
            say(line)
        say(verdict)
        return code


@dataclass
class Rerun:
    """What a job's re-run recorded against the archived run: why bits are not promised."""

    blocking: list[str]  # environment differences that rule out identical bits
    notes: list[str]
    reasons: list[str]


def rerun_job(
    permit: Permit,
    job: JobPlan,
    top: Path,
    into: Path,
    epochs: int | None = None,
    log=None,
    prefix: str = PRIMARY,
) -> Rerun | int:
    """Run each leg of ``job`` from ``top``'s source, under the gate's ``permit`` for the plan;
    an exit code when one fails or a stop came."""
    permitted(permit)
    source, config_dir, out = top / "source", top / "rerun-config", log or sys.stdout
    env = rerun_env(source, job)
    imported_from(source, env)
    for i, leg in enumerate(job.legs):
        if FORWARD.received:
            return _interrupted(into, job.record, i, None)
        one = len(job.legs) == 1
        name = prefix if one else f"{prefix}-leg{i}"
        text = job.view.text("run/config.resolved.yaml") if one else OmegaConf.to_yaml(leg.config)
        atomic_write_text(config_dir / f"{name}.yaml", wired(text, "make reproduce"))
        last = i == len(job.legs) - 1
        cmd = rerun_command(config_dir, into, job, epochs if last else None, name, leg)
        if leg.changes:
            changes = ", ".join(f"{k}={v!r}" for k, v in leg.changes.items())
            print(f"leg {i}    resume with {changes}", file=out)
        print(f"$ {' '.join(cmd[1:])}", file=out, flush=True)
        rc = FORWARD.call(cmd, source, env, log)
        if FORWARD.received:
            return _interrupted(into, job.record, i, rc)
        if rc == 2:
            # The archived trainer refused the config and said why on stderr, in one line.
            print("re-run   refused by the archived trainer (exit 2); see the line above")
            return EXIT_REFUSED
        # A leg that stops at a global step may report itself interrupted (75) or done (0).
        ok = (0,) if last else (0, EXIT_STOPPED)
        if rc not in ok or not (into / RUN_JSON).is_file():
            where = getattr(log, "name", None) or f"{into}/train.log"
            print(f"error: the re-run failed (exit {rc}); see {where}", file=sys.stderr)
            return EXIT_RERUN_FAILED
    return _rerun_record(into, job.record)


def _rerun_record(run_dir: Path, record: dict) -> Rerun:
    """The re-run's own run.json against the archived ``record``, with this checkout's lock."""
    new_record = read_run_json(run_dir)
    current = {**new_record, "lock_sha256": requirements_lock.lock_sha256(REPO_ROOT)}
    blocking, notes = environment_differences(record, current)
    reasons = [f"environment differs: {b}" for b in blocking] + not_comparable_reasons(record)
    if record.get("imported_code") is not None:  # outside src/: no archive holds them
        now = new_record.get("imported_code") or {}
        reasons += imported_differences(record["imported_code"], now, "from the archived run's")
    return Rerun(blocking, notes, reasons)
