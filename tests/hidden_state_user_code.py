"""User code that keeps state where no ``state_dict`` and no audit can see it (issue 34).

Not a test module: the trainer imports it in a subprocess (``PYTHONPATH=tests``), as it
imports a user's package. Each model is the framework's test net whose output is scaled by
a state it keeps outside its ``state_dict``, so a resume that does not rebuild that state
trains other weights; ``counting_lambda_lr`` is a scheduler whose closure counts its calls.
A resume is right about these only by re-executing them (the replay), never by listing.
"""

from __future__ import annotations

import collections
import colorsys
import hashlib
import itertools
import os

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset

from reprotrain.api import SampleData, Splits, Step
from reprotrain.selfcheck.images import make_images
from reprotrain.selfcheck.net import TinyConvNet

CALLS = 0  # a module-level counter (ModuleCounterNet)


class _Scaled(TinyConvNet):
    """The test net times ``1 + 1e-2 * self.tick()`` while training."""

    def tick(self) -> float:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        return out * (1 + 1e-2 * self.tick()) if self.training else out


class BufferNet(_Scaled):
    """A non-persistent buffer updated in ``forward``."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.register_buffer("seen", torch.zeros(()), persistent=False)

    def tick(self) -> float:
        self.seen += 1
        return float(self.seen)


class PrivateCounterNet(_Scaled):
    """A private attribute the audit does not read."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._calls = 0

    def tick(self) -> float:
        self._calls += 1
        return float(self._calls)


class ContainersNet(_Scaled):
    """A deque, an itertools.count and a dict nested seven deep."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.recent: collections.deque = collections.deque(maxlen=4)
        self.counter = itertools.count()
        self.deep = {"a": {"b": {"c": {"d": {"e": {"f": {"g": 0}}}}}}}

    def tick(self) -> float:
        leaf = self.deep["a"]["b"]["c"]["d"]["e"]["f"]
        leaf["g"] += 1
        self.recent.append(next(self.counter))
        return float(leaf["g"] + sum(self.recent))


class NumpyTensorNet(_Scaled):
    """A 1.6 MB tensor attribute changed through ``.numpy()`` (its version never moves)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.table = torch.zeros(400_000)

    def tick(self) -> float:
        view = self.table.numpy()
        view[0] += 1
        return float(self.table[0])


class ModuleCounterNet(_Scaled):
    """A counter at module level."""

    def tick(self) -> float:
        global CALLS
        CALLS += 1
        return float(CALLS)


def counting_lambda_lr(optimizer: torch.optim.Optimizer, total_steps: int):
    """A LambdaLR whose lambda keeps a count in its closure (not in the scheduler's state)."""
    calls = [0]

    def factor(_: int) -> float:
        calls[0] += 1
        return 1.0 / (1 + 0.3 * calls[0])

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --- state whose effect lands after the interval a resume replays (issue 45) ----------------
# Each acts once, at its ACT_AT-th training forward (or step): killed after a later
# checkpoint, the replay of the interval before it matches bit for bit, and only a
# comparison of the state itself (the resume audit's digests) or of the continuation (the
# steps the killed run logged after its checkpoint) can tell the resume is not bitwise.
ACT_AT = 5
VALIDATED = 0  # a module global written at validation (ValidationGlobalNet)


class _Later(TinyConvNet):
    """The test net times 1.5 when ``self.count()`` reaches ACT_AT while training."""

    def count(self) -> int:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        return out * 1.5 if self.training and self.count() == ACT_AT else out


class LaterCounterNet(_Later):
    """A private counter acting every ACT_AT forwards (here: once)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._calls = 0

    def count(self) -> int:
        self._calls += 1
        return self._calls


class LaterBufferNet(_Later):
    """A non-persistent buffer counting forwards."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64), persistent=False)

    def count(self) -> int:
        self.seen += 1
        return int(self.seen)


class ValidationGlobalNet(TinyConvNet):
    """Validation sets a module global; every later training forward is scaled by it."""

    def forward(self, x: Tensor) -> Tensor:
        global VALIDATED
        out = super().forward(x)
        if not self.training:
            VALIDATED = 1
            return out
        return out * (1 + 0.5 * VALIDATED)


