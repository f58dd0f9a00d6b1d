"""Two optimizers as one: SGD for most parameters, Muon for the weight matrices.

A worked example of bringing more than one optimizer without editing the framework (as
airbench94_muon does): the ``optimizer`` group's ``_target_`` may be any
``torch.optim.Optimizer``, and this one splits the parameters it is given by shape and
steps two inner optimizers. The framework's GradScaler, clipping, scheduler (it scales every
group's lr, both optimizers' alike) and checkpoint see one optimizer; its ``state_dict``
holds both inner ones, so a run repeats and resumes bit for bit.

    make train ARGS="experiment=smoke optimizer=sgd_muon"
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class SGDAndMuon(torch.optim.Optimizer):
    """SGD (momentum, Nesterov, weight decay) for every parameter that is not a 2-D matrix,
    Muon (orthogonalised momentum) for the 2-D matrices (``torch.optim.Muon`` takes only
    those). ``param_groups`` are the two inner optimizers' groups, SGD's first."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: float = 5e-4,
        muon_lr: float = 0.02,
        muon_momentum: float = 0.95,
        muon_weight_decay: float = 0.0,
    ) -> None:
        params = list(params)
        flat = [p for g in params for p in g["params"]] if isinstance(params[0], dict) else params
        matrices = [p for p in flat if p.ndim == 2]
        rest = [p for p in flat if p.ndim != 2]
        self.inner: dict[str, torch.optim.Optimizer] = {}
        if rest:
            self.inner["sgd"] = torch.optim.SGD(
                rest, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay
            )
        if matrices:
            self.inner["muon"] = torch.optim.Muon(
                matrices, lr=muon_lr, momentum=muon_momentum, weight_decay=muon_weight_decay
            )
        super().__init__(flat, {"lr": lr, "weight_decay": weight_decay})
        self._link()

    def _link(self) -> None:
        """The inner optimizers' groups as this one's (a scheduler changes their lr)."""
        self.param_groups = [g for opt in self.inner.values() for g in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("SGDAndMuon takes no closure")
        for opt in self.inner.values():
            opt.step()

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.inner.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if sorted(state_dict) != sorted(self.inner):
            raise ValueError(
                f"the checkpoint holds optimizers {sorted(state_dict)}, this run "
                f"{sorted(self.inner)}; resume with the same model"
            )
        for name, opt in self.inner.items():
            opt.load_state_dict(state_dict[name])
        self._link()  # load_state_dict gave the inner optimizers new group dicts
