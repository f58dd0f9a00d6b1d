"""A skipped promise fails the run (pytest plugin, loaded by conftest).

Why: a skip whose reason stopped being true hides an untested promise behind a green run
(issue 20: the submitit requeue test was skipped for a trainer feature that had shipped). A
test may skip only for what a machine can lack without anything being wrong with the code:
a device (CUDA, MPS, a GPU), an optional extra that is not installed, an external binary
(named in ``BINARIES``), or another CPU (a pinned hash measured on other CPU identities).
Any other skip reason is listed at the end of the run and the run exits 1 (xfail is not a
skip; deselection by ``-m`` is not either).
"""

from __future__ import annotations

import re

import pytest

#: External programs a test may need and a machine may not have.
BINARIES = (
    "actionlint",
    "chromium",  # the docs site's browser check (scripts/docs_browser_check.py)
    "docker",
    "git",
    "hadolint",
    "make",
    "nvidia-smi",
    "qemu-x86_64",  # Debian qemu-user: emulated CPUs (tests/test_host_matrix.py)
    "sha256sum",
    "ssh-keygen",
)
_BIN = "|".join(re.escape(b) for b in BINARIES)
#: (what may be missing, the reason pattern that says so)
ALLOWED: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("a device", re.compile(r"\b(CUDA|MPS|GPU)s?\b")),
    ("an optional extra", re.compile(r"^optional extra not installed\b")),
    ("an external binary", re.compile(rf"^(needs|requires) (the )?({_BIN})\b")),
    ("an external binary", re.compile(rf"^({_BIN})( binary)? (is )?not (installed|on PATH)\b")),
    # Pinned bits exist per CPU identity (strict) or per architecture (portable): another
    # CPU model or an arm64 host lacks a value without anything being wrong (issue 24).
    ("another CPU", re.compile(r"^no pinned strict hash for this CPU identity\b")),
    ("another CPU", re.compile(r"^repro=portable covers x86-64\b")),
)


def allowed(reason: str) -> str | None:
    """What the reason says is missing (``"a device"``, ...), or None when it is not allowed."""
    reason = re.sub(r"^Skipped: ", "", reason.strip())
    for kind, pattern in ALLOWED:
        if pattern.search(reason):
            return kind
    return None


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    text = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return re.sub(r"^Skipped: ", "", text)


class SkipPolicy:
    def __init__(self) -> None:
        self.refused: list[tuple[str, str]] = []

    def _check(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _reason(report)
            if allowed(reason) is None:
                self.refused.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._check(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._check(report)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.refused:
            return
        terminalreporter.section("skip policy", sep="=", red=True, bold=True)
        for nodeid, reason in self.refused:
            terminalreporter.line(f"error: {nodeid} skipped for {reason!r}")
        terminalreporter.line(
            "error: a test may skip only for a missing device (CUDA/MPS/GPU), optional extra "
            "or external binary (tests/skip_policy.py); make it run, or say which is missing"
        )

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.refused and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipPolicy(), "reprotrain-skip-policy")
