"""Lock validation and environment drift (reprotrain.repro.requirements_lock + the two CLIs).

Every check is exercised against the committed locks (must pass) and against a crafted
bad copy (must fail with a line that names the problem).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from reprotrain.hashing import file_sha256
from reprotrain.repro import requirements_lock as lf
from reprotrain.tools.locks import check_lock

ROOT = Path(__file__).resolve().parents[1]
LOCK_FILES = [
    "requirements.in",
    "requirements-dev.in",
    "requirements.lock",
    "requirements-dev.lock",
    "requirements.lock.sha256",
    "requirements-dev.lock.sha256",
    "requirements.lock.files",
    "requirements-dev.lock.files",
    # The optional extras' locks (make install EXTRAS=mlflow,wandb) are checked with the rest.
    *(f"{lock}{suffix}" for lock, _ in lf.ALL_PAIRS[2:] for suffix in ("", ".sha256", ".files")),
    *(src for _, src in lf.ALL_PAIRS[2:]),
]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the committed locks, .in files and sidecars."""
    for name in LOCK_FILES:
        shutil.copy2(ROOT / name, tmp_path / name)
    return tmp_path


def pairs(root: Path) -> list[tuple[Path, Path]]:
    return [(root / lk, root / i) for lk, i in lf.DEFAULT_PAIRS]


def run_cli(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"fixture text not found: {old!r}"
    path.write_text(text.replace(old, new, 1))


# ------------------------------------------------------------------ committed locks


def test_committed_locks_pass() -> None:
    assert check_lock.check_locks(pairs(ROOT)) == []


def test_committed_locks_have_no_machine_paths() -> None:
    for name in ("requirements.lock", "requirements-dev.lock"):
        text = (ROOT / name).read_text()
        assert "/opt/" not in text and "file:/" not in text
        assert "--find-links" not in text and "--index-url" not in text


def test_dev_sidecar_records_runtime_lock() -> None:
    record = lf.read_record(ROOT / "requirements-dev.lock")
    assert record is not None
    assert set(record) == {"requirements-dev.in", "requirements.lock", "requirements-dev.lock"}
    assert record["requirements.lock"] == file_sha256(ROOT / "requirements.lock")


# ------------------------------------------------------------------ crafted bad locks


def _torch_hash_line(lock: Path) -> str:
    lines = lock.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("torch=="))
    return lines[start + 1]  # a middle hash line (torch has many)


def test_removed_hash_is_detected(repo: Path) -> None:
    lock = repo / "requirements.lock"
    edit(lock, _torch_hash_line(lock), "")
    problems = check_lock.check_locks(pairs(repo))
    assert any("requirements.lock was edited after make lock" in p for p in problems)


def test_removed_only_hash_names_package(repo: Path) -> None:
    lock = repo / "requirements.lock"
    text = lock.read_text()
    start = text.index("antlr4-python3-runtime==4.9.3 \\\n")
    end = text.index("\n", text.index("--hash=", start))
    lock.write_text(text[:start] + "antlr4-python3-runtime==4.9.3" + text[end:])
    problems = check_lock.check_locks(pairs(repo))
    assert any("antlr4-python3-runtime==4.9.3 has no --hash" in p for p in problems)


def test_find_links_is_detected(repo: Path) -> None:
    lock = repo / "requirements.lock"
    lock.write_text("--find-links /some/path\n" + lock.read_text())
    problems = check_lock.check_locks(pairs(repo))
    assert any("--find-links /some/path" in p and "index or local path" in p for p in problems)


@pytest.mark.parametrize(
    "line, needle",
    [
        ("--index-url https://mirror.internal/simple", "index or local path"),
        ("--extra-index-url file:///opt/pypi/simple", "index or local path"),
        ("-e ./vendor/thing", "does not belong in a lock"),
        ("thing @ file:///tmp/thing-1.0-py3-none-any.whl", "direct reference"),
        ("./vendor/thing-1.0.tar.gz", "direct reference"),
        ("thing>=1.0 --hash=sha256:" + "a" * 64, "thing is not pinned with =="),
        ("thing==1.0 --hash=md5:abc", "malformed hash"),
    ],
)
def test_bad_lines(line: str, needle: str) -> None:
    lock = lf.parse_lock(
        Path("x.lock"), "six==1.16.0 \\\n    --hash=sha256:" + "b" * 64 + "\n" + line
    )
    assert any(needle in p for p in lock.problems), lock.problems
    assert "six" in lock.entries and lock.entries["six"].hashes == ["b" * 64]