def _counter():
    calls = [0]

    def tick() -> int:
        calls[0] += 1
        return calls[0]

    return tick


_tick = _counter()  # a function global whose closure keeps a count


class ClosureCounterNet(_Later):
    """A count in a module-level function's closure."""

    def count(self) -> int:
        return _tick()


class ClassCounterNet(_Later):
    """A count kept on the class: ``type(self).calls += 1``."""

    calls = 0

    def count(self) -> int:
        type(self).calls += 1
        return type(self).calls


class DefaultArgumentNet(_Later):
    """A count in a mutable default argument."""

    def count(self, calls: list = [0]) -> int:  # noqa: B006 (the state under test)
        calls[0] += 1
        return calls[0]


class KeywordDefaultNet(_Later):
    """A count in a mutable keyword-only default."""

    def count(self, *, calls: dict = {"n": 0}) -> int:  # noqa: B006 (the state under test)
        calls["n"] += 1
        return calls["n"]


def forwards() -> int:
    """A count kept as an attribute of a module-level function."""
    forwards.calls += 1
    return forwards.calls


forwards.calls = 0


class FunctionAttributeNet(_Later):
    def count(self) -> int:
        return forwards()


ENV_COUNT = "HIDDEN_STATE_FORWARDS"


class EnvironmentNet(_Later):
    """A count kept in ``os.environ``."""

    def count(self) -> int:
        calls = int(os.environ.get(ENV_COUNT, "0")) + 1
        os.environ[ENV_COUNT] = str(calls)
        return calls


class ThirdPartyGlobalNet(_Later):
    """A count kept in a third-party module's own globals (here the standard library's
    ``colorsys``), which no digest reaches: only the comparison of the continuation (the
    steps after the checkpoint) sees the resume differ."""

    def count(self) -> int:
        colorsys.hidden_calls = getattr(colorsys, "hidden_calls", 0) + 1
        return colorsys.hidden_calls


class _Reads(Dataset):
    """A training split that counts its reads; from read READS_AT on, a sample is scaled."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y, self.reads = x, y, 0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        self.reads += 1
        return self.x[i] * (1.5 if self.reads > READS_AT else 1.0), self.y[i]


# The reads before a run's 5th step at 32 samples a step: 4 steps and the purity check's 8
# draws in the main process (src/reprotrain/data/purity.py).
READS_AT = 4 * 32 + 8


class CountingImages(SampleData):
    """The selfcheck images served per sample, by a training split counting its reads."""

    def __init__(self, num_train: int = 320, num_test: int = 64, **_: object) -> None:
        self.params = dict(num_train=num_train, num_test=num_test, data_seed=1234, noise=48.0)

    def splits(self) -> Splits:
        train_x, train_y, test_x, test_y = make_images(**self.params)
        train_x, test_x = train_x.float() / 255, test_x.float() / 255
        return Splits(_Reads(train_x, train_y), None, TensorDataset(test_x, test_y), 10)

    def fingerprint(self) -> dict:
        return {"kind": "synthetic-params", "sha256": hashlib.sha256(b"counting").hexdigest()}


class CountingLoss(torch.nn.CrossEntropyLoss):
    """A loss module with a private counter, doubling its ACT_AT-th loss."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._calls = 0

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        loss = super().forward(logits, target)
        if torch.is_grad_enabled():
            self._calls += 1
            return loss * 2 if self._calls == ACT_AT else loss
        return loss


class CountingSGD(torch.optim.SGD):
    """An optimizer with a private step counter, doubling its ACT_AT-th step's gradients."""

    def __init__(self, params, **kw) -> None:
        super().__init__(params, **kw)
        self._steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        self._steps += 1
        if self._steps == ACT_AT:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(2)
        return super().step(closure)


class CountingStep(Step):
    """A user step whose public ``calls`` scales every gradient (no state_dict holds it)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, runner, batch) -> None:
        self.calls += 1
        runner.gradients(batch)
        with torch.no_grad():
            for p in runner.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1 + 0.1 * self.calls)
        runner.apply()
