"""The room's two-optimizer example (src/starter/optim.py): SGD + Muon as one optimizer,
brought without a framework edit, repeats and resumes bit for bit."""

from __future__ import annotations

import torch

from starter.optim import SGDAndMuon
from step_harness import Harness


def sgd_and_muon(params) -> SGDAndMuon:
    return SGDAndMuon(params, lr=0.2, muon_lr=0.05)


def plain(model):
    from reprotrain.api import Step

    return Step()


def test_sgd_and_muon_each_step_the_parameters_of_their_shape():
    h = Harness(plain, make_optimizer=sgd_and_muon)
    inner = h.state.optimizer.inner
    assert {p.ndim for g in inner["muon"].param_groups for p in g["params"]} == {2}
    assert 2 not in {p.ndim for g in inner["sgd"].param_groups for p in g["params"]}
    assert len(h.state.optimizer.param_groups) == 2  # the scheduler scales both


def test_two_optimizers_repeat_and_resume_bitwise():
    a = Harness(plain, make_optimizer=sgd_and_muon).run(6)
    b = Harness(plain, make_optimizer=sgd_and_muon).run(6)
    assert a.bits() == b.bits()
    first = Harness(plain, make_optimizer=sgd_and_muon).run(3)
    rest = Harness.resumed(first.checkpoint(), plain, make_optimizer=sgd_and_muon).run(3)
    assert rest.bits() == a.bits()
    lrs = [g["lr"] for g in rest.state.optimizer.param_groups]
    assert lrs == [g["lr"] for g in a.state.optimizer.param_groups]
    plain_sgd = Harness(plain).run(6)
    assert plain_sgd.bits()[0] != a.bits()[0]  # Muon really stepped the matrices
    assert torch.isfinite(torch.tensor(a.bits()[1])).all()
