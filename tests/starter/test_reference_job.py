"""The user's room (src/starter): the reference job's models, configs and smoke run.

These are the only tests that import the user's package or train its job; the framework's
tests run its own self-check job (src/reprotrain/selfcheck). A project that replaces the
reference job replaces these tests with its own.
"""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn

import host_facts
from conftest import REPO, assert_ok, run_json, train
from reprotrain.config import register_configs
from starter.resnet import CifarResNet


def test_resnet18_has_the_cifar_parameter_count():
    model = CifarResNet([64, 128, 256, 512], [2, 2, 2, 2], 10)
    assert sum(p.numel() for p in model.parameters()) == 11_173_962
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_reference_models_use_only_modules_with_deterministic_cuda_kernels():
    """As the framework's own net (test_determinism.py): no module whose CUDA kernel raises
    under use_deterministic_algorithms (AdaptiveAvgPool2d's backward and the like)."""
    from torchvision.models.resnet import BasicBlock

    allowed = (CifarResNet, BasicBlock, nn.Sequential, nn.Conv2d, nn.BatchNorm2d, nn.ReLU)
    allowed += (nn.Linear,)
    for widths, blocks in (([64, 128, 256, 512], [2, 2, 2, 2]), ([16, 32, 64], [1, 1, 1])):
        for name, module in CifarResNet(widths, blocks).named_modules():
            assert isinstance(module, allowed), f"{name}: {type(module).__name__}"


def test_the_user_configs_point_into_the_users_package():
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train")
        smoke = compose("train", overrides=["experiment=smoke"])
    assert cfg.dataset._target_ == "starter.cifar10.CIFAR10"
    assert cfg.model._target_ == "starter.resnet.CifarResNet"
    assert list(cfg.model.blocks) == [2, 2, 2, 2]
    assert smoke.dataset._target_ == "starter.synthetic.Synthetic"
    assert list(smoke.model.blocks) == [1, 1, 1]


