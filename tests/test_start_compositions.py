"""A trainer start composes its config twice, not three times: Hydra's main asks for
``hydra.mode`` (``Hydra.get_mode`` composes the whole config for it), and the preflight
check, which composed the same command line, answers (``hydra_api.answer_mode``)."""

from __future__ import annotations

import pytest
from hydra import initialize_config_dir
from hydra._internal import config_loader_impl
from hydra._internal.hydra import Hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode

from reprotrain import CONF_DIR, hydra_api, preflight
from reprotrain.config import register_configs

COMMAND_LINES = [
    ["experiment=selfcheck"],
    ["experiment=selfcheck", "hydra.mode=MULTIRUN"],
    ["--multirun", "experiment=selfcheck", "seed.base=0,1"],
]


@pytest.fixture
def hydra_asks(monkeypatch):
    """Hydra's own ``get_mode`` (restored after the test), and a count of compositions."""
    register_configs()
    preflight.register_resolvers()
    monkeypatch.setattr(Hydra, "get_mode", Hydra.get_mode)
    calls = []
    load = config_loader_impl.ConfigLoaderImpl.load_configuration

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("overrides", args[1] if len(args) > 1 else None))
        return load(self, *args, **kwargs)

    monkeypatch.setattr(config_loader_impl.ConfigLoaderImpl, "load_configuration", counted)
    return calls


def hydras_answer(overrides: list[str]):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), **hydra_api.VERSION_BASE):
            return GlobalHydra.instance().hydra.get_mode(config_name="train", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


@pytest.mark.parametrize("argv", COMMAND_LINES, ids=["run", "mode-in-config", "multirun"])
def test_the_checks_hydra_mode_is_the_one_hydra_composes_and_answers_only_that_line(
    argv, hydra_asks
):
    overrides = [a for a in argv if a != "--multirun"]
    composed = preflight.compose_all(argv)
    expected = hydras_answer(overrides)
    assert composed.hydra_mode == expected
    if "hydra.mode=MULTIRUN" in argv:
        assert expected == RunMode.MULTIRUN  # the case where the answer decides something

    hydra_api.answer_mode(argv, composed.hydra_mode)
    hydra_asks.clear()
    assert hydras_answer(overrides) == expected and hydra_asks == [], "it composed again"
    other = [*overrides, "trainer.epochs=3"]
    assert hydras_answer(other) == expected and hydra_asks == [other], "another line: Hydra's"


def test_another_config_search_path_is_left_to_hydra(hydra_asks):
    asked = Hydra.get_mode
    hydra_api.answer_mode(["--config-dir", str(CONF_DIR), "experiment=selfcheck"], "made up")
    assert Hydra.get_mode is asked
