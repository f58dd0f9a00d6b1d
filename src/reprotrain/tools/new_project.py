"""``make new-project NAME=mylab DEST=../mylab``: a fresh repository from this template.

Needs only python3 and git (standard library only, no venv). It copies the *tracked* files
of this checkout (so no outputs, data, venv or untracked notes travel), renames the package
everywhere (``src/<name>``, imports, pyproject, Makefile, Dockerfile, workflows, tests and
the ``REPROTRAIN_`` variables), writes a README and LICENSE that credit the template, and
makes one commit in a new git history. The template commit it started from is named in the
README and the commit message, so later template fixes can be carried over (see the README).
"""

from __future__ import annotations

import argparse
import keyword
import re
import shutil
import subprocess
import sys
from pathlib import Path

TEMPLATE = "reprotrain"
ROOT = Path(__file__).resolve().parents[3]
CREDITED = ("README.md", "LICENSE")


class NewProjectError(Exception):
    """A user error: one line, exit 2."""


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise NewProjectError(f"git {' '.join(args)} failed: {proc.stderr.strip()[:200]}")
    return proc.stdout


def rename_text(text: str, name: str) -> str:
    """Every spelling of the template's name, in code, config and prose."""
    for old, new in (
        (TEMPLATE.upper(), name.upper()),
        (TEMPLATE.capitalize(), name.capitalize()),
        (TEMPLATE, name),
    ):
        text = text.replace(old, new)
    return text


def check_name(name: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise NewProjectError(
            f"NAME={name!r} must be a lowercase python identifier (letters, digits, _)"
        )
    if name == TEMPLATE:
        raise NewProjectError(f"NAME={name} is the template's own name; choose another")


def readme(name: str, commit: str, template_readme: str) -> str:
    body = rename_text(template_readme, name)
    body = body.split("\n", 1)[1] if body.startswith("# ") else body
    return (
        f"# {name}\n\n"
        f"> Started from the [{TEMPLATE}]({TEMPLATE}) training template at commit "
        f"`{commit}`. Its README follows, renamed.\n" + body
    )


def license_text(name: str, template_license: str | None) -> str:
    credit = (
        f"\n---\n{name} was created from the {TEMPLATE} template; the template's code is "
        f"used under the MIT license above.\n"
    )
    return (template_license or "MIT License\n") + credit


def create(name: str, dest: Path, src: Path = ROOT) -> Path:
    check_name(name)
    dest = dest.expanduser().resolve()
    if dest.exists():
        raise NewProjectError(f"DEST={dest} already exists; choose a new directory")
    if shutil.which("git") is None:
        raise NewProjectError("git is not on PATH; install git first")
    commit = _git(src, "rev-parse", "HEAD").strip()
    files = [f for f in _git(src, "ls-files", "-z").split("\0") if f]
    dest.mkdir(parents=True)
    try:
        for rel in files:
            source = src / rel
            if not source.is_file() or rel.startswith("docs/notes/"):
                continue  # deleted in the work tree, or the template's own working notes
            target = dest / rename_text(rel, name)
            target.parent.mkdir(parents=True, exist_ok=True)
            data = source.read_bytes()
            if rel in CREDITED:
                continue
            try:
                target.write_text(rename_text(data.decode("utf-8"), name), encoding="utf-8")
            except UnicodeDecodeError:
                target.write_bytes(data)  # binary (a committed PNG): copied as is
            shutil.copymode(source, target)
        template_readme = (src / "README.md").read_text(encoding="utf-8")
        (dest / "README.md").write_text(readme(name, commit, template_readme), encoding="utf-8")
        lic = src / "LICENSE"
        old_license = lic.read_text(encoding="utf-8") if lic.is_file() else None
        (dest / "LICENSE").write_text(license_text(name, old_license), encoding="utf-8")
        _git(dest, "init", "-q")
        _git(dest, "add", "-A")
        who = [] if _git_identity(dest) else ["-c", "user.name=new-project", "-c",
                                               "user.email=new-project@localhost"]  # fmt: skip
        _git(dest, *who, "commit", "-q", "-m", f"Start {name} from the {TEMPLATE} template "
             f"at {commit[:12]}")  # fmt: skip
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)  # nothing half-made that looks complete
        raise
    return dest


def _git_identity(repo: Path) -> bool:
    proc = subprocess.run(["git", "-C", str(repo), "config", "user.email"], capture_output=True)
    return proc.returncode == 0 and bool(proc.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make new-project", description=__doc__.split("\n\n")[0].strip("`")
    )
    parser.add_argument("name", help="package name of the new project (python identifier)")
    parser.add_argument("dest", type=Path, help="directory to create (must not exist)")
    args = parser.parse_args(argv)
    try:
        dest = create(args.name, args.dest)
    except NewProjectError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"created {dest} (package src/{args.name}); next: cd {dest} && make test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