def test_cifar10_without_data_or_network_says_where_to_put_it(tmp_path):
    run_dir = tmp_path / "run"
    # Port 9 on loopback refuses at once: the same code path as no network, without a wait.
    proc = train(
        run_dir,
        "dataset=cifar10",
        f"dataset.root={tmp_path / 'data'}",
        "dataset.url=http://127.0.0.1:9/cifar-10-python.tar.gz",
        micro=False,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cifar-10-python.tar.gz" in lines[0]
    assert "experiment=smoke" in lines[0] and "Traceback" not in proc.stderr
    record = run_json(run_dir)
    assert record["status"] == "failed" and "experiment=smoke" in record["error"]


def test_smoke_experiment_learns(tmp_path):
    """The acceptance run itself: full smoke config, at least 50% against 10% chance."""
    proc = train(tmp_path / "smoke", "experiment=smoke", micro=False)
    assert_ok(proc)
    record = run_json(tmp_path / "smoke")
    assert record["final_metrics"]["test_acc"] >= 0.5
    assert record["environment"]["torch"] == torch.__version__


def test_smoke_bits_are_the_same_in_the_template_and_a_new_project(tmp_path):
    """Same config, same bits in any project: no seed or hash depends on a package name.
    A short smoke run here and in a fresh `make new-project` copy (package renamed)."""
    import json
    import subprocess
    import sys

    from conftest import base_env

    dest = tmp_path / "mylab"
    made = subprocess.run(
        [sys.executable, str(REPO / "src/reprotrain/tools/template/new_project.py"), "mylab",
         str(dest)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert_ok(made)
    tiny = ["experiment=smoke", "dataset.num_train=256", "dataset.num_test=128",
            "trainer.batch_size=64", "trainer.epochs=1", "logger=none"]  # fmt: skip
    hashes = []
    for name, root in (("template", REPO), ("project", dest)):
        run_dir = tmp_path / name
        proc = subprocess.run(
            [sys.executable, "-m", "reprotrain.train", *tiny, f"hydra.run.dir={run_dir}"],
            cwd=root, env=base_env(PYTHONPATH=str(root / "src")), capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert_ok(proc)
        record = json.loads((run_dir / "run.json").read_text())
        assert record["components"]["model"].startswith("mylab." if root == dest else "starter.")
        hashes.append(record["final_weights_sha256"])
    assert hashes[0] == hashes[1]


# --- the pinned bits ---------------------------------------------------------------------
# What decides a run's CPU bits is what the comparability rule compares for it
# (repro/comparability.py: cpu_key). Under strict: the CPU's whole identity (vendor, model,
# ISA extensions, the paths torch/oneDNN/MKL chose, library versions, dispatch variables)
# and the thread count. The values live with the identities they were measured on
# (tests/hosts/<id>.json, "pins": {config: {threads: hash}}), keyed by that identity's own
# cpu_key; any other identity has no value: the test skips and names the nearest one and
# how it differs. Under portable: only the architecture and the thread count, so the
# portable value must hold on every x86-64 machine with AVX2.


def pins(config: str) -> list[tuple[dict[str, str], str]]:
    """[(CPU identity key, final_weights_sha256)] of ``config`` on every host measured."""
    from reprotrain.repro import comparability

    out = []
    for host in host_facts.HOSTS:
        for threads, value in (host.pins.get(config) or {}).items():
            env = {"machine": host.machine, "num_threads": int(threads), "cpu": host.capture}
            out.append((comparability.cpu_key(env), value))
    return out


#: final_weights_sha256 under repro=portable by (architecture, threads): measured the same on
#: an AMD EPYC (Zen 4, family 25 model 17; Zen 5, family 26 model 2) and an Intel Xeon with
#: AMX (issue 24).
PORTABLE_MICRO = {("x86_64", 2): "d77712ccd167e867606a46730798959e864cae5a22748de4f1ffd71e8425591c"}
MICRO_OVERRIDES = (
    "experiment=smoke", "dataset.num_train=576", "dataset.num_test=256",
    "trainer.batch_size=64", "trainer.epochs=2", "trainer.microbatch_size=64",
    "logger=none", "repro.num_threads=2",
)  # fmt: skip


def host_cpu_key(threads: int) -> dict[str, str]:
    """This host's key as a strict run here would record it (read before training, so a
    host without a value skips without spending the run)."""
    from reprotrain.repro import comparability, environment

    env = environment.capture(torch.device("cpu"))
    return comparability.cpu_key({**env, "num_threads": threads})


def pinned(table: list, key: dict[str, str]) -> str:
    """The hash pinned for this CPU identity; a host the table has no value for skips."""
    for identity, value in table:
        if identity == key:
            return value
    shown = ", ".join(f"{k}={key[k]}" for k in ("CPU", "cpu capability", "oneDNN ISA"))
    nearest = min((identity for identity, _ in table), key=lambda i: _distance(i, key))
    differ = "; ".join(f"{k}: {nearest.get(k)} here {key.get(k)}" for k in _differing(nearest, key))
    pytest.skip(f"no pinned strict hash for this CPU identity ({shown}, {key['thread count']} "
                f"threads; the nearest pinned one differs in {differ}); repro=portable's pin "
                "holds here")  # fmt: skip


def _differing(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _distance(a: dict, b: dict) -> int:
    return len(_differing(a, b))


def test_micro_smoke_bits_are_pinned_and_one_microbatch_keeps_them(tmp_path):
    from reprotrain.repro import comparability

    key = host_cpu_key(2)
    expected = pinned(pins("micro_smoke_strict"), key)
    whole = tmp_path / "whole"
    assert_ok(train(whole, *MICRO_OVERRIDES, micro=False))
    record = run_json(whole)
    assert comparability.cpu_key(record["environment"]) == key
    assert record["final_weights_sha256"] == expected


def test_portable_micro_smoke_bits_are_the_pinned_ones_on_every_x86_64_cpu(tmp_path):
    """repro=portable: one value for Intel and AMD, AVX2 or AVX-512 (issue 24's table)."""
    import platform

    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        pytest.skip(f"repro=portable covers x86-64; this host is {machine}")
    run = tmp_path / "portable"
    assert_ok(train(run, *MICRO_OVERRIDES, "repro=portable", micro=False))
    record = run_json(run)
    env = record["environment"]
    assert record["repro"]["level"] == "portable" and env["cpu"]["portable"] is True
    levers = ("capability", "mkl_cbwr_branch", "onednn_isa")  # as the libraries read them back
    assert tuple(env["cpu"][k] for k in levers) == ("AVX2", "COMPATIBLE", "Intel AVX2")
    key = ("x86_64", record["repro"]["num_threads"])
    assert record["final_weights_sha256"] == PORTABLE_MICRO[key]


@pytest.mark.slow
def test_smoke_run_bits_are_pinned(tmp_path):
    expected = pinned(pins("smoke_strict"), host_cpu_key(2))
    run = tmp_path / "smoke"
    assert_ok(train(run, "experiment=smoke", "logger=none", "repro.num_threads=2", micro=False,
                    timeout=900))  # fmt: skip
    record = run_json(run)
    assert record["final_weights_sha256"] == expected
    assert record["final_metrics"]["test_acc"] == 0.8974609375


MEASURED = [h for h in host_facts.HOSTS if h.pins]


@pytest.mark.parametrize("host", MEASURED, ids=[h.id for h in MEASURED])
def test_each_measured_host_finds_its_own_pins_by_its_full_identity(monkeypatch, host):
    """The key a strict run on that host records is the key its pins are filed under (the
    Intel Xeon with AMX: 5f5ecbeb… for the micro smoke at 2 threads)."""
    host_facts.apply(monkeypatch, host)
    key = host_cpu_key(2)
    for config, by_threads in host.pins.items():
        assert pinned(pins(config), key) == by_threads["2"], (host.id, config)
    others = [h for h in MEASURED if h.capture != host.capture]
    assert all(pins_key(h) != key for h in others)  # no pin answers for another identity


def pins_key(host) -> dict[str, str]:
    from reprotrain.repro import comparability

    return comparability.cpu_key({"machine": host.machine, "num_threads": 2, "cpu": host.capture})
