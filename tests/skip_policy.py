"""A skipped promise fails the run (pytest plugin, loaded by conftest).

Why: a skip whose reason stopped being true hides an untested promise behind a green run
(issue 20: the submitit requeue test was skipped for a trainer feature that had shipped). A
test may skip only for what a machine can lack without anything being wrong with the code:
a device (CUDA, MPS, a GPU), an optional extra that is not installed, an external binary
(named in ``BINARIES``), or another CPU (a pinned hash measured on other CPU identities).
Any other skip reason is listed at the end of the run and the run exits 1 (xfail is not a
skip; deselection by ``-m`` is not either).

A test skipped for what an install brings (an optional extra, an external binary) is written
to ``--skipped-to FILE``: ``make test`` keeps that list, and ``make test-skipped`` (CI, after
it installs the extras and binaries) runs exactly those tests again, so the README's
``make test`` runs on a bare clone and nothing it skipped stays unrun in CI.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

#: External programs a test may need and a machine may not have.
BINARIES = (
    "actionlint",
    "chromium",  # the docs site's browser check (scripts/docs_browser_check.py)
    "docker",
    "podman",  # or docker with a daemon: the container tests (.ci/run installs it)
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


#: What an install can bring: these skips are run again once CI has installed it.
INSTALLABLE = ("an optional extra", "an external binary")


class SkipPolicy:
    def __init__(self, skipped_to: str | None = None) -> None:
        self.refused: list[tuple[str, str]] = []
        self.installable: list[str] = []
        self.skipped_to = skipped_to

    def _check(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = _reason(report)
            kind = allowed(reason)
            if kind is None:
                self.refused.append((report.nodeid, reason))
            elif kind in INSTALLABLE and report.nodeid not in self.installable:
                self.installable.append(report.nodeid)

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
        if self.skipped_to and not hasattr(session.config, "workerinput"):  # xdist: the lead
            path = Path(self.skipped_to)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(f"{n}\n" for n in sorted(self.installable)))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skipped-to",
        metavar="FILE",
        help="write the tests skipped for a missing extra or binary to FILE, one node id a "
        "line (rerun them with: pytest @FILE)",
    )


def pytest_configure(config: pytest.Config) -> None:
    policy = SkipPolicy(config.getoption("--skipped-to", None))
    config.pluginmanager.register(policy, "reprotrain-skip-policy")
