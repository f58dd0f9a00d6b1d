"""Run the host-dependent tests as if on other hosts (pytest plugin, loaded by conftest).

Why: a test that needs "another" CPU capability, thread count, core count, machine or Python
version must derive it from the host. A constant passes on the machine it was written on and
fails on the first machine where the constant *is* the host's value (issue 20: "AVX2" as the
other capability, on an AVX2 host). Every test marked ``host_facts`` (a module opts in with
``pytestmark = pytest.mark.host_facts``) runs once on the real host and once per fake host
below whose capability differs from the real one, with the facts the framework reads patched
in-process. So a constant that equals one of the fakes' values fails here, on the
development machine, not on the next user's.

Patched: ``torch.backends.cpu.get_cpu_capability``, ``torch.get_num_threads``,
``os.cpu_count``, ``os.sched_getaffinity``, ``platform.machine``,
``platform.python_version``, ``os.getuid``/``os.geteuid``. Subprocesses see the real host
(their tests compare runs of one host with each other, which holds anywhere).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import pytest

MARKER = "host_facts"


@dataclass(frozen=True)
class FakeHost:
    """The facts a host-dependent test may read, as another machine would report them."""

    capability: str
    machine: str
    cores: int
    threads: int
    python: str
    uid: int

    @property
    def id(self) -> str:
        return f"fake-{self.capability}"


#: Every capability torch reports on the CPUs the template runs on, with other facts varied
#: too (one core, many cores, root, a newer Python) so no constant can match every host.
FAKE_HOSTS: tuple[FakeHost, ...] = (
    FakeHost("DEFAULT", "x86_64", 1, 1, "3.13.2", 0),
    FakeHost("AVX2", "x86_64", 2, 2, "3.12.3", 1000),
    FakeHost("AVX512", "x86_64", 4, 3, "3.11.4", 1001),
    FakeHost("SVE256", "aarch64", 64, 16, "3.11.7", 4242),
)


def fakes_for_this_host() -> list[FakeHost]:
    """The fake hosts whose capability differs from the real one (the real one runs anyway)."""
    import torch  # here, not at import: a run without host_facts tests never needs it

    real = torch.backends.cpu.get_cpu_capability()
    return [f for f in FAKE_HOSTS if f.capability != real]


def apply(monkeypatch: pytest.MonkeyPatch, host: FakeHost) -> None:
    """Patch every host fact listed in the module docstring to ``host``'s value."""
    import torch

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: host.capability)
    monkeypatch.setattr(torch, "get_num_threads", lambda: host.threads)
    monkeypatch.setattr(os, "cpu_count", lambda: host.cores)
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(host.cores)))
    monkeypatch.setattr(platform, "machine", lambda: host.machine)
    monkeypatch.setattr(platform, "python_version", lambda: host.python)
    for name in ("getuid", "geteuid"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, lambda: host.uid)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}: reads host facts (CPU capability, threads, cores, machine, python, uid); "
        "runs on the real host and on every fake host of tests/host_facts.py",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker(MARKER) is None:
        return
    hosts = [None, *fakes_for_this_host()]
    metafunc.parametrize(
        "faked_host", hosts, indirect=True, ids=[h.id if h else "real" for h in hosts]
    )


@pytest.fixture(autouse=True)
def faked_host(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The fake host this test runs on (None: the real one; always so for unmarked tests)."""
    host = getattr(request, "param", None)
    if host is not None:
        apply(monkeypatch, host)
    return host
