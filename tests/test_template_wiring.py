"""conf/train.yaml is the user's: the framework's wiring is its own packaged config.

The run and sweep directory layout, the sweep summary callback, the ``--help`` page, the
typed schema and the framework's own ``experiment=selfcheck`` come from
``src/reprotrain/conf`` (ConfigStore), pulled in by one defaults line. Their behaviour is
tested where it matters (test_run_dir, test_sweep, test_help); here: where they live.
"""

from __future__ import annotations

import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO
from reprotrain.config import register_configs


def compose_with_hydra(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=True)


def test_train_yaml_holds_only_the_users_defaults_and_one_framework_line():
    train = yaml.safe_load((REPO / "conf" / "train.yaml").read_text())
    assert set(train) == {"defaults", "name"}  # no hydra: block, no searchpath, no callbacks
    defaults = train["defaults"]
    assert defaults[0] == "reprotrain"
    assert not [d for d in defaults if isinstance(d, dict) and any("hydra" in k for k in d)]
    assert {"dataset": "cifar10"} in defaults and {"experiment": None} in defaults


def test_the_framework_wiring_composes_as_before():
    cfg = compose_with_hydra("experiment=selfcheck")
    hydra = OmegaConf.to_container(cfg.hydra, resolve=False)  # as written, not resolved
    assert hydra["run"]["dir"] == "outputs/${name}/${run_stamp:}"
    assert hydra["sweep"] == {
        "dir": "multirun/${name}/${now:%Y-%m-%d_%H-%M-%S}-${run_suffix:}",
        "subdir": "${hydra.job.num}",
    }
    assert hydra["job"]["chdir"] is False
    assert hydra["callbacks"]["sweep_summary"]["_target_"].endswith("SweepSummaryCallback")
    assert hydra["runtime"]["choices"]["hydra/help"] == "reprotrain"
    assert hydra["help"]["app_name"] == "reprotrain"
    assert hydra["searchpath"] == []  # the framework's own job comes from the ConfigStore
    assert cfg.model._target_ == "reprotrain.selfcheck.net.TinyConvNet" and cfg.name == "selfcheck"
    assert cfg.resume is None and cfg.trainer.device == "cpu"  # schema + experiment merged


def test_an_experiment_and_the_command_line_still_override_the_wiring():
    cfg = compose_with_hydra("experiment=selfcheck", "hydra.run.dir=elsewhere/${name}")
    assert cfg.hydra.run.dir == "elsewhere/selfcheck"
