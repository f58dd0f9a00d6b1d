"""experiment=selfcheck's SGD lr lives in optimizer/tuned (the package conf dir), so another
optimizer composed over it keeps its own defaults; with SGD the config is unchanged."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from conftest import REPO
from reprotrain import preflight
from reprotrain.config import register_configs


def composed(*overrides: str):
    register_configs()
    preflight.register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_selfcheck_with_sgd_keeps_its_tuned_lr_and_label_smoothing():
    cfg = composed("experiment=selfcheck")
    assert cfg.optimizer._target_ == "torch.optim.SGD" and cfg.optimizer.lr == 0.2
    assert cfg.loss.label_smoothing == 0.0


def test_selfcheck_lr_tuned_for_sgd_does_not_leak_into_adamw():
    adamw = composed("experiment=selfcheck", "optimizer=adamw").optimizer
    assert adamw._target_ == "torch.optim.AdamW"
    assert adamw.lr == composed("optimizer=adamw").optimizer.lr != 0.2
    explicit = composed("experiment=selfcheck", "optimizer=adamw", "optimizer.lr=0.01")
    assert explicit.optimizer.lr == 0.01