def test_file_url_in_comment_is_detected() -> None:
    text = "six==1.16.0 --hash=sha256:" + "b" * 64 + "\n    # via file:///home/me/pkg\n"
    assert any("file: URL" in p for p in lf.parse_lock(Path("x.lock"), text).problems)


def test_clean_crafted_lock_parses() -> None:
    text = (
        "# header\n"
        "PyYAML==6.0.4 \\\n"
        "    --hash=sha256:" + "1" * 64 + " \\\n"
        "    --hash=sha256:" + "2" * 64 + "\n"
        "    # via omegaconf\n"
        "typing-extensions==4.16.0 ; python_version >= '3.8' \\\n"
        "    --hash=sha256:" + "3" * 64 + "\n"
    )
    lock = lf.parse_lock(Path("x.lock"), text)
    assert lock.problems == []
    assert lock.entries["pyyaml"].version == "6.0.4"
    assert len(lock.entries["pyyaml"].hashes) == 2
    assert lock.entries["typing-extensions"].marker == "python_version >= '3.8'"


def test_changed_in_is_stale(repo: Path) -> None:
    with (repo / "requirements.in").open("a") as f:
        f.write("requests>=2\n")
    problems = check_lock.check_locks(pairs(repo))
    assert any("requirements.in changed since the lock was compiled" in p for p in problems)
    assert any("requests" in p and "not locked" in p for p in problems)


def test_changed_runtime_lock_makes_dev_lock_stale(repo: Path) -> None:
    lock = repo / "requirements.lock"
    lock.write_text(lock.read_text() + "\n")
    problems = lf.check_staleness(repo / "requirements-dev.lock", repo / "requirements-dev.in")
    assert any("requirements.lock changed since" in p for p in problems), problems


def test_missing_sidecar(repo: Path) -> None:
    (repo / "requirements.lock.sha256").unlink()
    problems = check_lock.check_locks(pairs(repo))
    assert any("no requirements.lock.sha256 record" in p for p in problems)


def test_in_not_satisfied_even_with_fresh_record(repo: Path) -> None:
    edit(repo / "requirements.in", "numpy>=1.26,<3", "numpy>=3")
    lf.write_record(repo / "requirements.lock", repo / "requirements.in")
    problems = check_lock.check_locks(pairs(repo))
    assert any("does not satisfy 'numpy>=3'" in p for p in problems), problems


def test_locks_disagree(repo: Path) -> None:
    a = lf.parse_lock(Path("a.lock"), "six==1.16.0 --hash=sha256:" + "a" * 64 + "\n")
    b = lf.parse_lock(Path("b.lock"), "six==1.17.0 --hash=sha256:" + "a" * 64 + "\n")
    c = lf.parse_lock(Path("c.lock"), "six==1.16.0 --hash=sha256:" + "c" * 64 + "\n")
    assert lf.check_agreement([a, b]) == ["a.lock and b.lock disagree on six: 1.16.0 vs 1.17.0"]
    assert "different hash sets" in lf.check_agreement([a, c])[0]
    assert lf.check_agreement([a, a]) == []


def test_record_is_sha256sum_compatible(repo: Path) -> None:
    if shutil.which("sha256sum") is None:
        pytest.skip("sha256sum not on PATH")
    for lock in ("requirements.lock.sha256", "requirements-dev.lock.sha256"):
        proc = subprocess.run(["sha256sum", "-c", lock], cwd=repo, capture_output=True, check=False)
        assert proc.returncode == 0, proc.stdout
    (repo / "requirements.in").write_text("changed\n")
    proc = subprocess.run(
        ["sha256sum", "-c", "requirements.lock.sha256"], cwd=repo, capture_output=True, check=False
    )
    assert proc.returncode != 0


# ------------------------------------------------------------------ check_lock CLI


def test_check_lock_cli_ok(repo: Path) -> None:
    proc = run_cli("reprotrain.tools.locks.check_lock", "--root", str(repo))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok: ")


def test_check_lock_cli_fails_one_line_each(repo: Path) -> None:
    lock = repo / "requirements.lock"
    edit(lock, _torch_hash_line(lock), "")
    with (repo / "requirements-dev.lock").open("a") as f:
        f.write("--find-links /some/path\n")
    proc = run_cli("reprotrain.tools.locks.check_lock", "--root", str(repo))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines and all(line.startswith("error: ") for line in lines)
    assert any("requirements.lock was edited after make lock" in line for line in lines)
    assert any("--find-links /some/path" in line for line in lines)


