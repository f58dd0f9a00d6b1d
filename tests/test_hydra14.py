"""Ready for Hydra 1.4: the trust rule and every shipped ``_target_`` work under Hydra's own
``_target_`` allowlist (1.4.0rc3: ``execution_whitelist``; its earlier candidates:
``target_whitelist``), and the allowlist is the trust rule's (``config_trust.Rule.allowed``,
``allowlist.allowing``), not a second list. The newest 1.4 release candidate the registry
serves is installed into a scratch venv (never .venv) and the instantiate, sweep and
reproduce tests run there."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import REPO, base_env

HYDRA_14 = "hydra-core>=1.4.0rc1,<1.5"
#: The instantiate, sweep and reproduce tests run again under Hydra 1.4.
TESTS = [
    "tests/test_partial_components.py",
    "tests/test_component_errors.py",
    "tests/test_gate.py",
    "tests/test_sweep_continuation.py::"
    "test_a_sweep_killed_inside_its_last_job_continues_and_leaves_the_finished_job",
    "tests/test_trust.py",
]
CHECK = r"""
import sys, warnings
import hydra
from hydra._internal.utils import _locate
from hydra.utils import instantiate
from omegaconf import OmegaConf
from reprotrain import REPO_ROOT
from reprotrain.allowlist import allowing
from reprotrain.tools.reproduce.config_trust import Rule
assert hydra.__version__.startswith("1.4"), hydra.__version__
rule = Rule.of(REPO_ROOT)
allowed = rule.allowed()
with warnings.catch_warnings():
    warnings.simplefilter("error")  # 1.4 warns for a target resolved with no allowlist
    with allowing(allowed):
        for target in sorted(allowed):
            if target.startswith("hydra_plugins."):
                continue  # launchers: Hydra builds them itself, from hydra/launcher=
            instantiate(OmegaConf.create({"_target_": target, "_partial_": True}))
    starter = "reprotrain.launchers.run_forwarding_signals"
    try:
        with allowing(allowed):
            instantiate({"_target_": starter, "cmd": ["true"], "env": {}})
    except Exception as e:
        assert "whitelist" in str(e), e
    else:
        raise SystemExit("Hydra let a process-starting callable through the rule's allowlist")
print("checked", len(allowed), "targets under hydra", hydra.__version__)
"""


@pytest.fixture(scope="module")
def hydra14(tmp_path_factory) -> Path:
    """A scratch venv seeing .venv's packages, with the newest Hydra 1.4 candidate on top."""
    venv = tmp_path_factory.mktemp("hydra14") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                           "get_paths()['purelib'])"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    ours = sysconfig.get_paths()["purelib"]  # .venv's: torch, omegaconf, the editable install
    (Path(site) / "zz_reprotrain.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    pip = [str(python), "-m", "pip", "install", "-q", "--pre", "--disable-pip-version-check"]
    got = subprocess.run([*pip, HYDRA_14], capture_output=True, text=True, timeout=600)
    if got.returncode:
        why = (got.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"optional extra not installed: {HYDRA_14} (pip: {why})")
    return python


@pytest.mark.slow
def test_the_trust_rule_is_hydra_14s_allowlist_and_every_shipped_target_passes_it(hydra14):
    proc = subprocess.run([str(hydra14), "-c", CHECK], cwd=REPO, env=base_env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "under hydra 1.4" in proc.stdout


@pytest.mark.slow
def test_the_instantiate_sweep_and_reproduce_tests_pass_under_hydra_14(hydra14):
    cmd = [str(hydra14), "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=3000)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:]
