"""The replay plan: everything ``make reproduce`` will run, as data, trust-checked as one object.

Closes: a part of the replay the trust check never saw. Per job: every leg's config, the
re-run's environment (``replay_env.py``) and the overrides the record decides; the rest of the
command line and the paths are this user's. docs/guarantees.md.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from reprotrain import REPO_ROOT
from reprotrain.quoting import hydra_override
from reprotrain.repro import device as devices
from reprotrain.run.schema import lookup
from reprotrain.tools.archive.archive_check import CheckedArchive
from reprotrain.tools.reproduce import replay_env


class NotReplayable(Exception):
    """The archived history cannot be replayed: a NOT COMPARABLE reason, never DIVERGED."""


@dataclass
class Leg:
    """One trainer process of a replay: fresh (the first) or resumed (``resume=auto``)."""

    config: dict  # unresolved container this leg runs under
    resume: bool
    stop_at_global_step: int | None  # None: to the end (or --epochs)
    changes: dict[str, Any] = field(default_factory=dict)  # vs the previous leg


_ABSENT = object()  # a key the config lacks (None is a value it may hold)


def _set(node: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def plan_replay(
    final_config: dict, resumes: list[dict], until_global_step: int | None = None
) -> list[Leg]:
    """The legs replaying a run's resume history: see docs/archive-and-reproduce.md."""
    changing = []
    last_step = -1
    for entry in resumes or []:
        if not isinstance(entry, dict) or not entry.get("overrides"):
            continue
        step, overrides = entry.get("global_step"), entry["overrides"]
        if not isinstance(step, int) or isinstance(step, bool) or step < last_step:
            raise NotReplayable(f"resume entry with global_step {step!r} is out of order")
        if not isinstance(overrides, dict) or not all(
            isinstance(v, dict) and {"from", "to"} <= set(v) for v in overrides.values()
        ):
            raise NotReplayable(
                f"the resume at global step {step} recorded overrides without their previous "
                "values ({key: {from, to}})"
            )
        changing.append((step, overrides))
        last_step = step
    current = copy.deepcopy(final_config)
    for step, overrides in reversed(changing):
        for key, change in overrides.items():
            if (now := lookup(current, key.split("."), _ABSENT)) is _ABSENT:
                raise NotReplayable(f"resume override {key} is not in the config")
            if now != change["to"]:
                raise NotReplayable(
                    f"resume at global step {step} set {key}={change['to']!r}, but the config "
                    f"has {now!r} there"
                )
            _set(current, key, change["from"])
    legs = [Leg(config=copy.deepcopy(current), resume=False, stop_at_global_step=None)]
    for step, overrides in changing:
        if until_global_step is not None and step >= until_global_step:
            break
        legs[-1].stop_at_global_step = step
        changes = {key: change["to"] for key, change in overrides.items()}
        for key, value in changes.items():
            _set(current, key, value)
        legs.append(Leg(copy.deepcopy(current), True, None, changes))
    return legs


def current_data_dir(recorded_root: str) -> Path:
    """A recorded dataset root, here: relative roots are relative to this checkout."""
    root = Path(recorded_root)
    return root if root.is_absolute() else REPO_ROOT / root


def record_overrides(record: dict, raw_config: dict) -> list[str]:
    """The overrides the record decides: entropy seed, dataset root here, device type."""
    out = []
    seeds = record.get("seeds") or {}
    if seeds.get("source") == "entropy":
        out.append(f"seed.base={int(seeds['base'])}")
    dataset = raw_config.get("dataset")
    root = dataset.get("root") if isinstance(dataset, dict) else None
    if root is not None and not (isinstance(root, str) and "${" in root):
        out.append(hydra_override("dataset.root", current_data_dir(str(root))))
    out.append(f"trainer.device={devices.replay_spec(devices.recorded_device(record))[0]}")
    return out


@dataclass
class JobPlan:
    """One archived run's part of the replay."""

    name: str  # "" for a run archive; the job's folder under sweep/ in a sweep archive
    view: CheckedArchive  # its verified record and config
    config: dict  # the recorded config, unresolved
    legs: list[Leg]
    env: dict[str, str | None]  # what the archive sets in the re-run's environment
    overrides: list[str]  # trainer overrides the record decides

    @property
    def record(self) -> dict:
        return self.view.record

    def labels(self) -> tuple[str, str]:
        """How a problem in (its recorded config, a leg of its resume history) is named."""
        if not self.name:
            return "the archived config", "the archived resume history"
        return f"job {self.name}'s config", f"job {self.name}'s resume history"


@dataclass
class ReplayPlan:
    jobs: list[JobPlan] = field(default_factory=list)

    def configs(self) -> Iterator[tuple[str, dict]]:
        """(label, unresolved config) of the recorded config and every leg that differs from it."""
        for job in self.jobs:
            final, history = job.labels()
            yield final, job.config
            for i, leg in enumerate(job.legs):
                if leg.config != job.config:
                    yield f"{history} (leg {i})", leg.config


def plan_job(name: str, view: CheckedArchive, until_global_step: int | None) -> JobPlan:
    """The job's plan; a refusal for an environment entry, NotReplayable for its history."""
    where = view.label("run/run.json") if not name else view.label(f"sweep/{name}/run.json")
    env = replay_env.archive_env(view.record, where)
    raw = OmegaConf.to_container(view.config, resolve=False)
    legs = plan_replay(raw, view.record.get("resumes") or [], until_global_step)
    if len(legs) > 1 and "stop_at_global_step" not in (raw.get("trainer") or {}):
        raise NotReplayable(
            f"the run was resumed with changed overrides at global step(s) "
            f"{', '.join(str(leg.stop_at_global_step) for leg in legs[:-1])}, and the "
            "archived trainer has no trainer.stop_at_global_step to replay that history"
        )
    return JobPlan(name, view, raw, legs, env, record_overrides(view.record, raw))


def build(jobs: list[tuple[str, CheckedArchive]], until_global_step: int | None) -> ReplayPlan:
    """The plan for ``jobs`` (``[("", checked)]`` for a run archive)."""
    return ReplayPlan([plan_job(name, view, until_global_step) for name, view in jobs])
