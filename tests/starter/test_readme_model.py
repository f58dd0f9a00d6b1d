"""The README's "bring your own model" example: the files it shows are these, and they run."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO


def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from reprotrain import preflight
    from reprotrain.config import register_configs

    register_configs()
    preflight.register_resolvers()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return hydra_compose("train", overrides=list(overrides))


def test_the_readme_shows_the_mlp_files_it_runs() -> None:
    readme = (REPO / "README.md").read_text()
    for shown in ("src/starter/mlp.py", "conf/model/mlp.yaml"):
        body = (REPO / shown).read_text()
        assert f"# {shown}\n{body}```" in readme, f"the README does not show {shown} as it is"
    assert 'make train ARGS="experiment=smoke model=mlp optimizer.lr=0.05"' in readme


def test_smoke_with_model_mlp_builds_a_classifier_for_its_images() -> None:
    """`make train ARGS="experiment=smoke model=mlp"` failed: dataset.num_features not found."""
    from hydra.utils import instantiate

    cfg = compose("experiment=smoke", "model=mlp")
    assert cfg.model.in_features == 3 * 32 * 32 and cfg.model.out_features == 10
    model = instantiate(cfg.model)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_the_tabular_experiments_keep_their_mlp() -> None:
    for experiment, outputs in (("smoke_regression", 1), ("smoke_binary", 1)):
        cfg = compose(f"experiment={experiment}")
        assert cfg.model.in_features == cfg.dataset.num_features == 8
        assert cfg.model.out_features == outputs


def test_a_wrong_input_width_is_one_line_that_names_the_key() -> None:
    import pytest
    from hydra.utils import instantiate

    from reprotrain.errors import ReprotrainError

    model = instantiate(compose("experiment=smoke", "model=mlp").model)
    with pytest.raises(ReprotrainError, match=r"model.in_features=3072 .* 768 values"):
        model(torch.zeros(2, 3, 16, 16))


@pytest.mark.slow
def test_the_readmes_mlp_example_reaches_the_accuracy_it_states(tmp_path) -> None:
    """The README: test accuracy 0.93 at optimizer.lr=0.05 (0.22 at the ResNet's 0.1)."""
    from conftest import assert_ok, run_json, train

    assert_ok(train(tmp_path / "mlp", "experiment=smoke", "model=mlp", "optimizer.lr=0.05",
                    "logger=none", micro=False, timeout=600))  # fmt: skip
    assert run_json(tmp_path / "mlp")["final_metrics"]["test_acc"] > 0.9
    assert_ok(train(tmp_path / "lr01", "experiment=smoke", "model=mlp", "logger=none",
                    micro=False, timeout=600))  # fmt: skip
    assert run_json(tmp_path / "lr01")["final_metrics"]["test_acc"] < 0.5
