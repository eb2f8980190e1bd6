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


class NaNOut(GeluModule):
    """A model whose weights are NaN from the first layer on: every output after the embedding is NaN."""

    def __init__(self):
        super().__init__()
        with torch.no_grad():
            self.fc.weight.fill_(float("nan"))


class MaskedScores(GeluModule):
    """A float causal mask (0 / -inf) as a module output, the same in any two copies: an Inf that is a value."""

    def __init__(self):
        super().__init__()
        self.mask = CausalMask()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)  # (B, T, D)
        scores = x @ x.transpose(1, 2) + self.mask(input_ids.shape[1])  # (B, T, T)
        return self.head(x + self.proj(self.act(self.fc(scores.softmax(-1) @ x))))


class CausalMask(nn.Module):
    def forward(self, length: int) -> torch.Tensor:
        return torch.full((length, length), float("-inf")).triu(1)  # (T, T)


class InfLogits(GeluModule):
    """Logits of +Inf everywhere, in any copy."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * float("inf")


class MaskedVocabulary(GeluModule):
    """Logits of -inf on the vocabulary entries from `first_masked` on (a vocabulary padded past what the model emits),
    and at every entry of position `dead` when it is given (a position with nothing left to predict). `shift` is
    added to the finite entries: a change behind the mask that a comparison must still see."""

    def __init__(self, first_masked: int = 24, shift: float = 0.0, dead: int | None = None):
        super().__init__()
        self.first_masked, self.shift, self.dead = first_masked, shift, dead

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = super().forward(input_ids) + self.shift  # (B, T, V)
        logits[..., self.first_masked :] = float("-inf")
        if self.dead is not None:
            logits[:, self.dead] = float("-inf")
        return logits
