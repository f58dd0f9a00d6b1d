"""``make new-project NAME=mylab DEST=../mylab``: a fresh repository from this template.

Copies the framework byte for byte and the user's room renamed, records ``.template.json``,
one commit, new history. Needs only python3 and git. docs/new-project.md.
"""

from __future__ import annotations

import argparse
import keyword
import re
import shutil
import sys
from pathlib import Path

if not __package__:  # run as a script by make, before any venv: put src/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from reprotrain.repro.gitinfo import run_git
from reprotrain.tools.template import template_files as tf

ROOT = Path(__file__).resolve().parents[4]
PROJECT_FILES = Path(__file__).resolve().parent / "project"  # what the project gets written
# Names a project package must not take: they would shadow what the framework imports.
TAKEN = {tf.FRAMEWORK_PACKAGE, "torch", "torchvision", "hydra", "omegaconf", "numpy"}
TAKEN |= {"tests", "conf", "scripts", "src"}


class NewProjectError(Exception):
    """A user error: one line, exit 2."""


def _git(repo: Path, *args: str) -> str:
    proc = run_git(repo, *args)
    if proc.returncode != 0:
        raise NewProjectError(f"git {' '.join(args)} failed: {proc.stderr.strip()[:200]}")
    return proc.stdout


def rename_package(text: str, old: str, new: str) -> str:
    """The user's package name as a word (imports, ``_target_``s, paths in prose)."""
    return re.sub(rf"\b{re.escape(old)}\b", new, text)


def target_path(rel: str, old: str, new: str) -> str:
    for top in ("src", "tests"):
        if rel.startswith(f"{top}/{old}/"):
            return f"{top}/{new}/" + rel[len(top) + len(old) + 2 :]
    return rel


def check_name(name: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise NewProjectError(
            f"NAME={name!r} must be a lowercase python identifier (letters, digits, _)"
        )
    if name in TAKEN or name in sys.stdlib_module_names:
        raise NewProjectError(
            f"NAME={name} would shadow the {name!r} module the framework uses; choose another"
        )


def readme(name: str, commit: str, location: str) -> str:
    """The project's own README (its file): its name, the two commands, its room, the manual."""
    where = f"[{location}]({location})" if re.match(r"https?://", location) else f"`{location}`"
    text = (PROJECT_FILES / "README.md").read_text(encoding="utf-8")
    return text.format(
        name=name, framework=tf.FRAMEWORK_PACKAGE, template=where, commit=commit[:12]
    )


def copy_file(source: Path, target: Path, rel: str, old: str, name: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    data = source.read_bytes()
    if tf.is_framework(rel, old):
        target.write_bytes(data)  # byte for byte: update-template merges against these
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            target.write_bytes(data)  # binary (a committed PNG): copied as is
        else:
            text = rename_package(text, old, name)
            if rel == "pyproject.toml":
                text = text.replace(f'name = "{tf.FRAMEWORK_PACKAGE}"', f'name = "{name}"', 1)
            target.write_text(text, encoding="utf-8")
    shutil.copymode(source, target)


def create(name: str, dest: Path, src: Path = ROOT) -> Path:
    check_name(name)
    dest = dest.expanduser().resolve()
    if dest.exists():
        raise NewProjectError(f"DEST={dest} already exists; choose a new directory")
    if shutil.which("git") is None:
        raise NewProjectError("git is not on PATH; install git first")
    record = tf.read_record(src)
    old = record["package"] if record else tf.TEMPLATE_PACKAGE
    if not (src / "src" / old).is_dir():
        raise NewProjectError(f"no src/{old} in {src}: run make new-project in the template")
    commit = _git(src, "rev-parse", "HEAD").strip()
    location = str(src)  # where update-template fetches from (a URL works too)
    files = [f for f in _git(src, "ls-files", "-z").split("\0") if f]
    dest.mkdir(parents=True)
    try:
        for rel in files:
            source = src / rel
            if not source.is_file() or not tf.ships(rel, old) or rel == tf.RECORD:
                continue  # deleted in the work tree, template-only, the template's record
            copy_file(source, dest / target_path(rel, old, name), rel, old, name)
        tests = (PROJECT_FILES / "test_room.py.in").read_text(encoding="utf-8")
        lic = src / "LICENSE"
        credit = (
            f"\n---\n{name} was created from the {tf.FRAMEWORK_PACKAGE} template; the "
            "template's code is used under the MIT license above.\n"
        )
        old_license = lic.read_text(encoding="utf-8") if lic.is_file() else "MIT License\n"
        written = {  # the README, the room's small tests/ (package renamed), the credited LICENSE
            "README.md": readme(name, commit, location),
            "tests/conftest.py": (PROJECT_FILES / "conftest.py.in").read_text(encoding="utf-8"),
            f"tests/test_{name}.py": rename_package(tests, tf.TEMPLATE_PACKAGE, name),
            "LICENSE": old_license + credit,
        }
        for rel, text in written.items():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_text(text, encoding="utf-8")
        tf.write_record(
            dest, {"template": location, "commit": commit, "package": name, "template_package": old}
        )
        _git(dest, "init", "-q")
        _git(dest, "add", "-A")
        ident = run_git(dest, "config", "user.email")
        who = ["-c", "user.name=new-project", "-c", "user.email=new-project@localhost"]
        who = [] if ident.returncode == 0 and ident.stdout.strip() else who
        message = f"Start {name} from the {tf.FRAMEWORK_PACKAGE} template at {commit[:12]}"
        _git(dest, *who, "commit", "-q", "-m", message)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)  # nothing half-made that looks complete
        raise
    return dest


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
    print(f"created {dest} (your package: src/{args.name}); next: cd {dest} && make test")
    return 0


if __name__ == "__main__":
    sys.exit(main())
