"""A user component that cannot be built says why, in one line, before anything is written.

An import that fails inside a user's module keeps its cause (the missing package, the file and
line that raised); a loss ``weight`` of the wrong type, shape or dtype is refused at preflight,
not after the run directory was written as failed nor with a traceback from the first step.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import base_env
from reprotrain import preflight
from reprotrain.components import ComponentError, locate
from reprotrain.config import register_configs
from reprotrain.errors import ReprotrainError

MISSING = "reprotrain_test_no_such_package"


def user_package(root: Path, name: str) -> Path:
    """A package (a name of its own per test: imports are cached) whose ``data`` module
    imports a package that is not installed (line 3) and whose ``broken`` module imports a
    helper that raises (line 2)."""
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    data = f'"""doc"""\nimport os\nimport {MISSING}\n\nclass Data:\n    pass\n'
    (pkg / "data.py").write_text(data)
    (pkg / "helper.py").write_text("X = 1\nraise ValueError('no config file here\\nsecond line')\n")
    (pkg / "broken.py").write_text(f"from {name} import helper\n\nclass Data:\n    pass\n")
    return pkg


def test_a_module_importing_a_missing_package_names_the_package_and_the_file_and_line(
    tmp_path, monkeypatch
):
    user_package(tmp_path, "userpkg_a")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ComponentError) as e:
        locate("userpkg_a.data.Data", "dataset")
    message = str(e.value)
    assert f"No module named '{MISSING}'" in message
    assert "userpkg_a/data.py:3" in message
    assert f"install the package that provides '{MISSING}'" in message
    assert "\n" not in message


def test_an_error_raised_while_a_module_imports_names_the_file_and_line_that_raised(
    tmp_path, monkeypatch
):
    user_package(tmp_path, "userpkg_b")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ComponentError) as e:
        locate("userpkg_b.broken.Data", "model")
    assert "ValueError: no config file here (at userpkg_b/helper.py:2)" in str(e.value)
    assert "\n" not in str(e.value)
    (tmp_path / "userpkg_b" / "sibling.py").write_text("import userpkg_b.gone\nclass Data: ...\n")
    with pytest.raises(ComponentError) as e:
        locate("userpkg_b.sibling.Data", "model")
    assert "No module named 'userpkg_b.gone' (at userpkg_b/sibling.py:1)" in str(e.value)
    assert "install" not in str(e.value)  # a module of the user's own package: not a package


def test_a_target_that_does_not_exist_still_says_which_part_is_missing(tmp_path, monkeypatch):
    user_package(tmp_path, "userpkg_c")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ComponentError, match="'nope' is importable from module 'userpkg_c'"):
        locate("userpkg_c.nope.Data", "dataset")
    with pytest.raises(ComponentError, match="module 'no' is installed"):
        locate("no.such.Net", "model")


def test_the_trainer_refuses_the_missing_package_in_one_line_and_writes_nothing(tmp_path):
    user_package(tmp_path, "userpkg")
    proc = subprocess.run(
        [sys.executable, "-m", "reprotrain.train", "experiment=selfcheck",
         "dataset._target_=userpkg.data.Data", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=base_env(PYTHONPATH=str(tmp_path)), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: dataset._target_="), proc.stderr
    assert f"No module named '{MISSING}'" in lines[0] and "userpkg/data.py:3" in lines[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()


@pytest.fixture
def composed():
    register_configs()
    preflight.register_resolvers()


TENSOR = "+loss.weight={_target_:torch.tensor,data:%s}"


@pytest.mark.parametrize(
    ("override", "expect"),
    [
        ("+loss.weight=[1.0,9.0]",
         "loss.weight=[1.0, 9.0] is a list but torch.nn.CrossEntropyLoss takes a tensor"),
        (TENSOR % "[1.0,9.0,3.0]", "loss.weight has shape [3]; CrossEntropyLoss takes one weight "
                                   "per class, shape [10]: give 10 values"),
        (TENSOR % "[[1.0,9.0]]", "loss.weight has shape [1, 2]"),
        (TENSOR % "[1,1,1,1,1,1,1,1,1,1]", "loss.weight has dtype int64"),
    ],
    ids=["list", "wrong-length", "two-dims", "integers"],
)  # fmt: skip
def test_a_wrong_loss_weight_is_refused_at_preflight(composed, override, expect):
    with pytest.raises(ReprotrainError) as e:
        preflight.check(["experiment=selfcheck", override])
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_a_loss_weight_with_one_float_per_class_passes_preflight(composed):
    preflight.check(["experiment=selfcheck", TENSOR % ("[" + ",".join(["1.0"] * 10) + "]")])


def test_the_trainer_refuses_a_wrong_shaped_loss_weight_before_writing_the_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "reprotrain.train", "experiment=selfcheck",
         TENSOR % "[1.0,9.0,3.0]", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=base_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines == ["error: loss.weight has shape [3]; CrossEntropyLoss takes one weight per "
                     "class, shape [10]: give 10 values"], proc.stderr  # fmt: skip
    assert not (tmp_path / "run").exists()
