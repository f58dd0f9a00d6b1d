"""Variable-length token sequences, generated, and the collate that pads them.

Class ``c`` owns a band of the vocabulary; a sequence of class ``c`` (length drawn between
``min_len`` and ``max_len``) takes about half its tokens from that band and the rest from the
whole vocabulary. Token 0 is padding and never appears in a sequence.

Samples are ``(tokens [L] int64, label int)`` with ``L`` varying, so the default collate
(which stacks) cannot batch them: ``PadTokens`` (chosen in the YAML) pads to the longest
sequence of the batch and gives ``(tokens [B, L_max], labels [B])``.

Closes: per-sample randomness. The train-time ``token_dropout`` (a token replaced by the
unknown token 1) draws from torch's global generator inside ``transform``, which the loader
pipeline seeds from (augment seed, epoch, index): same masks with 0 or 2 workers, after a
resume, on any machine.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from reprotrain.api import ReprotrainError, SampleData, Splits, Subset, val_indices
from starter.params_hash import params_fingerprint

PAD, UNKNOWN = 0, 1


class PadTokens:
    """Collate: ``[(tokens [L_i], label), ...] -> (tokens [B, max L_i], labels [B])``."""

    def __init__(self, pad_id: int = PAD) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: list[tuple[torch.Tensor, int]]):
        tokens = torch.nn.utils.rnn.pad_sequence(
            [t for t, _ in samples], batch_first=True, padding_value=self.pad_id
        )
        return tokens, torch.tensor([label for _, label in samples])


class TokenSequences(Dataset):
    def __init__(self, sequences: list[torch.Tensor], labels: torch.Tensor) -> None:
        self.sequences, self.labels = sequences, labels

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.sequences[i], int(self.labels[i])


def make_sequences(n: int, vocab: int, classes: int, lengths: tuple[int, int], seed: int):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    band = (vocab - 2) // classes
    sequences = []
    for label in labels.tolist():
        length = int(torch.randint(lengths[0], lengths[1] + 1, (), generator=g))
        anywhere = torch.randint(2, vocab, (length,), generator=g)
        in_band = 2 + label * band + torch.randint(0, band, (length,), generator=g)
        sequences.append(torch.where(torch.rand(length, generator=g) < 0.5, in_band, anywhere))
    return TokenSequences(sequences, labels)


class SyntheticSequences(SampleData):
    """Config ``_target_`` for conf/dataset/sequences.yaml."""

    augment = True

    def __init__(
        self,
        num_train: int = 1024,
        num_test: int = 256,
        vocab_size: int = 32,
        num_classes: int = 4,
        min_len: int = 4,
        max_len: int = 24,
        token_dropout: float = 0.1,
        data_seed: int = 1234,
        val_fraction: float = 0.1,
        collate: PadTokens | None = None,
    ) -> None:
        if not 1 <= min_len <= max_len or (vocab_size - 2) < num_classes or num_classes < 2:
            raise ReprotrainError(
                "dataset: need 1 <= min_len <= max_len, num_classes >= 2 and "
                "vocab_size >= num_classes + 2"
            )
        self.num_classes, self.collate = num_classes, collate
        self.token_dropout, self.val_fraction = token_dropout, val_fraction
        self.params = dict(
            num_train=num_train, num_test=num_test, vocab_size=vocab_size,
            num_classes=num_classes, min_len=min_len, max_len=max_len, data_seed=data_seed,
        )  # fmt: skip

    def splits(self) -> Splits:
        p = self.params
        args = (p["vocab_size"], p["num_classes"], (p["min_len"], p["max_len"]))
        train = make_sequences(p["num_train"], *args, seed=p["data_seed"])
        test = make_sequences(p["num_test"], *args, seed=p["data_seed"] + 1)
        tr, va = val_indices(len(train), self.val_fraction)
        val = Subset(train, va) if len(va) else None
        return Splits(Subset(train, tr), val, test, self.num_classes)

    def transform(self, sample: tuple[torch.Tensor, int], train: bool):
        tokens, label = sample
        if train and self.token_dropout:
            tokens = tokens.masked_fill(torch.rand(len(tokens)) < self.token_dropout, UNKNOWN)
        return tokens, label

    def fingerprint(self) -> dict:
        return params_fingerprint("sequences", 1, **self.params)
