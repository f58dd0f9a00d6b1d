"""A nested ``_partial_: true`` target (a dataset's collate as a function) is bound with
``bind_partial``: its keys are checked, the arguments its caller supplies later are not
reported missing. Everything else keeps preflight's one-line refusals."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from reprotrain import preflight
from reprotrain.components import ComponentError, check_node
from reprotrain.config import register_configs
from reprotrain.errors import ReprotrainError

COLLATE = "torch.utils.data.default_collate"  # def default_collate(batch): a positional arg


def dataset(**collate) -> OmegaConf:
    return OmegaConf.create({"_target_": "builtins.dict", "collate": collate})


def test_a_partial_collate_function_is_not_missing_the_batch_it_is_called_with():
    check_node(dataset(_target_=COLLATE, _partial_=True), "dataset", ())


def test_the_same_function_without_partial_still_needs_its_argument():
    with pytest.raises(ComponentError, match=r"dataset\.collate: .* needs batch; add"):
        check_node(dataset(_target_=COLLATE), "dataset", ())


def test_a_partial_still_refuses_an_unknown_key_and_too_many_args():
    with pytest.raises(ComponentError, match="unknown key 'batchh'"):
        check_node(dataset(_target_=COLLATE, _partial_=True, batchh=1), "dataset", ())
    with pytest.raises(ComponentError, match="too many positional arguments") as e:
        check_node(dataset(_target_=COLLATE, _partial_=True, _args_=[1, 2]), "dataset", ())
    assert "\n" not in str(e.value)


def test_args_bind_a_required_parameter_positionally():
    check_node(dataset(_target_=COLLATE, _args_=[[1, 2]]), "dataset", ())


def test_a_top_level_partial_is_still_checked_against_what_the_trainer_supplies():
    node = OmegaConf.create({"_target_": "torch.optim.SGD", "_partial_": True})
    check_node(node, "optimizer", ("params",))  # lr has a default: params is supplied
    sched = OmegaConf.create({"_target_": "torch.optim.lr_scheduler.StepLR", "_partial_": True})
    with pytest.raises(ComponentError, match="needs step_size"):
        check_node(sched, "scheduler", ("optimizer", "total_steps"))


def test_preflight_accepts_a_partial_collate_in_an_experiment():
    register_configs()
    preflight.register_resolvers()
    partial = [f"dataset.collate._target_={COLLATE}", "+dataset.collate._partial_=true",
               "~dataset.collate.pad_id"]  # fmt: skip
    preflight.check(["experiment=smoke_sequence", *partial])
    with pytest.raises(ReprotrainError, match="needs batch"):
        preflight.check(["experiment=smoke_sequence", *partial[::2]])
