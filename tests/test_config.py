"""Bad input fails at compose time with one line, no traceback, and no completed run."""

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from conftest import REPO, assert_ok, base_env, train
from reprotrain import CONF_DIR
from reprotrain.config import register_configs, validate
from reprotrain.errors import ReprotrainError

register_configs()


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.epoch=3", "trainer.epoch"),
        ("trainer.epochs=abc", "trainer.epochs"),
        ("model=resnet999", "resnet999"),
        ("trainer.batch_size=0", "trainer.batch_size"),
        ("optimizer.lr=-1", "optimizer.lr"),
    ],
)
def test_bad_override_is_one_line_and_creates_no_run(tmp_path, override, expected):
    run_dir = tmp_path / "run"
    proc = train(run_dir, override, micro=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not run_dir.exists()


def test_sweep_values_are_checked_before_any_job_runs(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reprotrain.train",
            "--multirun",
            "experiment=selfcheck",
            "seed.base=0,x",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "seed.base" in proc.stderr
    assert not (tmp_path / "sweep").exists()


def test_defaults_compose_and_validate():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train")
        smoke = compose("train", overrides=["experiment=selfcheck"])
    validate(cfg, 1)  # the user's defaults (tests/starter checks what they name)
    assert cfg.repro.level == "strict"
    assert smoke.dataset._target_ == "reprotrain.selfcheck.images.SyntheticImages"
    assert smoke.model._target_ == "reprotrain.selfcheck.net.TinyConvNet"
    smoke.trainer.pipeline = "device"
    smoke.trainer.num_workers = 2  # the device pipeline has no workers: refuse, don't ignore
    from reprotrain.preflight import check_data_settings  # before a run (the pipeline: in one)

    with pytest.raises(ReprotrainError, match="pipeline=loader"):
        check_data_settings(smoke.dataset, smoke.trainer, smoke.model.get("num_classes"))


def test_help_still_works():
    proc = subprocess.run(
        [sys.executable, "-m", "reprotrain.train", "--cfg", "job", "experiment=selfcheck"],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
    )
    assert_ok(proc)
    assert "reprotrain.selfcheck.net.TinyConvNet" in proc.stdout and "widths" in proc.stdout


def test_config_sha256_ignores_where_to_look_but_not_what_to_compute():
    from omegaconf import OmegaConf

    from reprotrain.config import config_sha256

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        base = OmegaConf.to_container(compose("train", overrides=["dataset=cifar10"]))
        moved = OmegaConf.to_container(
            compose("train", overrides=["dataset.root=/elsewhere", "resume=auto"])
        )
        other = OmegaConf.to_container(compose("train", overrides=["optimizer.lr=0.3"]))
    assert config_sha256(base) == config_sha256(moved)
    assert config_sha256(base) != config_sha256(other)


def test_every_trainer_key_is_owned_by_exactly_one_settings_part():
    """``trainer.*`` reaches components only through ``TrainerSettings``' parts: each key
    of the packaged config belongs to one part, so a new key must be given one owner."""
    from dataclasses import fields

    from reprotrain.config import TrainerSettings

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["trainer.batch_size=64", "trainer.precision=tf32"])
    parts = {p.name: p for p in fields(TrainerSettings)}
    settings = TrainerSettings.from_config(cfg.trainer)
    owners: dict[str, list[str]] = {key: [] for key in cfg.trainer}
    for name in parts:
        for key in fields(getattr(settings, name)):
            owners.setdefault(key.name, []).append(name)
            assert getattr(getattr(settings, name), key.name) == cfg.trainer[key.name]
    assert {k: v for k, v in owners.items() if len(v) != 1} == {}
    assert (settings.pipeline.batch_size, settings.step.precision) == (64, "tf32")  # values land


def test_the_trainer_schema_is_made_from_the_settings_so_each_key_is_declared_once():
    """One declaration per key: the flat ``trainer`` schema's fields are the settings'
    fields, with their types and defaults (no second class to keep in step)."""
    from dataclasses import fields
    from typing import get_type_hints

    from reprotrain.config import TrainerConfig, TrainerSettings, trainer_schema

    declared = [f for part in get_type_hints(TrainerSettings).values() for f in fields(part)]
    names = [f.name for f in declared]
    assert len(names) == len(set(names))  # no key in two parts
    assert {f.name: f.default for f in fields(TrainerConfig)} == {
        f.name: f.default for f in declared
    }
    assert [f.name for f in fields(trainer_schema())] == names


def test_the_batch_layout_is_checked_against_the_world_size_the_job_really_has(tmp_path):
    """A submitit job's ranks learn their world size only when they start (compose time saw
    1): a micro-batch larger than a rank's share is refused before anything is written,
    not silently truncated by the micro-batch loop."""
    from reprotrain.distributed import Dist
    from reprotrain.start import start

    overrides = ["experiment=selfcheck", "trainer.batch_size=64", "trainer.microbatch_size=16"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    validate(cfg, 1)  # world size 1 at compose time: fine
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(ReprotrainError, match=r"microbatch_size=16 does not divide the per-rank"):
        start(cfg, run_dir, Dist(rank=0, world_size=8))  # 8 samples per rank
    assert list(run_dir.iterdir()) == []
