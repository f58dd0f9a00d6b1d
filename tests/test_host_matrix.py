"""The host matrix (tests/hosts/, tests/host_facts.py) and the CPU identity's sources.

Each identity must be exactly what the project reads on that host once the fixture has made
it the host: otherwise a host-fact test would run "as" an Intel Xeon while reading the AMD
it runs on. The identity prefers the ``cpuid`` instruction to ``/proc/cpuinfo``, which an
emulator (qemu-user shows the host's file) or a mounted file can make another CPU's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

import host_facts
from conftest import REPO, base_env
from reprotrain.repro import comparability, hashseed, machine


@pytest.mark.parametrize("host", host_facts.HOSTS, ids=[h.id for h in host_facts.HOSTS])
def test_each_identity_becomes_exactly_what_the_project_reads(monkeypatch, host):
    host_facts.apply(monkeypatch, host)
    assert machine.capture_cpu() == host.capture
    assert machine.cpu_fields()["source"] == ("cpuid" if host.cpuid else "/proc/cpuinfo")
    flags = machine.cpu_flags()  # what repro=portable's refusal reads, before torch loads
    if host.machine == "x86_64":
        assert ("avx2" in flags) == ("avx2" in host.capture["isa_flags"])
    else:  # no x86 flags line: portable refuses on the architecture first
        assert flags is None and "x86-64" in hashseed.portable_problem({}, host.machine, flags)


def test_the_matrix_holds_the_cpus_the_template_meets():
    """At least: this kind of AMD, an Intel with AMX, an AVX2-only CPU, an AVX-512 CPU
    without AMX, and another architecture; each file says how it was obtained."""
    caps = [h.capture for h in host_facts.HOSTS]
    assert any(c["vendor"] == "AuthenticAMD" and "avx512f" in c["isa_flags"] for c in caps)
    assert any(c["vendor"] == "GenuineIntel" and "amx_tile" in c["isa_flags"] for c in caps)
    assert any(c["capability"] == "AVX2" and "avx512f" not in c["isa_flags"] for c in caps)
    assert any("avx512f" in c["isa_flags"] and "amx_tile" not in c["isa_flags"] for c in caps)
    assert {h.machine for h in host_facts.HOSTS} >= {"x86_64", "aarch64"}
    models = {comparability.cpu_model({"cpu": c}) for c in caps}
    assert len(models) == len(caps)  # no two files are the same CPU
    for host in host_facts.HOSTS:
        assert any(w in host.how for w in ("captured", "written from")), host.id


def test_cpuid_and_proc_cpuinfo_agree_on_a_real_host():
    """What lets a record read from ``cpuid`` compare with one read from /proc/cpuinfo:
    on a real (not emulated) Linux host both give the same identity."""
    fields = machine.cpuid_fields()
    if fields is None:  # not x86-64 Linux, or executable memory refused: the fallback
        assert machine.cpu_fields()["source"] == "/proc/cpuinfo"
        return
    assert fields == machine.cpuinfo_fields()


def signature(family: int, model: int, stepping: int) -> int:
    """CPUID leaf 1 eax for a displayed family/model/stepping (the vendors' encoding)."""
    base = min(family, 0xF)
    ext_family = family - 0xF if family >= 0xF else 0
    return (ext_family << 20) | ((model >> 4) << 16) | (base << 8) | ((model & 0xF) << 4) | stepping


def registers_of(vendor: str, sig: int, brand: str, **bits: tuple[int, int, str, int]):
    """A register reader for a documented CPU: ``bits`` are FLAGS keys to set."""
    import struct

    words = struct.unpack("<III", vendor.encode())
    raw = brand.encode().ljust(48, b"\0")
    table = {
        (0, 0): {"eax": 7, "ebx": words[0], "edx": words[1], "ecx": words[2]},
        (1, 0): {"eax": sig, "ebx": 0, "ecx": 0, "edx": 0},
        (7, 0): {"eax": 1, "ebx": 0, "ecx": 0, "edx": 0},
        (7, 1): {"eax": 0, "ebx": 0, "ecx": 0, "edx": 0},
        (0x80000000, 0): {"eax": 0x80000004, "ebx": 0, "ecx": 0, "edx": 0},
    }
    for i, leaf in enumerate((0x80000002, 0x80000003, 0x80000004)):
        a, b, c, d = struct.unpack("<IIII", raw[16 * i : 16 * i + 16])
        table[(leaf, 0)] = {"eax": a, "ebx": b, "ecx": c, "edx": d}
    for leaf, subleaf, reg, bit in bits.values():
        table[(leaf, subleaf)][reg] |= 1 << bit
    return lambda leaf, subleaf: table[(leaf, subleaf)]


def test_cpuid_decodes_family_model_and_flags_as_the_kernel_prints_them():
    """The extended family (AMD Zen: base 0xF) and extended model (Intel family 6) count."""
    flag = {name: key for key, name in machine.CPUID_FLAGS.items()}
    zen4 = registers_of("AuthenticAMD", signature(25, 17, 1), "AMD EPYC Test Processor",
                        a=flag["avx2"], b=flag["avx512f"], c=flag["avx512_bf16"])  # fmt: skip
    got = machine.decode_cpuid(zen4)
    assert (got["vendor"], got["family"], got["model"], got["stepping"]) == (
        "AuthenticAMD", "25", "17", "1",
    )  # fmt: skip
    assert got["model_name"] == "AMD EPYC Test Processor"
    assert got["isa_flags"] == ["avx2", "avx512_bf16", "avx512f"]
    registers = registers_of(
        "GenuineIntel", signature(6, 60, 3), "Intel Haswell", a=flag["fma"], b=flag["avx2"]
    )
    haswell = machine.decode_cpuid(registers)
    assert (haswell["family"], haswell["model"]) == ("6", "60")
    assert haswell["isa_flags"] == ["avx2", "fma"]


def test_every_flag_cpuid_knows_is_one_the_identity_records():
    assert all(machine.X86_DISPATCH_FLAGS.match(name) for name in machine.CPUID_FLAGS.values())


@pytest.mark.slow  # its unit: test_each_identity_becomes_exactly_what_the_project_reads (cpu_flags)
@pytest.mark.skipif(not shutil.which("qemu-x86_64"), reason="qemu-x86_64 not on PATH")
def test_portable_on_an_emulated_cpu_without_avx2_is_refused_in_one_line(tmp_path):
    """A Nehalem (SSE4.2, no AVX2) cannot even import numpy: the refusal comes first, from
    the emulated CPU's own ``cpuid`` (/proc/cpuinfo would be this host's)."""
    run = tmp_path / "run"
    cmd = ["qemu-x86_64", "-cpu", "Nehalem", sys.executable, "-m", "reprotrain.train",
           "experiment=selfcheck", "repro=portable", "logger=none",
           f"hydra.run.dir={run}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    lines = [ln for ln in proc.stderr.splitlines() if "TCG doesn't support" not in ln]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert lines == [
        "error: repro=portable needs a CPU with AVX2; this one has none (use repro=strict)"
    ]
    assert not run.exists()
