"""The CPU's identity for bits: recorded on CPU and GPU runs, compared by the one rule.

Two AVX-512 CPUs of two vendors trained one config to different bits (issue 24): a record
made on one CPU model and checked on another gets "bits not promised", never DIVERGED; a
portable pair ignores the CPU model but not the architecture, threads or software.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import host_facts
from conftest import MICRO, REPO, assert_ok, base_env
from fake_cuda import H100, gpu_env
from reprotrain.repro import comparability, environment, machine
from reprotrain.repro.comparability import differences, notes
from reprotrain.tools.reproduce import rerun

HOST_FACTS = pytest.mark.host_facts  # tests/host_facts.py: also run as on other hosts


def test_cpuinfo_gives_vendor_family_model_and_the_flags_kernels_dispatch_on():
    """Only dispatch flags: x86's smep/smx are not arm64's SME (a regex once took smep)."""
    for host in host_facts.HOSTS:  # each real /proc/cpuinfo block, and the written ones
        got = machine.cpuinfo_fields(host.proc_cpuinfo)
        want = {k: host.capture[k] for k in ("vendor", "family", "model", "model_name")}
        assert {k: got[k] for k in want} == want, host.id
        assert got["isa_flags"] == host.capture["isa_flags"], host.id
        assert not {"smep", "smx", "sse2", "avx"} & set(got["isa_flags"]), host.id


@pytest.fixture
def cpu_env() -> dict:
    return environment.capture(torch.device("cpu"))


#: Dispatch flags a CPU may have; "another" CPU gains the first one the host lacks.
KNOWN_FLAGS = sorted(set(machine.CPUID_FLAGS.values()))


def another_cpu(env: dict) -> dict:
    """``env`` as a run on another CPU model of the same vendor and capability would record
    it: derived from the host under test (its model number + 1, its name marked, one ISA
    flag more, or one fewer where it has them all), never a CPU named as a constant."""
    out = copy.deepcopy(env)
    cpu = out["cpu"]
    model = cpu.get("model") or "0"
    cpu["model"] = str(int(model) + 1) if model.isdigit() else f"{model}-other"
    cpu["model_name"] = cpu["name"] = f"{cpu.get('model_name') or 'CPU'} (another)"
    flags = list(cpu.get("isa_flags") or [])
    extra = next((f for f in KNOWN_FLAGS if f not in flags), None)
    cpu["isa_flags"] = sorted([*flags, extra]) if extra else flags[1:]
    return out


def flag_change(env: dict, other: dict) -> str:
    """The ISA line's change between ``env`` and ``another_cpu(env)``: ``+x`` or ``-x``."""
    a, b = set(env["cpu"]["isa_flags"]), set(other["cpu"]["isa_flags"])
    return f"+{min(b - a)}" if b - a else f"-{min(a - b)}"


@HOST_FACTS
def test_a_run_records_the_cpu_identity(cpu_env):
    cpu = cpu_env["cpu"]
    keys = ("vendor", "family", "model", "model_name", "isa_flags", "source", "capability",
            "onednn_isa", "mkl_version", "mkl_cbwr_branch", "onednn_version",
            "portable")  # fmt: skip
    for key in keys:
        assert key in cpu, key
    assert set(cpu["dispatch_env"]) == set(machine.DISPATCH_ENV_VARS)
    assert cpu["capability"] == torch.backends.cpu.get_cpu_capability()


@HOST_FACTS
def test_another_cpu_model_with_the_same_capability_promises_no_bits(cpu_env):
    other = another_cpu(cpu_env)
    got = differences(cpu_env, other)
    assert got[0] == f"CPU: {comparability.cpu_model(cpu_env)} -> {comparability.cpu_model(other)}"
    assert got[1] == f"cpu ISA extensions: {flag_change(cpu_env, other)}"
    assert len(got) == 2  # the capability, the libraries' paths and the threads are the same


