"""Hydra launcher presets (conf/hydra/launcher/) and what launched jobs rely on.

The sweeps run the real trainer through each launcher, as ``make sweep ... hydra/launcher=X``
does: 50-80 s each on 2 loaded cores (mostly starting fresh interpreters), hence ``slow``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conftest import MICRO, REPO, assert_ok, base_env, run_json
from reprotrain import launchers
from reprotrain.config import register_configs

CONF = REPO / "conf"
# One thread per job: both jobs run at once, and 2 jobs x 2 threads on 2 cores made each
# epoch ~10x slower here (50 s instead of 4.8 s: OpenMP threads wait on each other).
SWEEP = [o for o in MICRO if not o.startswith("trainer.epochs")] + [
    "trainer.epochs=1",
    "repro.num_threads=1",
]


def compose_hydra(config_dir: Path, *overrides: str):
    register_configs()
    launchers.quiet_preset_schema_warning()  # pytest resets warning filters per test
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return compose("train", overrides=list(overrides), return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def sweep(sweep_dir: Path, launcher: str, *extra: str, env: dict | None = None):
    cmd = [
        sys.executable,
        "-m",
        "reprotrain.train",
        "--multirun",
        "seed.base=0,1",
        *SWEEP,
        f"hydra/launcher={launcher}",
        f"hydra.sweep.dir={sweep_dir}",
        *extra,
    ]
    return subprocess.run(
        cmd, cwd=REPO, env=env or base_env(), capture_output=True, text=True, timeout=900
    )


def assert_two_completed_runs_and_a_summary(sweep_dir: Path) -> list[dict]:
    records = [run_json(sweep_dir / str(j)) for j in (0, 1)]
    assert [r["status"] for r in records] == ["completed", "completed"]
    assert sorted(r["seeds"]["base"] for r in records) == [0, 1]
    assert {Path(r["run_dir"]) for r in records} == {
        (sweep_dir / "0").resolve(),
        (sweep_dir / "1").resolve(),
    }
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert len(summary["runs"]) == 2 and summary["metrics"]["test_acc"]["n"] == 2
    return records


@pytest.mark.parametrize(
    ("name", "target", "key", "value"),
    [
        ("joblib", "JoblibLauncher", "n_jobs", 2),
        ("submitit_local", "LocalLauncher", "tasks_per_node", 1),
        ("submitit_slurm", "SlurmLauncher", "signal_delay_s", 120),
    ],
)
def test_each_preset_is_selected_by_the_plugin_name_and_extends_its_schema(
    name, target, key, value
):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launchers.quiet_preset_schema_warning()
        cfg = compose_hydra(CONF, f"hydra/launcher={name}")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith(target)
    assert launcher[key] == value
    # keys the preset leaves out still come from the plugin's schema
    assert "submitit_folder" in launcher or "pre_dispatch" in launcher
    assert not [w for w in caught if "validated against ConfigStore schema" in str(w.message)]


def test_a_misspelt_key_in_a_preset_fails_at_compose_time(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    with (conf / "hydra" / "launcher" / "joblib.yaml").open("a") as f:
        f.write("n_jobz: 3\n")
    with pytest.raises(ConfigCompositionException, match="hydra/launcher/joblib"):
        compose_hydra(conf, "hydra/launcher=joblib")


def test_cores_per_job_splits_the_cores_among_parallel_jobs(monkeypatch):
    monkeypatch.setattr(launchers, "available_cores", lambda: 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    launcher = {"node": None}
    monkeypatch.setattr(launchers, "_hydra_launcher", lambda: launcher["node"])
    assert launchers.cores_per_job() == 8  # basic launcher, no torchrun
    assert launchers.cores_per_job(2) == 2  # capped
    launcher["node"] = OmegaConf.create({"n_jobs": 3})
    assert launchers.cores_per_job() == 2  # 3 jobs x 2 threads <= 8
    launcher["node"] = OmegaConf.create({"n_jobs": -1})  # joblib: one job per core
    assert launchers.cores_per_job() == 1
    launcher["node"] = OmegaConf.create({"timeout_min": 60})  # submitit: one job here
    assert launchers.cores_per_job() == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun ranks on this node win
    assert launchers.cores_per_job() == 2


def test_cores_per_job_resolves_inside_a_config(monkeypatch):
    monkeypatch.setattr(launchers, "available_cores", lambda: 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    launchers.register_resolvers()
    cfg = OmegaConf.create({"repro": {"num_threads": "${cores_per_job:}"}})
    assert OmegaConf.to_container(cfg, resolve=True) == {"repro": {"num_threads": 3}}


def test_inside_submitit_resume_defaults_to_auto_and_elsewhere_stays(monkeypatch):
    monkeypatch.delenv("SUBMITIT_FOLDER", raising=False)
    assert launchers.default_resume(None) is None
    monkeypatch.setenv("SUBMITIT_FOLDER", "/x/.submitit/1")
    assert launchers.default_resume(None) == "auto"
    assert launchers.default_resume("/x/ckpt.pt") == "/x/ckpt.pt"


def test_a_requeued_submitit_job_reruns_in_the_same_job_dir(tmp_path):
    """Plumbing only (no trainer): SIGUSR2 -> submitit requeues -> same overrides, same dir,
    even though the sweep dir is built from ${now:}."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "requeue_probe.py"),
            "--multirun",
            "--config-dir",
            str(CONF),
            "x=0,1",
            "hydra/launcher=submitit_local",
            f"hydra.sweep.dir={tmp_path}/" + "${now:%H-%M-%S-%f}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_ok(proc)
    found = sorted(tmp_path.glob("*/*/incarnations.txt"))
    assert len(found) == 2, found  # one directory per job, no second sweep dir
    for job, path in enumerate(found):
        lines = path.read_text().splitlines()
        assert len(lines) == 2, lines  # first run, then the requeued run
        pids = {line.split()[0] for line in lines}
        assert len(pids) == 2 and all(f"x={job} {path.parent}" in line for line in lines)