def test_check_lock_cli_record_roundtrip(repo: Path) -> None:
    edit(repo / "requirements-dev.in", "ruff>=0.6", "ruff>=0.5")
    assert run_cli("reprotrain.tools.locks.check_lock", "--root", str(repo)).returncode == 1
    rec = run_cli("reprotrain.tools.locks.check_lock", "--root", str(repo), "--record")
    assert rec.returncode == 0
    assert run_cli("reprotrain.tools.locks.check_lock", "--root", str(repo)).returncode == 0


# ------------------------------------------------------------------ environment drift


def test_compare_env_reports_each_kind() -> None:
    locked = {"numpy": {"2.4.6"}, "PyYAML": {"6.0.4"}, "tqdm": {"4.70.1"}, "torch": {"2.14.1"}}
    installed = {
        "numpy": "2.4.5",
        "pyyaml": "6.0.4",
        "six": "1.16.0",
        "reprotrain": "0.1.0",
        "torch": "2.14.1+cpu",
    }
    drift = lf.compare_env(locked, installed, project="reprotrain")
    assert drift["status"] == "drift"
    assert drift["missing"] == ["tqdm"]
    assert drift["extra"] == ["six"]  # the project itself is never drift
    assert drift["different"] == [
        {"name": "numpy", "locked": "2.4.6", "installed": "2.4.5"},
        {"name": "torch", "locked": "2.14.1", "installed": "2.14.1+cpu"},
    ]


def test_unlocked_pip_is_not_drift_but_a_locked_pip_is_compared() -> None:
    locked = {"torch": {"2.14.1"}}
    assert lf.compare_env(locked, {"torch": "2.14.1", "pip": "24.0"})["status"] == "ok"
    pinned = lf.compare_env({**locked, "pip": {"26.3"}}, {"torch": "2.14.1", "pip": "24.0"})
    assert pinned["status"] == "drift" and pinned["different"][0]["name"] == "pip"


def test_compare_env_ok_with_normalised_names() -> None:
    locked = {"typing_extensions": {"4.16.0"}, "Jinja2": {"3.1.6"}, "reprotrain": {"9"}}
    installed = {"typing-extensions": "4.16.0", "jinja2": "3.1.6"}
    assert lf.compare_env(locked, installed, project="reprotrain")["status"] == "ok"


def test_the_project_is_pyprojects_name_and_is_not_drift_only_when_installed_editable(tmp_path):
    """A project made from the template (``make new-project NAME=lab``) is ``lab``: its own
    package installed editable is not drift (its code is the checkout's, covered by the
    code digest); a copy in site-packages is."""
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "Lab_Tools"\nversion = "0.1"\n')
    assert lf.project_name(tmp_path) == "lab-tools"
    assert lf.project_name(tmp_path / "nowhere") is None
    installed = {"lab-tools": "0.1", "torch": "2.14.1"}
    assert lf.compare_env({"torch": {"2.14.1"}}, installed, "lab-tools")["status"] == "ok"
    assert lf.compare_env({"torch": {"2.14.1"}}, installed)["extra"] == ["lab-tools"]
    assert lf.project_name(REPO) == "reprotrain"
    assert Path(lf.editable_source("reprotrain")).resolve() == REPO.resolve()
    assert lf.editable_source("torch") is None  # installed from a wheel
    assert lf.env_drift(REPO)["project"]["name"] == "reprotrain"


def _write_lock_of(path: Path, versions: dict[str, str]) -> None:
    path.write_text(
        "".join(f"{n}=={v} \\\n    --hash=sha256:{'0' * 64}\n" for n, v in sorted(versions.items()))
    )


def test_env_drift_against_running_interpreter(tmp_path: Path) -> None:
    installed = lf.installed_versions()
    assert "pytest" in installed
    _write_lock_of(tmp_path / "requirements.lock", installed)
    assert lf.env_drift(tmp_path)["status"] == "ok"
    without = {k: v for k, v in installed.items() if k != "pytest"}
    _write_lock_of(tmp_path / "requirements.lock", without)
    drift = lf.env_drift(tmp_path)
    assert drift["status"] == "drift"
    assert drift["extra"] == ["pytest"]
    assert drift["locks"] == ["requirements.lock"]


