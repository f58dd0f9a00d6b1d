"""User code whose batches change shape, brought by ``_target_`` (``PYTHONPATH=tests``).

Not a test module: the trainer imports it in a subprocess, as it imports a user's package,
and the in-process tests use it directly. Written the way a user writes a sequence job:

- ``Sequences``: variable-length token sequences (``SampleData``); its YAML names a collate.
  It takes the selfcheck dataset's keys (``noise``, ``mean``, ``std``, ``augment``: unused),
  so ``experiment=selfcheck dataset._target_=shapes_user_code.Sequences`` swaps it in.
- ``PadAndDrop``: the collate. It pads each batch to the longest sequence *it is given* and,
  with ``drop > 0``, replaces training tokens by the unknown token where a mask drawn from
  the ``ctx.generator`` the pipeline hands it says so: a draw of the padded batch's shape.
- ``TokenNet``: embedding, a GRU, a linear head read at each sequence's last real token.
- ``TokenDropout``: classification whose training step drops tokens with a mask of the
  micro-batch's shape drawn from the step's ``ctx.generator``.

Both masks have the padded shape, so they depend on the padding: the same draw at another
padded length is another mask.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from reprotrain.data.base import SampleData, Splits, val_indices
from reprotrain.tasks.base import StepContext, StepOutput
from reprotrain.tasks.classification import Classification

PAD, UNKNOWN = 0, 1


class _Tokens(Dataset):
    def __init__(self, sequences: list[torch.Tensor], labels: torch.Tensor) -> None:
        self.sequences, self.labels = sequences, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sequences[i], self.labels[i]


def make_tokens(n: int, vocab: int, classes: int, lengths: tuple[int, int], seed: int):
    """Class ``c``'s sequences take most tokens from a band of the vocabulary of its own."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    band = (vocab - 2) // classes
    sequences = []
    for label in labels.tolist():
        length = int(torch.randint(lengths[0], lengths[1] + 1, (), generator=g))
        anywhere = torch.randint(2, vocab, (length,), generator=g)
        own = 2 + label * band + torch.randint(0, band, (length,), generator=g)
        sequences.append(torch.where(torch.rand(length, generator=g) < 0.7, own, anywhere))
    return _Tokens(sequences, labels)


class PadAndDrop:
    """``[(tokens [L_i], label), ...] -> (tokens [B, max L_i], labels [B])``; training
    batches lose tokens to ``UNKNOWN`` with probability ``drop`` (``ctx.generator``)."""

    def __init__(self, drop: float = 0.0) -> None:
        self.drop = drop

    def __call__(self, samples: list, ctx: Any = None):
        tokens = nn.utils.rnn.pad_sequence([t for t, _ in samples], batch_first=True)
        if self.drop and ctx is not None and ctx.training:
            mask = torch.rand(tokens.shape, generator=ctx.generator) < self.drop
            tokens = tokens.masked_fill(mask & (tokens != PAD), UNKNOWN)
        return tokens, torch.stack([label for _, label in samples])


class Sequences(SampleData):
    """Token sequences of ``min_len .. max_len`` tokens, ``num_classes`` classes."""

    def __init__(
        self,
        num_train: int = 256,
        num_test: int = 64,
        data_seed: int = 1234,
        val_fraction: float = 0.0,
        num_classes: int = 4,
        vocab_size: int = 18,
        min_len: int = 2,
        max_len: int = 24,
        collate: Any = None,
        noise: Any = None,
        mean: Any = None,
        std: Any = None,
        augment: bool = True,
    ) -> None:
        self.collate, self.val_fraction, self.num_classes = collate, val_fraction, num_classes
        self.params = {"num_train": num_train, "num_test": num_test, "data_seed": data_seed,
                       "vocab": vocab_size, "classes": num_classes,
                       "lengths": (min_len, max_len)}  # fmt: skip

    def splits(self) -> Splits:
        p = dict(self.params)
        n_train, n_test, seed = p.pop("num_train"), p.pop("num_test"), p.pop("data_seed")
        train = make_tokens(n_train, **p, seed=seed)
        test = make_tokens(n_test, **p, seed=seed + 1)
        tr, va = val_indices(len(train), self.val_fraction)
        val = _Tokens([train.sequences[i] for i in va], train.labels[va]) if len(va) else None
        train = _Tokens([train.sequences[i] for i in tr], train.labels[tr])
        return Splits(train, val, test, self.num_classes)

    def fingerprint(self) -> dict:
        text = json.dumps(self.params, sort_keys=True)
        return {"kind": "synthetic-params", "sha256": hashlib.sha256(text.encode()).hexdigest()}


class TokenNet(nn.Module):
    """Embedding, one GRU, a linear head on each sequence's last real (non-pad) token."""

    def __init__(self, num_classes: int = 4, vocab_size: int = 18, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 8, padding_idx=PAD)
        self.gru = nn.GRU(8, hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        last = (tokens != PAD).sum(1).clamp(min=1) - 1
        out, _ = self.gru(self.embed(tokens))
        return self.head(out[torch.arange(len(tokens), device=tokens.device), last])


class TokenDropout(Classification):
    """Classification; a training micro-batch loses tokens to ``UNKNOWN`` with probability
    ``drop``, from a mask of its padded shape drawn from ``ctx.generator``."""

    def __init__(self, drop: float = 0.2, loss_fn: Any = None) -> None:
        super().__init__(loss_fn)
        self.drop = drop

    def training_step(self, model: nn.Module, batch: Any, ctx: StepContext) -> StepOutput:
        tokens, y = batch
        mask = torch.rand(tokens.shape, generator=ctx.generator).to(tokens.device) < self.drop
        tokens = tokens.masked_fill(mask & (tokens != PAD), UNKNOWN)
        return super().training_step(model, (tokens, y), ctx)
