"""The evidence for rule (a) of ``make reproduce``, gathered before anything is extracted.

Closes: edited ``source/`` with a regenerated manifest running arbitrary code: rule (a) holds
only when ``source/`` is a commit of this repository, byte for byte, and every config of the
plan is one its ``conf/`` composes. The decision itself is the gate's
(``run_trust.admit_plan``). docs/guarantees.md.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from reprotrain.errors import SnapshotError
from reprotrain.repro import gitinfo
from reprotrain.tools.archive import archive_check, snapshot
from reprotrain.tools.reproduce import config_trust
from reprotrain.tools.reproduce.replay_plan import ReplayPlan


def diff_paths(diff: str) -> list[str]:
    """Paths a git diff touches (both sides of a rename), from its ``diff --git`` headers."""
    out = []
    for line in diff.splitlines():
        m = re.match(r"^diff --git a/(.+?) b/(.+)$", line)
        if m:
            out += [m.group(1)] if m.group(1) == m.group(2) else [m.group(1), m.group(2)]
    return sorted(set(out))


def config_problems(plan: ReplayPlan, source: Path, commit: str) -> list[str]:
    """What in any config of the plan the trusted commit's configs would not compose."""
    rule = config_trust.Rule.of(source)
    found = []
    for label, raw in plan.configs():
        found += [f"{label} {p}" for p in rule.problems(raw, commit)]
    return found


def same_code_here(plan: ReplayPlan, repo: Path) -> tuple[bool, str]:
    """Rule (a): (holds, why or why not)."""
    checked = plan.jobs[0].view
    commit = (checked.record.get("git") or {}).get("commit")
    if not gitinfo.is_commit_id(commit):
        return False, "(a) no: the run recorded no git commit"
    if not snapshot.is_git_repo(repo):
        return False, f"(a) no: {repo} is not a git checkout"
    patched = [p for p in diff_paths(checked.diff) if gitinfo.in_snapshot(p)]
    if patched:
        shown = ", ".join(patched[:3]) + (" ..." if len(patched) > 3 else "")
        return False, (
            f"(a) no: source/ is commit {commit[:12]} plus an uncommitted patch carried by the "
            f"archive ({shown}; see run/git.diff)"
        )
    with tempfile.TemporaryDirectory(prefix="reprotrain-trust-") as tmp:
        try:
            snapshot.from_git(repo, commit, "", Path(tmp) / "source")
        except SnapshotError as e:
            return False, f"(a) no: {e}"
        here = archive_check.file_digests(Path(tmp) / "source")
        problems = config_problems(plan, Path(tmp) / "source", commit)
    there = checked.source_files
    if here != there:
        changed = sorted(k for k in set(here) | set(there) if here.get(k) != there.get(k))
        shown = ", ".join(changed[:3]) + (" ..." if len(changed) > 3 else "")
        return False, (
            f"(a) no: source/ differs from commit {commit[:12]} of this repository in "
            f"{len(changed)} file(s) ({shown})"
        )
    if problems:
        return False, "(a) no: " + "; ".join(problems[:3])
    return True, (
        f"(a) source/ is commit {commit[:12]} of this repository, rebuilt here: "
        f"{len(here)} files identical"
    )
