"""Every path a config names is confined (docs/guarantees.md, "Paths a config names").

The attack first: ``reproduce`` of an archive whose CSV file name is absolute or climbs out
with ``..`` replaced a file outside the run and still said REPRODUCED. Then the doors: every
path-like key of the schemas and of every shipped ``_target_`` YAML, found by enumeration,
each tried with an absolute path, ``..`` and a symlink that leads out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TINY, assert_ok, base_env, train


def tool(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"reprotrain.tools.{name}", *args], cwd=cwd,
                          env=base_env(), capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def csv_archive(tmp_path_factory) -> Path:
    """A tiny run with the CSV logger, archived."""
    base = tmp_path_factory.mktemp("csv")
    assert_ok(train(base / "run", *TINY, "logger=csv"))
    assert_ok(tool("archive.archive", str(base / "run"), "--out-dir", str(base), cwd=base))
    (archive,) = base.glob("*.tar.gz")
    return archive


def with_csv_filename(archive: Path, tmp: Path, filename: str) -> Path:
    """The archive with ``logger.csv.filename`` replaced (a non-identity key: the record's
    config_sha256 still holds) and its manifest regenerated, as its author would."""
    from test_archive import repack, unpack

    top = unpack(archive, tmp / "unpacked")
    config = top / "run" / "config.resolved.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["logger"]["csv"]["filename"] = filename
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return repack(top, tmp / "hostile.tar.gz")


@pytest.mark.parametrize("how", ["absolute", "dotdot"])
def test_reproduce_of_an_archive_whose_csv_file_leaves_the_run_writes_nothing_outside(
    csv_archive, tmp_path, how
):
    """Was: the victim file replaced by the CSV rows, and the verdict REPRODUCED."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    runs = tmp_path / "runs"
    # The re-run's directory is <runs>/<stamp>: four levels up from it is tmp_path.
    name = str(victim) if how == "absolute" else "../../victim.txt"
    hostile = with_csv_filename(csv_archive, tmp_path, name)
    proc = tool("reproduce.reproduce", str(hostile), "--trust", "--runs-dir", str(runs),
                cwd=tmp_path)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert victim.read_text() == "precious\n", out[-3000:]
    assert proc.returncode != 0 and "REPRODUCED" not in proc.stdout, out[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert errors and "logger.csv.filename=" in errors[0] and "Traceback" not in out, out[-3000:]
    assert not any(p.name == "metrics.csv" for p in tmp_path.rglob("*")), "a CSV was written"
