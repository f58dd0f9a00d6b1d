"""Sequence classifier: embedding, one GRU, a linear head on the last real token.

Input ``tokens [B, L]`` padded with ``pad_id`` at the end (``sequences.PadTokens``). The
GRU runs over the padding too, but reads its output at each sequence's last real token: a
forward GRU's state there does not depend on what follows, so the padding length of a batch
(or of a micro-batch of it) changes nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class TokenGRU(nn.Module):
    def __init__(
        self, vocab_size: int, embed_dim: int, hidden: int, num_classes: int, pad_id: int = 0
    ) -> None:
        super().__init__()
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_id)
        self.gru = nn.GRU(embed_dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, tokens: Tensor) -> Tensor:
        lengths = (tokens != self.pad_id).sum(1).clamp(min=1)
        out, _ = self.gru(self.embed(tokens))  # [B, L, hidden]
        last = out[torch.arange(len(tokens), device=tokens.device), lengths - 1]
        return self.head(last)
