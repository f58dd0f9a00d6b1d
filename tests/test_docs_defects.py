"""What the docs promise about ``--help``, shell completion and the report's code state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, base_env
from reprotrain.run import report
from test_report import fake_run


def test_help_lists_the_groups_hydra_searchpath_adds_such_as_experiment_selfcheck() -> None:
    """The framework's own job lives in pkg://reprotrain.selfcheck.conf, reached through
    conf/train.yaml's hydra.searchpath; --help must list what a user can choose there."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from reprotrain import helptext
    from reprotrain.config import register_configs

    register_configs()  # what the entry point does before Hydra composes (or lists) anything
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        loader = GlobalHydra.instance().config_loader()
        groups = helptext.config_groups(loader, "train", [])
    assert "selfcheck" in groups["experiment"]
    assert "smoke" in groups["experiment"] and "hydra/launcher" in groups
    assert not any(o.endswith("_schema") for opts in groups.values() for o in opts)


def _identity_line(run_dir: Path) -> str:
    text = report.render_markdown(report.load_run(run_dir), None)
    return next(line for line in text.splitlines() if line.startswith("| git"))


def test_a_report_names_git_diff_only_when_the_run_directory_has_one(tmp_path: Path) -> None:
    run_dir = fake_run(tmp_path / "run")
    rec = json.loads((run_dir / "run.json").read_text())
    untracked = [{"path": "notes.txt", "size": 3, "sha256": "0" * 64, "included": False}]
    rec["git"] = {"commit": "a" * 40, "branch": "main", "dirty": True, "untracked": untracked}
    (run_dir / "run.json").write_text(json.dumps(rec))
    line = _identity_line(run_dir)
    assert "**dirty**" in line and "git.diff" not in line, line
    assert "1 untracked file(s)" in line
    (run_dir / "git.diff").write_text("diff --git a/x b/x\n")
    assert "tracked changes in git.diff" in _identity_line(run_dir)
    rec["git"] = {**rec["git"], "dirty": False, "untracked": []}
    (run_dir / "run.json").write_text(json.dumps(rec))
    assert "clean" in _identity_line(run_dir)


def test_the_documented_bash_completion_installs_for_reprotrain_train_and_completes_groups() -> (
    None
):
    """docs/seeing-a-run.md: eval "$(.venv/bin/reprotrain-train -sc install=bash)"."""
    exe = Path(sys.executable).parent / "reprotrain-train"
    install = subprocess.run(
        [str(exe), "-sc", "install=bash"],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    assert install.stdout.rstrip().endswith("-F hydra_bash_completion reprotrain-train")
    line = "reprotrain-train experiment=s"
    query = subprocess.run(
        [str(exe), "-sc", "query=bash"],
        cwd=REPO,
        env={**base_env(), "COMP_LINE": line, "COMP_POINT": str(len(line))},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert query.returncode == 0, query.stderr[-2000:]
    offered = query.stdout.split()
    assert "experiment=selfcheck" in offered and "experiment=smoke" in offered
    assert os.sep not in "".join(offered)  # options, not file names