def test_env_drift_no_lock(tmp_path: Path) -> None:
    assert lf.env_drift(tmp_path)["status"] == "no-lock"


def test_env_check_cli_names_extra_package(tmp_path: Path) -> None:
    installed = lf.installed_versions()
    without = {k: v for k, v in installed.items() if k != "iniconfig"}
    assert len(without) < len(installed), "iniconfig (a pytest dependency) should be installed"
    _write_lock_of(tmp_path / "requirements.lock", without)
    proc = run_cli("reprotrain.tools.locks.env_check", "--root", str(tmp_path))
    assert proc.returncode == 1, proc.stdout
    assert "error: extra: iniconfig" in proc.stdout
    _write_lock_of(tmp_path / "requirements.lock", installed)
    proc = run_cli("reprotrain.tools.locks.env_check", "--root", str(tmp_path))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.startswith("ok: ")


# ------------------------------------------------------------------ run.json helpers


def test_lock_sha256(tmp_path: Path) -> None:
    assert lf.lock_sha256(tmp_path) is None
    assert (
        lf.lock_sha256(ROOT)
        == hashlib.sha256((ROOT / "requirements.lock").read_bytes()).hexdigest()
    )


# ------------------------------------------------------------------ one lock, every platform

from reprotrain.repro import lock_platforms as lp  # noqa: E402

LOCKS = ("requirements.lock", "requirements-dev.lock")


def _entries(lock_name: str, root: Path = ROOT) -> list[lf.LockEntry]:
    return list(lf.parse_lock(root / lock_name).entries.values())


def test_the_promised_platforms() -> None:
    assert [p.name for p in lp.PLATFORMS] == ["linux-x86_64", "linux-aarch64", "macos-arm64"]
    assert lp.PYTHON == (3, 11)


@pytest.mark.parametrize("platform", lp.PLATFORMS, ids=lambda p: p.name)
@pytest.mark.parametrize("lock_name", LOCKS)
def test_every_platform_gets_a_complete_hashed_set(platform: lp.Platform, lock_name: str) -> None:
    """Each requirement whose marker applies there has a wheel for that platform's tags among
    its hashes (antlr4-python3-runtime, sdist-only and pure Python, is the named exception)."""
    files = lp.read_files(ROOT / lock_name)
    assert files is not None, f"{lock_name}.files missing; run make lock"
    assert lp.check_files(lf.parse_lock(ROOT / lock_name), files) == []
    assert lp.check_coverage(_entries(lock_name), files, platform, lock_name) == []


def test_coverage_sees_what_applies_per_platform() -> None:
    """Markers are evaluated for the platform, not the host: CUDA wheels on Linux only."""
    entries = {e.name: e for e in _entries("requirements.lock")}
    cuda = [n for n in entries if n.startswith(("nvidia-", "cuda-")) or n == "triton"]
    assert len(cuda) >= 10 and "torch" in entries and "scipy" in entries
    by_platform = {p.name: p.marker_environment() for p in lp.PLATFORMS}
    for name in cuda:
        assert not lf.marker_applies(entries[name].marker, by_platform["macos-arm64"]), name
        assert lf.marker_applies(entries[name].marker, by_platform["linux-x86_64"]), name
    assert lf.marker_applies(entries["torch"].marker, by_platform["macos-arm64"])
    # a Windows-only dependency is in the universal lock but applies on none of the three
    assert all(
        not lf.marker_applies(entries["colorama"].marker, env) for env in by_platform.values()
    )


def test_torch_pair_is_pinned_exactly_and_scipy_is_locked() -> None:
    text = (ROOT / "requirements.in").read_text()
    for pin in ("torch==2.14.1", "torchvision==0.29.1", "scipy==1.17.1"):
        assert re.search(rf"^{re.escape(pin)}$", text, re.M), pin
    entries = {e.name: e.version for e in _entries("requirements.lock")}
    assert (entries["torch"], entries["torchvision"], entries["scipy"]) == (
        "2.14.1",
        "0.29.1",
        "1.17.1",
    )
    # the compiler make lock runs is itself locked, exactly
    assert {e.name: e.version for e in _entries("requirements-dev.lock")}["uv"] == "0.13.9"


def _files_without(files: dict[str, str], pattern: str) -> dict[str, str]:
    kept = {h: n for h, n in files.items() if not re.search(pattern, n)}
    assert len(kept) < len(files), pattern
    return kept


