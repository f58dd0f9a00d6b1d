"""``make update-template [TEMPLATE=path-or-url]``: bring the template's framework fixes over.

Applies ``git diff <recorded>..<newest>`` of the framework paths with ``git apply --3way``; all
or nothing, the user's files never touched. Needs only python3 and git. docs/new-project.md.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

if not __package__:  # run as a script by make, before any venv: put src/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from reprotrain.repro.gitinfo import run_git
from reprotrain.tools.template import template_files as tf


class UpdateError(Exception):
    """One line for the user; ``code`` is the exit status (2: fix the input, 1: conflict)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _ok(repo: Path, *args: str) -> str:
    proc = run_git(repo, *args)
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        raise UpdateError(f"git {' '.join(args[:2])}: {first[:200]}")
    return proc.stdout


def conflicted_files(output: str) -> list[str]:
    """The paths git apply --3way could not merge, from its messages."""
    found = re.findall(r"^U (.+)$", output, re.MULTILINE)
    found += re.findall(r"Applied patch to '(.+)' with conflicts", output)
    found += re.findall(r"^error: (?:patch failed: )?([^:\s]+)(?::\d+)?: ", output, re.MULTILINE)
    return sorted(set(found))


def update(project: Path, template: str | None = None, ref: str = "HEAD") -> str:
    """Apply the template's framework changes since the recorded commit; return a summary."""
    if run_git(project, "rev-parse", "--is-inside-work-tree").returncode != 0:
        raise UpdateError(f"{project} is not a git repository; run make update-template in it")
    project = Path(_ok(project, "rev-parse", "--show-toplevel").strip())
    record = tf.read_record(project)
    if record is None:
        raise UpdateError(
            f"no {tf.RECORD} in {project}: make update-template runs in a project made by "
            "make new-project"
        )
    if _ok(project, "status", "--porcelain", "--untracked-files=no").strip():
        raise UpdateError(
            "the work tree has uncommitted changes; commit or stash them, then run "
            "make update-template again"
        )
    location = template or record["template"]
    fetched = run_git(project, "fetch", "--quiet", "--no-tags", location, ref)
    if fetched.returncode != 0:
        why = (fetched.stderr.strip().splitlines() or ["failed"])[-1]
        raise UpdateError(f"cannot fetch {ref} of the template at {location} ({why[:160]})")
    new = _ok(project, "rev-parse", "FETCH_HEAD^{commit}").strip()
    old = record["commit"]
    if run_git(project, "merge-base", "--is-ancestor", old, new).returncode != 0:
        raise UpdateError(
            f"the recorded template commit {old[:12]} is not in the history of {location} "
            f"{ref}; pass TEMPLATE=<the template this project came from>"
        )
    if old == new:
        return f"already up to date with {location} at {new[:12]}"
    pathspecs = tf.framework_pathspecs()
    patch = _ok(project, "diff", "--binary", "--full-index", "--no-renames", old, new, *pathspecs)
    changed = _ok(project, "diff", "--name-only", "--no-renames", old, new, *pathspecs).split()
    if patch:
        applied = run_git(project, "apply", "--3way", "--index", "--whitespace=nowarn", input=patch)
        if applied.returncode != 0:
            # All or nothing: the tree was clean, so HEAD is exactly what the user had.
            _ok(project, "reset", "--quiet", "--hard", "HEAD")
            files = conflicted_files(applied.stderr + applied.stdout) or changed
            raise UpdateError(
                f"the template's changes {old[:12]}..{new[:12]} conflict with your edits in "
                f"{', '.join(files)}; nothing was changed. Move your change into "
                f"src/{record['package']} or conf/, or merge by hand: git diff {old[:12]} "
                f"{new[:12]} -- <file> | git apply --3way",
                code=1,
            )
    tf.write_record(project, {**record, "template": location, "commit": new})
    _ok(project, "add", tf.RECORD)
    return (
        f"updated {len(changed)} framework file(s) from {location} {old[:12]}..{new[:12]} "
        "(staged: review with git diff --cached, then git commit)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make update-template", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--template", help="path or URL of the template (default: recorded)")
    parser.add_argument("--ref", default="HEAD", help="branch or tag of the template")
    parser.add_argument("--project", type=Path, default=Path.cwd(), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        print(update(args.project, args.template, args.ref))
    except UpdateError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