@HOST_FACTS
def test_a_gpu_run_compares_the_cpu_identity_too(monkeypatch):
    """The data path (order, augmentation) runs on the CPU of a GPU run."""
    h100 = gpu_env(monkeypatch, model=H100)
    assert h100["cpu"]["vendor"] == machine.cpu_fields()["vendor"]
    assert any(line.startswith("CPU: ") for line in differences(h100, another_cpu(h100)))


@pytest.mark.parametrize(
    "label, path",
    [
        ("oneDNN ISA", ("onednn_isa",)),
        ("oneDNN enabled", ("mkldnn_enabled",)),
        ("MKL CNR branch", ("mkl_cbwr_branch",)),
        ("MKL", ("mkl_version",)),
        ("oneDNN", ("onednn_version",)),
        *((f"${n}", ("dispatch_env", n)) for n in machine.DISPATCH_ENV_VARS),
    ],
)
@HOST_FACTS
def test_each_dispatch_field_changes_the_verdict(cpu_env, label, path):
    other = copy.deepcopy(cpu_env)
    node = other["cpu"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = f"other than {node[path[-1]]}"  # derived: never the host's own value
    got = differences(cpu_env, other)
    assert [d for d in got if d.startswith(f"{label}: ")] == got and len(got) == 1, label


def portable(env: dict) -> dict:
    out = copy.deepcopy(env)
    out["cpu"].update(capability="AVX2", onednn_isa="Intel AVX2", mkl_cbwr_branch="COMPATIBLE",
                      portable=True)  # fmt: skip
    out["cpu"]["dispatch_env"].update(machine.PORTABLE_ENV)
    return out


@HOST_FACTS
def test_two_portable_runs_promise_bits_across_cpu_models_but_not_across_threads(cpu_env):
    here, xeon = portable(cpu_env), portable(another_cpu(cpu_env))
    assert differences(here, xeon) == []
    assert any(line.startswith("CPU: ") for line in notes(here, xeon))  # shown, not a reason
    fewer = {**xeon, "num_threads": here["num_threads"] + 1}
    assert differences(here, fewer) == [
        f"thread count: {here['num_threads']} -> {here['num_threads'] + 1}"
    ]
    other = "aarch64" if here["machine"] != "aarch64" else "x86_64"
    elsewhere = {**xeon, "machine": other}
    assert differences(here, elsewhere) == [f"machine: {here['machine']} -> {other}"]
    native = another_cpu(cpu_env)  # a strict run on the other CPU: its model counts again
    got = differences(here, native)
    assert "cpu dispatch: portable -> native" in got and any(g.startswith("CPU: ") for g in got)


@HOST_FACTS
def test_reproduce_sees_an_edited_cpu_identity_as_bits_not_promised(cpu_env):
    record = {"environment": cpu_env, "lock_sha256": "x"}
    blocking, _ = rerun.environment_differences(record, {**record})
    assert blocking == []
    other = another_cpu(cpu_env)
    blocking, _ = rerun.environment_differences({"environment": other, "lock_sha256": "x"}, record)
    assert blocking and blocking[0].startswith(f"CPU: {comparability.cpu_model(other)} -> ")


@HOST_FACTS
def test_cpu_key_is_what_the_rule_compares(cpu_env):
    key = comparability.cpu_key(cpu_env)
    assert key["thread count"] == str(cpu_env["num_threads"]) and "CPU" in key
    assert "CPU" not in comparability.cpu_key(portable(cpu_env))  # portable: not the model


# ----------------------------------------------------------------- end to end (slow tier)


def another_cpu_record(path: Path) -> str:
    """Rewrite a run.json as if its run had been made on another CPU model; its name."""
    record = json.loads(path.read_text())
    record["environment"] = another_cpu(record["environment"])
    path.write_text(json.dumps(record, indent=2))
    return comparability.cpu_model(record["environment"])


def run_tool(name: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"reprotrain.tools.{name}", *args], cwd=cwd,
                          env=base_env(), capture_output=True, text=True, timeout=600)  # fmt: skip


