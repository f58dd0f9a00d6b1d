"""The README and the docs site work as written.

Every internal link and anchor resolves; every path, Make target, config key and test the
docs name exists; the site builds with ``mkdocs build --strict`` and every page is in its
nav; a block that shows a file of the repository (first line ``# <path>``) shows the real
file; every command block marked runnable runs.

Marking a block runnable: put ``<!-- runnable -->`` (or ``<!-- runnable slow -->`` for one
that trains) on the line before its fence. Each line of the block runs in bash from the
repository root, on tiny settings: a ``make <target> ARGS="..."`` line gets
:data:`TINY_ARGS` and a fresh ``hydra.run.dir`` appended inside its ``ARGS``.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, base_env

DOCS = REPO / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
DOC_FILES = [REPO / "README.md", *PAGES]

# Appended to a runnable `make ... ARGS="..."` line: one epoch of two steps, one eval batch.
TINY_ARGS = "trainer.epochs=1 trainer.limit_train_steps=2 trainer.limit_eval_batches=1 logger=none"


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@dataclass
class Block:
    file: Path
    line: int
    info: str
    text: str
    marker: str  # "" or the html comment before the fence ("runnable", "runnable slow")


def split(path: Path) -> tuple[str, list[Block]]:
    """(the prose with every fenced block blanked out, the fenced blocks)."""
    prose, blocks, fence, body, start, marker, last = [], [], None, [], 0, "", ""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        opening = re.match(r"\s*(```+|~~~+)\s*(.*)", line)
        if fence is None and opening:
            fence, info, body, start = opening.group(1), opening.group(2).strip(), [], n
            found = re.fullmatch(r"\s*<!--\s*(runnable(?: slow)?)\s*-->\s*", last)
            marker = found.group(1) if found else ""
            prose.append("")
        elif fence is not None and line.strip() == fence:
            blocks.append(Block(path, start, info, "\n".join(body) + "\n", marker))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
        if line.strip():
            last = line
    return "\n".join(prose), blocks


def inline_code(prose: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose)


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[`*_]", "", text)
    return slugify(text, "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split(path)
    found = set()
    for line in prose.splitlines():
        if m := re.match(r"#{1,6}\s+(.*?)\s*(\{#([\w-]+)\})?\s*$", line):
            found.add(m.group(3) or slug(m.group(1)))
    return found


def links(path: Path) -> list[str]:
    prose, _ = split(path)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose)


# -- the site ----------------------------------------------------------------------------


def nav_pages() -> list[str]:
    import yaml

    def walk(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in walk(item)]
        if isinstance(node, dict):
            return [p for value in node.values() for p in walk(value)]
        return []

    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    return walk(config["nav"])


def test_every_docs_page_is_in_the_site_nav_and_every_nav_entry_exists() -> None:
    nav = nav_pages()
    pages = {str(p.relative_to(DOCS)) for p in PAGES}
    assert set(nav) == pages, (
        f"add to mkdocs.yml nav: {sorted(pages - set(nav))}; "
        f"in nav but absent: {sorted(set(nav) - pages)}"
    )


def test_every_page_is_linked_from_the_home_page_and_the_readme_links_the_loggers() -> None:
    """The home page's table is the manual's index: a page it omits is found only by
    chance (7 of 25 were, among them the loggers and the Optuna pages)."""
    home = (DOCS / "index.md").read_text()
    linked = set(re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", home))
    pages = {str(p.relative_to(DOCS)) for p in PAGES} - {"index.md"}
    assert pages <= linked, f"add to docs/index.md: {sorted(pages - linked)}"
    assert "(docs/loggers.md)" in (REPO / "README.md").read_text()


def test_the_docs_images_are_what_the_plot_code_draws_now() -> None:
    """docs/img/*.png are drawn by `make docs-images` from records in docs/img/src/; an image
    left from older plot code (titles and labels plots.py no longer draws) fails here."""
    proc = subprocess.run([sys.executable, "scripts/docs_images.py", "--check"], cwd=REPO,
                          env=base_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.startswith("ok: every docs image")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built once with ``mkdocs build --strict`` (what ``make docs`` runs)."""
    out = tmp_path_factory.mktemp("docs") / "site"
    mkdocs = Path(sys.executable).parent / "mkdocs"
    proc = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        env=base_env(NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_the_site_builds_strict(site: Path) -> None:
    """A broken link, anchor or image, or a page left out of the nav, fails the build."""
    assert (site / "index.html").is_file()
    assert (site / "img" / "smoke-run-curves.png").is_file()
    assert "smoke-run-curves.png" in (site / "seeing-a-run.html").read_text()


def browser_check(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "docs_browser_check.py"), str(site)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_a_headless_browser_finds_the_sites_images_and_links_and_names_a_broken_one(
    site: Path, tmp_path: Path
) -> None:
    """What `make docs-check` runs in CI: the home page and the page with images."""
    sys.path.insert(0, str(REPO / "scripts"))
    import docs_browser_check

    if docs_browser_check.find_browser(None) is None:
        pytest.skip("chromium is not installed (apt-get install chromium-headless-shell)")
    proc = browser_check(site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 2
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    (broken / "img" / "smoke-run-curves.png").unlink()
    index = broken / "index.html"
    index.write_text(index.read_text().replace('href="gpus.html"', 'href="gpus.html#nowhere"'))
    proc = browser_check(broken)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "broken image img/smoke-run-curves.png" in proc.stdout
    assert "gpus.html#nowhere (no such anchor)" in proc.stdout


def test_the_browser_check_without_a_site_or_a_browser_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = browser_check(tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: no built site") and "make docs" in proc.stderr
    (tmp_path / "index.html").write_text("<html></html>")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "docs_browser_check.py"), str(tmp_path)],
        env={**base_env(), "PATH": str(tmp_path), "CHROMIUM": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: no headless Chromium")


# -- links -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOC_FILES, ids=rel)
def test_every_internal_link_and_anchor_resolves(path: Path) -> None:
    broken = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {rel(dest)}")
    assert not broken, broken


# -- names: paths, make targets, tests, config keys --------------------------------------

PATH = re.compile(r"(?<![\w./~-])((?:src|conf|tests|scripts|docs|docker|\.ci|\.github)/[\w./-]*)")
TEST_REF = re.compile(r"(?<![\w/])((?:starter/)?test_\w+\.py)((?:::\w+)*)")


def named_paths(path: Path) -> set[str]:
    prose, _ = split(path)
    names = set()
    for code in inline_code(prose):
        if "<" in code or "*" in code or "..." in code:
            continue
        names.update(m.rstrip(".,:") for m in PATH.findall(code))
    return {n for n in names if n.rstrip("/")}


# The docs' stand-ins for a project's package (`make new-project NAME=mylab`): checked as
# the template's own package, src/starter.
PACKAGE_STAND_INS = re.compile(r"^(src|tests)/(x|mylab)(?=/|$)")
# Paths the docs name as what a command creates, not as files of the repository.
CREATED = {
    "conf/outputs/": "Hydra's run folder when started inside conf/",
    "conf/local/default.yaml": "the machine-local settings a user writes (git-ignored)",
}


def exists(name: str) -> bool:
    return name in CREATED or (REPO / PACKAGE_STAND_INS.sub(r"\1/starter", name)).exists()


@pytest.mark.parametrize("path", DOC_FILES, ids=rel)
def test_every_path_the_docs_name_exists(path: Path) -> None:
    missing = sorted(n for n in named_paths(path) if not exists(n))
    assert not missing, f"{rel(path)} names paths that do not exist: {missing}"


def make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z0-9-]*):", text, flags=re.M))


@pytest.mark.parametrize("path", DOC_FILES, ids=rel)
def test_every_make_target_the_docs_name_exists(path: Path) -> None:
    prose, blocks = split(path)
    texts = inline_code(prose) + [b.text for b in blocks if b.info in ("bash", "sh", "")]
    named = {t for text in texts for t in re.findall(r"(?<![\w-])make ([a-z][a-z0-9-]*)", text)}
    missing = sorted(named - make_targets())
    assert not missing, f"{rel(path)} names make targets the Makefile lacks: {missing}"


def test_the_readme_lists_every_make_target() -> None:
    prose, _ = split(REPO / "README.md")
    table = [line for line in prose.splitlines() if line.startswith("| `make ")]
    listed = {t for line in table for t in re.findall(r"`make ([a-z][a-z0-9-]*)", line)}
    internal = {"help"}  # `make help` is how the README says to list them
    assert make_targets() - internal - listed == set()


def _test_files(name: str) -> list[Path]:
    return sorted((REPO / "tests").rglob(name.rpartition("/")[2]))


@pytest.mark.parametrize("path", DOC_FILES, ids=rel)
def test_every_test_the_docs_name_exists(path: Path) -> None:
    prose, _ = split(path)
    missing = []
    for code in inline_code(prose):
        for file, names in TEST_REF.findall(code):
            found = _test_files(file)
            if not found:
                missing.append(file)
                continue
            source = "".join(p.read_text() for p in found)
            for name in filter(None, names.split("::")):
                if not re.search(rf"\b(def|class) {name}\b", source):
                    missing.append(f"{file}::{name}")
    assert not missing, f"{rel(path)} names tests that do not exist: {missing}"


# Groups whose options are `_target_` YAMLs: a key exists when some option (yours or the
# framework's self-check) has it. The others are typed schemas: the composed config has
# every key.
USER_GROUPS = ("dataset", "model", "task", "optimizer", "scheduler", "loss")
FILE_SUFFIX = r"(?:py|yaml|yml|json|jsonl|md|png|pt|txt|gz|sha256|diff|lock|sig|html|csv|in)"


@pytest.fixture(scope="module")
def composed() -> dict:
    """conf/train.yaml composed once, in process, with Hydra's own section."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from reprotrain import preflight
    from reprotrain.config import register_configs

    register_configs()
    preflight.register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("train", return_hydra_config=True)
    return OmegaConf.to_container(cfg, resolve=False)


# Names the docs write like config keys on purpose, and why each is not one.
NOT_KEYS = {
    "repro.pythonhashseed": "a field of run.json's repro section, which an archive carries",
    "trainer.epoch": "the documented typo (trainer.epochs) that is refused in one line",
    "hydra.sweeper.direction": "a key of hydra/sweeper=optuna, not of the default sweeper",
    "hydra.sweeper.sampler.seed": "a key of hydra/sweeper=optuna, not of the default sweeper",
    "hydra.sweeper.storage": "a key of hydra/sweeper=optuna, not of the default sweeper",
    "hydra.sweeper.n_trials": "a key of hydra/sweeper=optuna, not of the default sweeper",
    "hydra.sweeper.resume": "a key of hydra/sweeper=optuna, not of the default sweeper",
}


def target_parameters(target: str) -> set[str]:
    """The keyword arguments a `_target_` accepts (what preflight binds a YAML against)."""
    import inspect

    from hydra.utils import get_object

    try:
        return set(inspect.signature(get_object(target)).parameters)
    except Exception:
        return set()


@functools.cache
def group_keys(group: str) -> set[str]:
    """Every key some option of a user group has, and every argument its targets take."""
    from omegaconf import OmegaConf

    roots = [REPO / "conf" / group, REPO / "src" / "reprotrain" / "selfcheck" / "conf" / group]
    keys: set[str] = set()

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("_target_"), str):
                keys.update(prefix + name for name in target_parameters(node["_target_"]))
            for k, v in node.items():
                keys.add(f"{prefix}{k}")
                walk(v, f"{prefix}{k}.")

    for root in roots:
        for yaml_file in root.rglob("*.yaml") if root.is_dir() else []:
            walk(OmegaConf.to_container(OmegaConf.load(yaml_file), resolve=False), "")
    return keys


def has_key(node, parts: list[str]) -> bool:
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@pytest.mark.parametrize("path", DOC_FILES, ids=rel)
def test_every_config_key_the_docs_name_exists(path: Path, composed: dict) -> None:
    prose, _ = split(path)
    tops = {k for k, v in composed.items() if isinstance(v, dict)} | set(USER_GROUPS)
    pattern = re.compile(
        rf"(?<![\w./$-])({'|'.join(sorted(tops))})\.([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)"
        rf"(?![\w(/-])(?!\.{FILE_SUFFIX}\b)"
    )
    missing = []
    for code in inline_code(prose):
        for top, key in pattern.findall(code):
            if re.fullmatch(FILE_SUFFIX, key.split(".")[0]) or f"{top}.{key}" in NOT_KEYS:
                continue  # a file name (`record.py`), or one of NOT_KEYS
            if top in USER_GROUPS:
                ok = key in group_keys(top)
            else:
                ok = has_key(composed[top], key.split("."))
            if not ok:
                missing.append(f"{top}.{key}")
    assert not missing, f"{rel(path)} names config keys that do not exist: {sorted(set(missing))}"


# -- blocks that show files --------------------------------------------------------------


def shown_files() -> list[tuple[Block, str, str]]:
    out = []
    for path in DOC_FILES:
        for block in split(path)[1]:
            first, _, rest = block.text.partition("\n")
            if m := re.fullmatch(r"#\s+((?:src|conf)/[\w./-]+)(\s+\(.*\))?\s*", first):
                out.append((block, m.group(1), rest))
    return out


def _stripped(text: str) -> list[str]:
    lines = (re.sub(r"\s+#\s.*$", "", line).strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize(
    "block,shown,body",
    shown_files(),
    ids=lambda v: f"{rel(v.file)}:{v.line}" if isinstance(v, Block) else None,
)
def test_a_block_that_shows_a_file_shows_the_real_file(block: Block, shown: str, body: str) -> None:
    """``# path`` alone: the block is the file, byte for byte. ``# path (note)``: an
    excerpt, its lines (comments aside) in the file in order. ``(new)``: a file to write."""
    first = block.text.partition("\n")[0]
    file = REPO / shown
    if "(new" in first:
        assert file.parent.is_dir() and not file.exists(), f"{shown}: shown as new"
        return
    assert file.is_file(), f"{rel(block.file)}:{block.line} shows {shown}, which is absent"
    real = file.read_text()
    if first.strip() == f"# {shown}":
        assert body == real, f"{rel(block.file)}:{block.line} differs from {shown}"
        return
    lines = iter(_stripped(real))
    for line in _stripped(body):
        assert any(line == candidate for candidate in lines), (
            f"{rel(block.file)}:{block.line}: {line!r} is not in {shown} (in this order)"
        )


# -- runnable blocks ---------------------------------------------------------------------


def runnable() -> list:
    params = []
    for path in DOC_FILES:
        for block in split(path)[1]:
            if block.marker:
                marks = [pytest.mark.slow] if block.marker.endswith("slow") else []
                params.append(pytest.param(block, id=f"{rel(path)}:{block.line}", marks=marks))
    return params


def tiny(command: str, run_dir: Path) -> str:
    """A `make ... ARGS="..."` line with TINY_ARGS and its own run directory."""
    return re.sub(
        r'ARGS="([^"]*)"',
        lambda m: f'ARGS="{m.group(1)} {TINY_ARGS} hydra.run.dir={run_dir}"',
        command,
    )


def test_runnable_commands_get_tiny_settings_and_their_own_run_dir(tmp_path: Path) -> None:
    line = tiny('make train ARGS="experiment=smoke model=mlp"', tmp_path)
    assert line == (
        f'make train ARGS="experiment=smoke model=mlp {TINY_ARGS} hydra.run.dir={tmp_path}"'
    )
    assert any(b.values[0].marker for b in runnable()), "no block is marked runnable"


@pytest.mark.parametrize("block", runnable())
def test_runnable_blocks_run(block: Block, tmp_path: Path) -> None:
    lines = [line for line in block.text.splitlines() if line.strip()]
    script = "\n".join(
        tiny(line.split("  #")[0], tmp_path / f"run{i}") for i, line in enumerate(lines)
    )
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=REPO,
        env=base_env(PATH=f"{Path(sys.executable).parent}:{base_env()['PATH']}"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{script}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr


# -- defects named in the docs' own issue ------------------------------------------------


def test_the_readme_is_short_and_has_no_development_history() -> None:
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for page in DOC_FILES:
        found = re.findall(r"\b[Ii]ssues? \d+", page.read_text())
        assert not found, f"{rel(page)}: development history {found}"


def test_the_docs_name_no_file_a_user_does_not_have() -> None:
    for page in DOC_FILES:
        text = page.read_text()
        assert "DESIGN.md" not in text, rel(page)
        assert "docs/notes" not in text, rel(page)


def test_the_readme_randomness_table_is_the_docs_table() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Randomness sources") :].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    page = [
        line for line in (DOCS / "randomness.md").read_text().splitlines() if line.startswith("|")
    ]
    assert rows == page and len(rows) > 10


def test_a_symlinked_venv_is_ignored(tmp_path: Path) -> None:
    """A .venv that is a symlink (to a shared venv) must not make every run dirty."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")
    (tmp_path / "real-venv").mkdir()
    (tmp_path / ".venv").symlink_to(tmp_path / "real-venv")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    proc = subprocess.run(["git", "check-ignore", "-q", ".venv"], cwd=tmp_path, check=False)
    assert proc.returncode == 0, ".gitignore does not match a symlinked .venv"
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert ".venv" not in status