def test_a_platform_without_its_wheel_is_reported() -> None:
    files = lp.read_files(ROOT / "requirements.lock")
    assert files is not None
    entries = _entries("requirements.lock")
    mac, linux = lp.PLATFORMS[2], lp.PLATFORMS[0]
    # pretend torch's cp311 macOS arm64 wheel was never hashed (as a Linux-only compile does)
    no_mac = {
        h: n for h, n in files.items() if not (n.startswith("torch-2.14.1-cp311") and "macosx" in n)
    }
    assert len(no_mac) == len(files) - 1
    problems = lp.check_coverage(entries, no_mac, mac, "requirements.lock")
    assert len(problems) == 1 and "torch==2.14.1 applies on macos-arm64 (cp311)" in problems[0]
    assert lp.check_coverage(entries, no_mac, linux) == []
    # a binary package that offers only its sdist is not allowed; antlr (named) is
    numpy_sdist = {h: n for h, n in files.items() if not n.startswith("numpy-")}
    numpy = next(e for e in entries if e.name == "numpy")
    numpy_sdist[numpy.hashes[0]] = "numpy-2.4.6.tar.gz"
    problems = lp.check_coverage(entries, numpy_sdist, linux, "requirements.lock")
    assert len(problems) == 1 and "numpy==2.4.6" in problems[0]
    assert "not an allowed sdist-only package" in problems[0]
    antlr = next(e for e in entries if e.name == "antlr4-python3-runtime")
    assert all(files[h].endswith(".tar.gz") for h in antlr.hashes)


def test_wheel_tags_expand_compressed_tag_sets() -> None:
    name = "scipy-1.17.1-cp311-cp311-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl"
    assert lp._wheel_tags(name) == {
        "cp311-cp311-manylinux_2_27_aarch64",
        "cp311-cp311-manylinux_2_28_aarch64",
    }
    assert "cp311-cp311-manylinux_2_28_aarch64" in lp.PLATFORMS[1].tags()
    assert "cp311-cp311-manylinux_2_34_aarch64" not in lp.PLATFORMS[1].tags()  # glibc floor
    assert "py3-none-any" in lp.PLATFORMS[2].tags()
    assert "cp311-cp311-macosx_14_0_arm64" in lp.PLATFORMS[2].tags()
    assert "cp311-cp311-macosx_15_0_arm64" not in lp.PLATFORMS[2].tags()  # macOS 14 floor


def test_files_sidecar_drift_is_detected(repo: Path) -> None:
    lock = repo / "requirements.lock"
    files = lp.read_files(lock)
    assert files is not None and check_lock.check_locks(pairs(repo)) == []
    # a hash the sidecar does not name
    lp.write_files(lock, _files_without(files, r"^torchvision-0\.29\.1-cp311"))
    assert any(
        "torchvision==0.29.1 has a hash that" in p for p in check_lock.check_locks(pairs(repo))
    )
    # a file of another release behind a hash
    digest = next(h for h, n in files.items() if n.startswith("tqdm-"))
    lp.write_files(lock, {**files, digest: "tqdm-4.0.0-py3-none-any.whl"})
    assert any(
        "tqdm-4.0.0-py3-none-any.whl is not a file of tqdm==4.70.1" in p
        for p in check_lock.check_locks(pairs(repo))
    )
    # a file whose hash the lock no longer holds (the lock moved on, the sidecar did not)
    lp.write_files(lock, {**files, "e" * 64: "six-1.16.0-py2.py3-none-any.whl"})
    assert any(
        "requirements.lock.files is stale: 1 file(s)" in p
        for p in check_lock.check_locks(pairs(repo))
    )
    (repo / "requirements.lock.files").unlink()
    assert any("no requirements.lock.files" in p for p in check_lock.check_locks(pairs(repo)))


def test_invalid_marker_is_detected() -> None:
    text = "six==1.16.0 ; sys_platform == 'linux' and --hash=sha256:" + "b" * 64 + "\n"
    assert any("invalid environment marker" in p for p in lf.parse_lock(Path("x"), text).problems)