def archive_edited(src: Path, tmp_path: Path) -> tuple[Path, str]:
    """Archive ``src``, then unpack it, move every run.json to another CPU model, repack
    (manifest regenerated; replayed with --trust); the archive and that CPU model."""
    from test_archive import repack, unpack

    assert_ok(run_tool("archive.archive", str(src), "--out-dir", str(tmp_path / "archives")))
    (archive,) = (tmp_path / "archives").glob("*.tar.gz")
    top = unpack(archive, tmp_path / "unpacked")
    edited = sorted(top.rglob("run.json"))
    assert edited
    models = {another_cpu_record(path) for path in edited}
    assert len(models) == 1
    return repack(top, tmp_path / "edited.tar.gz"), models.pop()


@pytest.mark.slow
def test_a_run_archive_made_on_another_cpu_model_is_not_comparable_not_diverged(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "reprotrain.train", *MICRO, f"hydra.run.dir={run}"]
    assert_ok(subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True))
    archive, model = archive_edited(run, tmp_path)
    proc = run_tool("reproduce.reproduce", str(archive), "--trust", "--epochs", "1", "--runs-dir",
                    str(tmp_path / "rerun"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    verdict = proc.stdout.strip().splitlines()[-1]
    assert verdict.startswith("NOT COMPARABLE") and f"-> {model}" not in verdict
    assert "CPU: " in verdict and model in verdict


@pytest.mark.slow
def test_a_sweep_archive_made_on_another_cpu_model_goes_to_the_statistical_verdict(tmp_path):
    tiny = [*MICRO, "trainer.epochs=1", "trainer.limit_train_steps=2", "seed.base=0,1"]
    cmd = [sys.executable, "-m", "reprotrain.train", "--multirun", *tiny,
           f"hydra.sweep.dir={tmp_path / 's'}"]  # fmt: skip
    assert_ok(subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True))
    archive, model = archive_edited(tmp_path / "s", tmp_path)
    proc = run_tool("reproduce.reproduce", str(archive), "--trust", "--mode", "auto", "--metric",
                    "train_loss", "--runs-dir", str(tmp_path / "rerun"))  # fmt: skip
    report = json.loads(next((tmp_path / "rerun").glob("*/reproduction.json")).read_text())
    assert report["mode"] == "statistical", proc.stdout + proc.stderr
    assert any(f"CPU: {model} -> " in r for r in report["bits_not_promised"])
    assert "CONSISTENT" in proc.stdout and "DIVERGED" not in proc.stdout


GRAVITON_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid sve sve2 bf16 i8mm
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd4f
CPU revision\t: 1
"""


def test_an_arm64_cpu_is_known_by_implementer_part_and_features():
    got = machine.cpuinfo_fields(GRAVITON_CPUINFO)
    assert (got["vendor"], got["family"], got["model"]) == ("0x41", "8", "0xd4f")
    assert {"asimd", "sve", "sve2", "bf16", "i8mm"} <= set(got["isa_flags"])


def test_on_macos_the_brand_string_names_the_cpu(monkeypatch):
    import subprocess as sp

    answers = {"machdep.cpu.brand_string": "Apple M2 Pro", "hw.model": "Mac14,9"}

    def fake_run(cmd, **kw):
        return sp.CompletedProcess(cmd, 0, stdout=answers.get(cmd[-1], "") + "\n", stderr="")

    monkeypatch.setattr("platform.system", lambda: "Darwin")
    monkeypatch.setattr("platform.machine", lambda: "arm64")
    monkeypatch.setattr(sp, "run", fake_run)
    got = machine.cpuinfo_fields("")
    assert (got["vendor"], got["model_name"], got["model"]) == ("Apple", "Apple M2 Pro", "Mac14,9")
