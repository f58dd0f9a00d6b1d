"""repro=portable: CPU kernel dispatch pinned at interpreter start, read back, or refused.

The pinned hash that proves the same bits on Intel and AMD is in
tests/starter/test_reference_job.py (it trains the reference job).
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, base_env
from reprotrain.errors import ReprotrainError
from reprotrain.repro import determinism, hashseed, machine

X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_portable_is_refused_off_x86_64_and_without_avx2():
    assert "this host is aarch64" in hashseed.portable_problem({}, "aarch64", None)
    assert "this host is arm64" in hashseed.portable_problem({}, "arm64", None)
    assert "needs a CPU with AVX2" in hashseed.portable_problem({}, "x86_64", {"sse4_2"})
    assert hashseed.portable_problem({}, "x86_64", {"avx2"}) is None
    assert hashseed.portable_problem({}, "x86_64", None) is None  # not Linux: torch checks


@pytest.mark.parametrize(
    "env, named",
    [
        ({"MKL_CBWR": "AVX2"}, "your environment has MKL_CBWR=AVX2"),
        ({"ATEN_CPU_CAPABILITY": "avx512"}, "ATEN_CPU_CAPABILITY=avx512"),
        ({"DNNL_MAX_CPU_ISA": "AVX512_CORE"}, "DNNL_MAX_CPU_ISA=AVX512_CORE"),
        ({"MKL_ENABLE_INSTRUCTIONS": "AVX512"}, "MKL_ENABLE_INSTRUCTIONS=AVX512"),
    ],
)
def test_a_users_own_dispatch_variable_is_refused_under_portable(env, named):
    problem = hashseed.portable_problem(env, "x86_64", {"avx2"})
    assert named in problem and "unset it" in problem


def test_a_multirun_cannot_mix_portable_with_another_level():
    with pytest.raises(ReprotrainError, match="cannot mix repro=portable"):
        hashseed.ensure_cpu_dispatch(["strict", "portable"])
    hashseed.ensure_cpu_dispatch(["strict", "fast"])  # no portable: nothing to do


def test_portable_is_refused_in_a_process_whose_dispatch_is_not_pinned(monkeypatch):
    """This pytest process loaded torch without the levers: applying portable here would
    promise what the libraries do not do."""
    for name in machine.PORTABLE_ENV:
        monkeypatch.delenv(name, raising=False)
    before = determinism.effective_flags("strict")
    with pytest.raises(ReprotrainError, match="CPU dispatch is not pinned"):
        determinism.apply("portable", 2)
    assert determinism.effective_flags("strict") == before  # refused before changing a flag


def probe(env: dict, code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.skipif(not X86, reason="repro=portable covers x86-64")
def test_the_libraries_read_the_portable_levers_back():
    """What torch, MKL and oneDNN report, not what was meant: capability AVX2, MKL's CNR
    branch COMPATIBLE, oneDNN's ISA AVX2; and the record calls it portable."""
    code = (
        "from reprotrain.repro import machine as c; i = c.capture_cpu(); "
        "print(i['capability'], i['mkl_cbwr_branch'], i['onednn_isa'], i['portable'])"
    )
    assert probe(base_env(**machine.PORTABLE_ENV), code) == "AVX2 COMPATIBLE Intel AVX2 True"
    assert probe(base_env(), code).endswith("False")


@pytest.mark.skipif(not X86, reason="repro=portable covers x86-64")
def test_the_entry_point_refuses_portable_with_a_users_mkl_branch_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "reprotrain.train", "experiment=smoke", "repro=portable",
           f"hydra.run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(MKL_CBWR="AVX2"), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: repro=portable sets MKL_CBWR=COMPATIBLE; your environment has MKL_CBWR=AVX2: "
        "unset it"
    ]
    assert not run_dir.exists()


@pytest.mark.skipif(not X86, reason="repro=portable covers x86-64")
def test_mkls_avx2_branch_holds_on_intel_only_so_portable_uses_compatible():
    """MKL honours MKL_CBWR=AVX2 on an Intel CPU; elsewhere it reads it back as AUTO
    (measured: an AMD EPYC), which is why the AVX2 row's bits differ across vendors."""
    from reprotrain.repro import machine

    vendor = machine.cpuinfo_fields()["vendor"]
    code = "from reprotrain.repro import machine as c; print(c.mkl_cbwr_branch())"
    got = probe(base_env(MKL_CBWR="AVX2"), code)
    assert got == ("AVX2" if vendor == "GenuineIntel" else "AUTO")
    assert probe(base_env(MKL_CBWR="COMPATIBLE"), code) == "COMPATIBLE"