def test_env_check_expects_only_what_applies_on_the_host(tmp_path: Path) -> None:
    """env-check evaluates markers: a macOS venv is not missing the CUDA wheels."""
    mac = lp.PLATFORMS[2].marker_environment()
    linux = lp.PLATFORMS[0].marker_environment()
    on_mac, _ = lf.locked_versions(ROOT, mac)
    on_linux, _ = lf.locked_versions(ROOT, linux)
    assert "torch" in on_mac and "nvidia-cublas" not in on_mac and "triton" not in on_mac
    assert "nvidia-cublas" in on_linux and "triton" in on_linux
    # The runtime lock's colorama is Windows-only (tqdm's); the dev lock needs it everywhere
    # (mkdocs-material), so the runtime lock alone shows the marker at work.
    shutil.copy(ROOT / "requirements.lock", tmp_path / "requirements.lock")
    runtime_mac, _ = lf.locked_versions(tmp_path, mac)
    runtime_linux, _ = lf.locked_versions(tmp_path, linux)
    assert "colorama" not in runtime_mac and "colorama" not in runtime_linux
    assert "torch" in runtime_mac


def test_fetch_files_reads_the_index_offline(tmp_path: Path) -> None:
    """make lock's file listing, against index pages on disk (PEP 691 JSON and PEP 503 HTML)."""
    import json

    h1, h2, h3 = "1" * 64, "2" * 64, "3" * 64
    (tmp_path / "six").mkdir()
    (tmp_path / "six" / "index.json").write_text(
        json.dumps(
            {
                "files": [
                    {"filename": "six-1.16.0-py2.py3-none-any.whl", "hashes": {"sha256": h1}},
                    {"filename": "six-1.16.0.tar.gz", "hashes": {"sha256": h2}},
                ]
            }
        )
    )
    (tmp_path / "six" / "index.html").write_text(
        f'<a href="../six-1.16.0.tar.gz#sha256={h2}">six-1.16.0.tar.gz</a>\n'
    )
    assert lp._index_page((tmp_path / "six" / "index.json").as_uri(), 5) == {
        h1: "six-1.16.0-py2.py3-none-any.whl",
        h2: "six-1.16.0.tar.gz",
    }
    assert lp._index_page((tmp_path / "six" / "index.html").as_uri(), 5) == {
        h2: "six-1.16.0.tar.gz"
    }
    lock = lf.parse_lock(Path("x.lock"), f"six==1.16.0 --hash=sha256:{h1} --hash=sha256:{h2}\n")

    def page(url: str, timeout: float) -> dict[str, str]:
        assert url == "https://example.invalid/simple/six/"
        return lp._index_page((tmp_path / "six" / "index.json").as_uri(), timeout)

    files = lp.fetch_files(lock, "https://example.invalid/simple/", page)
    assert files == {h1: "six-1.16.0-py2.py3-none-any.whl", h2: "six-1.16.0.tar.gz"}
    assert lp.check_files(lock, files) == []
    missing = lf.parse_lock(Path("x.lock"), f"six==1.16.0 --hash=sha256:{h3}\n")
    with pytest.raises(LookupError, match=r"six==1\.16\.0: hash 333333333333"):
        lp.fetch_files(missing, "https://example.invalid/simple", page)


def test_make_lock_compiles_one_universal_lock() -> None:
    """make lock/upgrade run uv with --universal --generate-hashes, no index URL, from the venv."""
    text = (ROOT / "Makefile").read_text()
    compile_line = re.search(r"^UV_COMPILE = (.*(?:\\\n.*)*)", text, re.M)
    assert compile_line, "UV_COMPILE missing"
    flags = compile_line.group(1)
    for flag in ("$(VENV)/bin/uv pip compile", "--universal", "--generate-hashes"):
        assert flag in flags, flag
    assert "--emit-index-url" not in flags and "--emit-find-links" not in flags
    assert "--record-files" in text
    for lock_name in LOCKS:
        assert (
            (ROOT / lock_name)
            .read_text()
            .startswith(
                "# This file was autogenerated by uv via the following command:\n#    make lock\n"
            )
        )


def test_environment_txt_lists_the_packages_pip_itself_lists():
    """The run's torch report answers collect_env's ``pip list`` in process: the same text."""
    from importlib import metadata

    from torch.utils import collect_env

    from reprotrain.repro import requirements_lock
    from reprotrain.start import provenance

    pip = [sys.executable, "-mpip", "list", "--format=freeze"]
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    real = subprocess.run(pip, capture_output=True, text=True, check=True, env=env)
    assert requirements_lock.pip_list() == real.stdout.strip()
    own_run = collect_env.run
    report = provenance.torch_report(collect_env)
    assert f"[pip3] torch=={metadata.version('torch')}\n" in report
    assert collect_env.run is own_run  # torch's module is left as it was