@pytest.mark.slow
def test_submitit_local_sweep_gives_two_completed_runs_and_a_summary(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, "submitit_local")
    assert_ok(proc)
    assert_two_completed_runs_and_a_summary(sweep_dir)
    assert list((sweep_dir / ".submitit").glob("*/*_log.out"))  # ran as submitit jobs


@pytest.mark.slow
def test_joblib_sweep_gives_two_completed_runs_and_a_summary(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, "joblib")
    assert_ok(proc)
    assert_two_completed_runs_and_a_summary(sweep_dir)


def test_the_cores_per_job_resolver_is_registered_by_preflight():
    from reprotrain import preflight

    preflight.register_resolvers()
    assert OmegaConf.has_resolver("cores_per_job")


@pytest.mark.slow
def test_joblib_jobs_times_threads_fit_the_cores_and_are_recorded(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, "joblib", "repro.num_threads=${cores_per_job:}")
    assert_ok(proc)
    expected = max(1, launchers.available_cores() // 2)  # preset n_jobs: 2
    for r in assert_two_completed_runs_and_a_summary(sweep_dir):
        assert r["repro"]["num_threads"] == expected
    resolved = (sweep_dir / "0" / "config.resolved.yaml").read_text()
    assert f"num_threads: {expected}" in resolved


@pytest.mark.slow  # about 30 s: a sweep process, a submitit job, its requeue and a reference
def test_a_preempted_submitit_job_is_requeued_and_ends_bitwise_equal(tmp_path, reference_run):
    """SIGUSR2 at step 5 -> checkpoint, interrupted, requeue -> resume=auto -> completed,
    with the uninterrupted run's final weights (reference_run: seed 42, MICRO)."""
    sweep_dir = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "reprotrain.train",
        "--multirun",
        *MICRO,
        "seed.base=42",
        "trainer.checkpoint_every_steps=3",
        "hydra/launcher=submitit_local",
        f"hydra.sweep.dir={sweep_dir}",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, env=base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    job = sweep_dir / "0"
    deadline = time.monotonic() + 300
    while not list((job / "checkpoints").glob("step-*.pt")):  # the scheduler's notice, mid-run
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.1)
    os.kill(json.loads((job / ".lock").read_text())["pid"], signal.SIGUSR2)  # the job's process
    out, err = proc.communicate(timeout=900)
    assert_ok(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    rec, ref = run_json(sweep_dir / "0"), run_json(reference_run)
    assert rec["status"] == "completed" and len(rec["resumes"]) == 1
    assert rec["final_weights_sha256"] == ref["final_weights_sha256"]
    assert os.path.exists(sweep_dir / "0" / "checkpoints")


def test_run_stamp_outside_torchrun_is_time_and_random_hex_fixed_per_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    launchers.run_stamp.cache_clear()
    stamp = launchers.run_stamp()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d-[0-9a-f]{6}", stamp)
    assert launchers.run_stamp() == stamp  # every read of the run dir agrees
