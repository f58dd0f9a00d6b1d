"""``python -m reprotrain.tools.runs.resume`` records the same bitwise verdict as
``resume=auto`` (issue 44, point 6).

On the first GPU run the tool recorded ``bitwise_guarantee: false`` where ``resume=auto``
recorded true. The cause was not the GPU: ``scripts/gpu_check.sh`` installs Hydra into a
folder outside site-packages, so Hydra's modules are part of ``imported_code``; the tool's
trainer composed the recorded config under the bare schema (no framework wiring, so no Hydra
callback), imported four fewer Hydra modules than the run's start, and the resume named them
as changed code. The tool now composes under the same wiring as conf/train.yaml.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import hydra
import omegaconf
import pytest
from hydra import compose, initialize_config_dir

from conftest import assert_ok, base_env, resume, run_json, train
from reprotrain import CONF_DIR
from reprotrain.config import register_configs
from reprotrain.run.record import RESOLVED_CONFIG
from reprotrain.tools.runs.resume import PRIMARY, primary_config_text

CKPT_EVERY = "trainer.checkpoint_every_steps=3"


def hydra_wiring(config_dir: Path, name: str, overrides: list[str]) -> dict:
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides, return_hydra_config=True)
    return omegaconf.OmegaConf.to_container(cfg.hydra.callbacks)


def test_the_resume_tool_composes_under_the_same_hydra_wiring_as_a_run(tmp_path):
    """The callbacks Hydra runs (and so the modules the trainer imports) are the same for
    the tool's primary config as for conf/train.yaml."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # A recorded config as the trainer writes it: the composed run config, resolved.
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        recorded = compose(config_name="train", overrides=["experiment=selfcheck"])
    (run_dir / RESOLVED_CONFIG).write_text(omegaconf.OmegaConf.to_yaml(recorded, resolve=True))
    primary = tmp_path / "primary"
    primary.mkdir()
    (primary / PRIMARY).write_text(primary_config_text(run_dir))
    tool = hydra_wiring(primary, PRIMARY.removesuffix(".yaml"), ["resume=auto"])
    direct = hydra_wiring(CONF_DIR, "train", ["experiment=selfcheck", "resume=auto"])
    assert tool == direct and direct  # the sweep summary callback, in both


@pytest.mark.slow
def test_tool_resume_with_hydra_outside_site_packages_is_bitwise(tmp_path):
    """What gpu_check.sh does (Hydra from a ``pip --target`` folder on PYTHONPATH): a kill,
    then the resume tool; the record claims the bits, with no mismatch named."""
    site = tmp_path / "site"
    for module in (hydra, omegaconf):
        shutil.copytree(Path(module.__file__).parent, site / module.__name__)
    env = base_env(PYTHONPATH=str(site))
    run_dir = tmp_path / "run"
    proc = train(run_dir, CKPT_EVERY, env=env, fault="step:5")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert any("/site/hydra/" in k for k in run_json(run_dir)["imported_code"])
    assert_ok(resume(run_dir, env=env))
    entry = run_json(run_dir)["resumes"][0]
    assert entry["bitwise_guarantee"] is True, (entry["mismatch"], entry["unrestored"],
                                                entry["replay"])  # fmt: skip