@pytest.mark.slow
@pytest.mark.skipif(not X86, reason="repro=portable covers x86-64")
def test_a_portable_archive_reproduces_bitwise_its_replay_sets_the_levers_again(tmp_path):
    import json

    from conftest import MICRO, assert_ok

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "reprotrain.train", *MICRO, "trainer.epochs=1",
           "repro=portable", f"hydra.run.dir={run}"]  # fmt: skip
    assert_ok(subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True))

    def tool(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=base_env(),
                              capture_output=True, text=True, timeout=600)  # fmt: skip

    assert_ok(tool("reprotrain.tools.archive.archive", str(run), "--out-dir", str(tmp_path / "a")))
    (archive,) = (tmp_path / "a").glob("*.tar.gz")
    proc = tool("reprotrain.tools.reproduce.reproduce", str(archive), "--trust", "--runs-dir",
                str(tmp_path / "rerun"))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("REPRODUCED (bitwise)")
    (rerun,) = (tmp_path / "rerun").glob("*/run.json")
    record = json.loads(rerun.read_text())
    assert record["repro"]["level"] == "portable" and record["environment"]["cpu"]["portable"]


# ------------------------------------------------- the probe (scripts/portable_probe.py)


def test_the_machine_identity_and_the_portable_refusal_load_without_torch():
    """repro=portable's refusal reads the CPU's flags (``machine.cpu_flags``) before torch
    and numpy load (a CPU without AVX2 cannot import them): the machine module, which also
    holds the torch read-backs, imports them only inside the functions that use them."""
    code = (
        "import sys; from reprotrain.repro import hashseed, machine; machine.cpu_flags(); "
        "print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    )
    run = [sys.executable, "-c", code]
    out = subprocess.run(run, capture_output=True, text=True, env=base_env(), timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def portable_probe():
    """scripts/portable_probe.py as a module (it is a template script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "portable_probe", REPO / "scripts" / "portable_probe.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # the claim natively: test_reference_job.py::test_portable_micro_smoke_bits_...
def test_the_portable_probe_on_this_cpu_gives_the_pinned_hash():
    """The claim on whatever CPU runs the suite (Intel or AMD, AVX2 or AVX-512): the probe's
    every gradient, loss and weight under the portable levers equals the pin."""
    if not X86 or "avx2" not in (machine.cpu_flags() or {"avx2"}):
        pytest.skip("repro=portable covers x86-64 CPUs with AVX2")
    probe = portable_probe()
    row = probe.run_one(None, timeout=300)
    assert "error" not in row, row
    assert (row["portable"], row["capability"], row["mkl_cbwr_branch"]) == (
        True,
        "AVX2",
        "COMPATIBLE",
    )
    assert row["sha256"] == probe.PINNED["x86_64"]


@pytest.mark.slow
@pytest.mark.skipif(not shutil.which("qemu-x86_64"), reason="qemu-x86_64 not on PATH")
def test_the_portable_probe_holds_on_emulated_intel_and_amd_avx2_cpus(tmp_path):
    """`make portable-probe`: natively, as an Intel Haswell and an AMD EPYC Rome (AVX2 only;
    their own cpuid, not this host's), the pinned hash; a Nehalem is refused in one line."""
    out = tmp_path / "probe.json"
    cmd = [sys.executable, "scripts/portable_probe.py", "--cpus", "Haswell-v4,EPYC-Rome-v2",
           "--refuse", "Nehalem", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    pinned = portable_probe().PINNED["x86_64"]
    probes = result["probes"]
    assert set(probes) == {"native", "Haswell-v4", "EPYC-Rome-v2"}
    assert {p["sha256"] for p in probes.values()} == {pinned}
    assert (
        "Haswell" in probes["Haswell-v4"]["cpu"] and "GenuineIntel" in probes["Haswell-v4"]["cpu"]
    )
    assert (
        "EPYC-Rome" in probes["EPYC-Rome-v2"]["cpu"]
        and "AuthenticAMD" in probes["EPYC-Rome-v2"]["cpu"]
    )
    assert [r["refused_in_one_line"] for r in result["refusals"]] == [True]
