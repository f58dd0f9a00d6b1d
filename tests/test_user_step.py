"""The step a user can own (``step`` config group, reprotrain/step/__init__.py): what the framework
promises a step object, checked in process on a tiny model. The worked examples (EMA, SAM)
are the user package's and are tested in tests/starter/test_example_steps.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from reprotrain.components import ComponentError, build_step, check_node
from reprotrain.errors import ReprotrainError
from reprotrain.step import PlainStep
from step_harness import Harness, batch


class Twice:
    """Two gradient passes, the second at weights moved by +0.01 (put back before apply)."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.grads: list[list[torch.Tensor]] = []

    def __call__(self, runner, batch) -> None:
        self.losses.append(runner.gradients(batch)[0])
        params = list(runner.model.parameters())
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.add_(0.01)
        self.losses.append(runner.gradients(batch)[0])
        self.grads.append([p.grad.clone() for p in params])
        with torch.no_grad():
            for p, w in zip(params, saved, strict=True):
                p.copy_(w)
        runner.apply()


class Counting(PlainStep):
    """A step with state of its own: the number of updates it made."""

    def __init__(self) -> None:
        self.updates = torch.zeros((), dtype=torch.int64)

    def __call__(self, runner, batch) -> None:
        super().__call__(runner, batch)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"updates": self.updates.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.updates.copy_(state["updates"])


@pytest.mark.parametrize("reduction", ["local", "exact"])
def test_a_user_step_that_calls_gradients_and_apply_is_the_plain_step_bit_for_bit(reduction):
    class Mine:
        def __call__(self, runner, batch) -> None:
            runner.gradients(batch)
            runner.apply()

    plain = Harness(reduction=reduction, microbatch_size=4).run(3)
    mine = Harness(lambda m: Mine(), reduction=reduction, microbatch_size=4).run(3)
    assert plain.bits() == mine.bits()


def test_only_the_first_gradients_call_is_recorded_and_the_update_uses_the_last():
    twice = Twice()
    h = Harness(lambda m: twice, microbatch_size=8).run(1)
    plain = Harness(microbatch_size=8).run(1)
    recorded = h.state.loop.progress.step_losses[0]
    assert torch.equal(recorded, twice.losses[0])  # the first call's loss is the step's
    assert torch.equal(recorded, plain.state.loop.progress.step_losses[0])
    assert not torch.equal(twice.losses[0], twice.losses[1])  # the second pass moved
    # The update used the second pass's gradient: SGD's first step is w - lr * g (as SGD
    # computes it: add with alpha).
    start = Harness(microbatch_size=8)  # the same initial weights
    lr = 0.2
    for w0, w1, g in zip(start.state.model.parameters(), h.state.model.parameters(),
                         twice.grads[0], strict=True):  # fmt: skip
        assert torch.equal(w1, torch.add(w0, g, alpha=-lr))


def test_a_step_that_skips_apply_or_applies_twice_is_one_line():
    class NoApply:
        def __call__(self, runner, batch) -> None:
            runner.gradients(batch)

    class TwoApplies(PlainStep):
        def __call__(self, runner, batch) -> None:
            super().__call__(runner, batch)
            runner.apply()

    with pytest.raises(ReprotrainError, match=r"step NoApply did not call runner.apply\(\)"):
        Harness(lambda m: NoApply()).runner.step(batch(0), 0)
    with pytest.raises(ReprotrainError, match=r"apply\(\) twice"):
        Harness(lambda m: TwoApplies()).runner.step(batch(0), 0)


@pytest.mark.parametrize("reduction", ["local", "exact"])
def test_a_step_with_state_is_its_own_checkpoint_part_and_resumes_bitwise(reduction):
    make = lambda model: Counting()  # noqa: E731
    whole = Harness(make, reduction=reduction, microbatch_size=4).run(6)
    first = Harness(make, reduction=reduction, microbatch_size=4).run(3)
    data = first.checkpoint()
    assert "user_step" in torch.load(__import__("io").BytesIO(data), weights_only=True)
    rest = Harness.resumed(data, make, reduction=reduction, microbatch_size=4).run(3)
    assert int(rest.user_step.updates) == int(whole.user_step.updates) == 6
    assert rest.bits()[0] == whole.bits()[0]
    assert rest.bits()[1:] == whole.bits()[1:]  # the whole epoch's losses and lrs


def test_validation_runs_inside_the_steps_evaluation_weights():
    from reprotrain.loop import evaluate_split

    seen: list[str] = []

    class Swapping(PlainStep):
        evaluated_with = "zeros"

        @contextlib.contextmanager
        def evaluation_weights(self, model):
            saved = {k: v.clone() for k, v in model.state_dict().items()}
            seen.append("in")
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            yield
            model.load_state_dict(saved)
            seen.append("out")

    class Pipeline:
        def eval_batches(self, split):
            return [batch(50), batch(51)]

    h = Harness(lambda m: Swapping()).run(2)
    before = h.bits()[0]
    zeros = evaluate_split(h.runner, Pipeline(), "val")
    assert seen == ["in", "out"] and h.bits()[0] == before  # the trained weights are back
    plain = Harness().run(2)
    assert zeros != evaluate_split(plain.runner, Pipeline(), "val")


def test_the_step_group_is_bound_at_preflight_and_given_the_model_when_it_takes_one():
    from omegaconf import OmegaConf

    plain = OmegaConf.create({"_target_": "reprotrain.step.PlainStep"})
    check_node(plain, "step", ("model",))
    assert isinstance(build_step(plain, torch.nn.Linear(1, 1)), PlainStep)
    typo = OmegaConf.create({"_target_": "reprotrain.step.PlainStep", "rho": 1})
    with pytest.raises(ComponentError, match="step: unknown key 'rho'"):
        check_node(typo, "step", ("model",))
    missing = OmegaConf.create({"_target_": "reprotrain.step.Nowhere"})
    with pytest.raises(ComponentError, match=r"step._target_='reprotrain.step.Nowhere'"):
        check_node(missing, "step", ("model",))


def test_another_step_is_another_config_identity():
    from reprotrain.config import config_sha256
    from reprotrain.resume.guard import config_differences

    before = {"trainer": {"epochs": 2}, "model": {"_target_": "m.M"}}
    now = {**before, "step": {"_target_": "reprotrain.step.PlainStep"}}
    ema = {**before, "step": {"_target_": "my.steps.EMA", "decay": 0.9}}
    assert config_sha256(ema) != config_sha256(now)
    assert config_differences(now, ema) == ["step._target_", "step.decay"]
