"""Run the host-dependent tests as if on every host of ``tests/hosts/`` (pytest plugin).

Why: a test that needs "another" CPU, capability, thread count, core count, machine or
Python version must derive it from the host. A constant passes on the machine it was
written on and fails on the first machine where the constant *is* the host's value: it
happened three times (issue 20: "AVX2" as the other capability on an AVX2 host; issue 35:
a named Xeon with AMX as the other CPU, on a Xeon with AMX). Every test marked
``host_facts`` (a module opts in with ``pytestmark = pytest.mark.host_facts``) runs once on
the real host and once as each identity in ``tests/hosts/*.json``: real CPUs captured by
``scripts/capture_host.py`` (natively, or under ``qemu-x86_64 -cpu ...``), or written from
documented CPUID facts (each file's ``how`` says which). So a constant that equals any of
those hosts' values fails here, on the development machine, not on the next user's.

Patched are the readers, never the tests' expectations: the ``cpuid`` instruction
(``repro.machine.cpuid_fields``), ``/proc/cpuinfo`` (``repro.machine.proc_cpuinfo``), torch's
capability, oneDNN's ISA and version, MKL's presence, version and CNR branch
(``repro.machine``), and ``torch.get_num_threads``, ``os.cpu_count``,
``os.sched_getaffinity``, ``platform.machine``, ``platform.python_version``,
``os.getuid``/``os.geteuid``. ``test_the_host_matrix`` checks that ``machine.capture_cpu``
then returns each identity exactly. Subprocesses see the real host (their tests compare runs
of one host with each other, which holds anywhere).
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

MARKER = "host_facts"
HOSTS_DIR = Path(__file__).resolve().parent / "hosts"


@dataclass(frozen=True)
class HostIdentity:
    """One host as the project reads it: its CPU (what ``machine.capture_cpu`` returns,
    and the raw ``cpuid`` and ``/proc/cpuinfo`` it comes from) and its other facts."""

    id: str
    how: str
    machine: str
    proc_cpuinfo: str
    cpuid: dict[str, Any] | None
    capture: dict[str, Any]
    cores: int
    threads: int
    python: str
    uid: int
    pins: dict[str, dict[str, str]]

    @property
    def capability(self) -> str:
        return self.capture["capability"]

    @classmethod
    def load(cls, path: Path) -> HostIdentity:
        d = json.loads(path.read_text())
        return cls(id=d["id"], how=d["how"], machine=d["machine"], proc_cpuinfo=d["proc_cpuinfo"],
                   cpuid=d["cpuid"], capture=d["capture"], pins=d.get("pins") or {},
                   **d["facts"])  # fmt: skip


def identities() -> tuple[HostIdentity, ...]:
    """Every identity of tests/hosts/, in name order."""
    return tuple(HostIdentity.load(p) for p in sorted(HOSTS_DIR.glob("*.json")))


HOSTS: tuple[HostIdentity, ...] = identities()


def apply(monkeypatch: pytest.MonkeyPatch, host: HostIdentity) -> None:
    """Make ``host`` the host: patch every reader listed in the module docstring."""
    import torch

    from reprotrain.repro import machine

    cap = host.capture
    monkeypatch.setattr(machine, "cpuid_fields", lambda: host.cpuid)
    monkeypatch.setattr(machine, "proc_cpuinfo", lambda: host.proc_cpuinfo)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cap["capability"])
    monkeypatch.setattr(machine, "onednn_isa", lambda: cap["onednn_isa"])
    monkeypatch.setattr(machine, "onednn_version", lambda: cap["onednn_version"])
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: cap["mkl_version"] is not None)
    monkeypatch.setattr(machine, "mkl_version", lambda: cap["mkl_version"])
    monkeypatch.setattr(machine, "mkl_cbwr_branch", lambda: cap["mkl_cbwr_branch"])
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
        f"{MARKER}: reads host facts (CPU identity, threads, cores, machine, python, uid); "
        "runs on the real host and as every identity of tests/hosts/",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker(MARKER) is None:
        return
    hosts = [None, *HOSTS]
    metafunc.parametrize(
        "faked_host", hosts, indirect=True, ids=[h.id if h else "real" for h in hosts]
    )


@pytest.fixture(autouse=True)
def faked_host(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The identity this test runs as (None: the real host; always so for unmarked tests)."""
    host = getattr(request, "param", None)
    if host is not None:
        apply(monkeypatch, host)
    return host
