"""``tags``, a git-ignored ``conf/local/``, and trainer presets (``trainer=cpu|gpu|ddp``)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from conftest import MICRO, REPO, TINY, assert_ok, run_json, train
from reprotrain import CONF_DIR, preflight
from reprotrain.config import config_sha256, register_configs


def composed(*overrides: str, conf_dir=CONF_DIR):
    register_configs()
    preflight.register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            return compose("train", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def container(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=False)


# ------------------------------------------------------------------------------------ tags


def test_tags_are_a_typed_list_and_not_part_of_the_configs_identity():
    plain = composed("experiment=smoke")
    tagged = composed("experiment=smoke", "tags=[baseline,lr-study]")
    assert list(plain.tags) == [] and list(tagged.tags) == ["baseline", "lr-study"]
    assert config_sha256(container(plain)) == config_sha256(container(tagged))
    other = composed("experiment=smoke", "trainer.epochs=3")
    assert config_sha256(container(other)) != config_sha256(container(plain)), "control"


def test_a_runs_tags_are_in_its_run_json(tmp_path):
    run = tmp_path / "run"
    assert_ok(train(run, *MICRO, *TINY, "tags=[baseline,lr-study]", micro=False))
    assert run_json(run)["tags"] == ["baseline", "lr-study"]


def test_tags_must_be_a_list():
    with pytest.raises(Exception, match="tags"):
        composed("experiment=smoke", "tags={a: 1}")


# ------------------------------------------------------------------------------ conf/local


@pytest.fixture
def conf_copy(tmp_path):
    """A copy of conf/ (never write into the real one: other tests compose it meanwhile)."""
    dest = tmp_path / "conf"
    shutil.copytree(CONF_DIR, dest)
    (dest / "local" / "default.yaml").unlink(missing_ok=True)  # this machine's own, if any
    assert not (dest / "local" / "default.yaml").exists()
    return dest


def test_conf_local_default_applies_after_the_experiment_and_loses_to_the_command_line(
    conf_copy,
):
    assert composed("experiment=smoke", conf_dir=conf_copy).trainer.num_workers == 0
    (conf_copy / "local" / "default.yaml").write_text(
        "# @package _global_\ntrainer:\n  num_workers: 3\n  epochs: 5\n"
    )
    cfg = composed("experiment=smoke", conf_dir=conf_copy)
    assert cfg.trainer.num_workers == 3
    assert cfg.trainer.epochs == 5, "wins over the experiment's epochs (2)"
    cfg = composed("experiment=smoke", "trainer.num_workers=1", conf_dir=conf_copy)
    assert cfg.trainer.num_workers == 1, "the command line wins"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_conf_local_is_ignored_by_git_except_its_readme():
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)

    if git("rev-parse", "--git-dir").returncode != 0:
        pytest.fail("the test runs in a checkout of the repository")
    assert git("check-ignore", "-q", "conf/local/default.yaml").returncode == 0
    assert git("check-ignore", "-q", "conf/local/other.yaml").returncode == 0
    assert "conf/local/README.md" in git("ls-files", "conf/local").stdout


# ------------------------------------------------------------------------- trainer presets


def test_trainer_presets_set_their_keys_on_top_of_the_default_trainer():
    assert composed("trainer=cpu").trainer.device == "cpu"
    assert composed("trainer=gpu").trainer.device == "cuda"
    smoke = composed("experiment=smoke", "trainer=gpu").trainer
    assert smoke.device == "cpu", "an experiment's own trainer keys win over the preset"
    ddp = composed("experiment=smoke", "trainer=ddp").trainer
    assert ddp.world_size_invariant is True and ddp.microbatch_size == 64
    assert ddp.epochs == 2, "the experiment still applies on top of the preset"


@pytest.mark.parametrize("preset", ["cpu", "ddp"])
def test_trainer_presets_pass_preflight(preset):
    assert preflight.check(["experiment=smoke", f"trainer={preset}"]) is None
