"""Two models that compute the same thing with different modules between the same neighbours: A applies a GELU
module after fc; B a Dropout module (inactive in eval) and then the functional GELU. Their outputs of that shape
pair by order (act with drop), and differ, though nothing after them does."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

V, D = 32, 16


class GeluModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.fc = nn.Linear(D, 4 * D)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * D, D)
        self.head = nn.Linear(D, V)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)  # (B, T, D)
        return self.head(x + self.proj(self.act(self.fc(x))))


class DropoutThenFunctionalGelu(GeluModule):
    def __init__(self):
        super().__init__()
        del self.act
        self.drop = nn.Dropout(0.1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        return self.head(x + self.proj(F.gelu(self.drop(self.fc(x)))))
