"""The rows future-token's comparisons run, drawn once (Plan): per cut position k a sample with its tokens from k on
replaced, the control row (sample 0 unchanged, beside other companions than in the baseline), and the single row run
alone at batch size 1; which cuts run by default, and which rows the first forward holds.
"""

from __future__ import annotations

import torch

from fwdcheck.run.code_paths import path_cells


def default_cuts(T: int) -> list[int]:
    """The first changed position of each cut row, in the order the rows run: k = T-1 (every position against the
    last token), 1 (position 0 against every later token) and T/2 (the first half against the second). The prefix
    ladder adds k = 1, 2 and 16 (up to T/4) at little cost, and the single row one more cut at batch size 1: a leak at
    some other k shows there, or at these three (a mask shifted by one, a window or chunk read both ways: at k = 1 and
    T-1 alike). The first forward holds T-1 and 1 (Plan.screen)."""
    return list(dict.fromkeys(k for k in (T - 1, 1, T // 2) if 1 <= k < T))


class Plan:
    """The rows the comparisons run, drawn once from the session's generator, so that comparing again against
    another reference runs exactly the same tokens.

    Per cut position k, one row keeps a sample's tokens < k and replaces the rest (with --exhaustive, the token at k
    alone). The control row is sample 0 unchanged, beside companions that differ from the baseline's in most
    tokens. With --exhaustive it sits second, sharing its forward with the row that changes token 1 of sample 0
    (beside sample 1 in the baseline); otherwise it runs last, beside the row cut at T/2 (sample 0 again with a
    B of 2), or beside a row of the session's inputs other than its own companions."""

    def __init__(self, model, session, exhaustive: bool):
        B, T = session.inputs.shape
        # The first position a cut is judged at: 1 for a causal model, the prefix's length for a prefix-LM (a cut
        # inside the prefix moves the prefix by design), None for a bidirectional one (the rows still show whether
        # samples read each other).
        self.first = model.pattern.first_causal_position(T)
        self.causal = self.first is not None
        self.exhaustive = exhaustive
        first = self.first or 1
        if self.exhaustive:
            self.cuts = list(range(first, T))
        elif first > 1:  # the prefix's own edge (the prefix blind to what follows), then the later cuts
            self.cuts = list(dict.fromkeys([first] + [k for k in default_cuts(T) if k > first]))
        else:
            self.cuts = default_cuts(T)
        rows, sources = [], []
        for i, k in enumerate(self.cuts):
            sample = i % B
            row = session.inputs[sample].clone()
            if self.exhaustive:  # one token at a time: the map's cell (i, k) is exactly "position i reads token k"
                row[k] = session.random_ids((1,), differ_from=row[k : k + 1])[0]
            else:
                row[k:] = session.random_ids((T - k,), differ_from=row[k:])
            rows.append(row)
            sources.append(sample)
        self.control = min(1, len(rows)) if self.exhaustive else len(rows)
        rows.insert(self.control, session.inputs[0].clone())  # unchanged, beside other companions than in the baseline
        sources.insert(self.control, 0)
        self.rows, self.sources = rows, sources
        cut_rows = [i for i in range(len(rows)) if i != self.control]  # in the order the cuts were drawn
        self.cut_of = dict(zip(cut_rows, self.cuts, strict=True))  # row -> its cut k
        self.cut_rows = sorted(cut_rows, key=lambda row: self.cut_of[row])  # in the order of k
        self.cuts = sorted(self.cuts)
        self.session = session
        self._single: dict[int, torch.Tensor] = {}
        self.single_row_skipped = None  # why the single-row pass does not run, or None
        if B == 1:
            self.single_row_skipped = "not needed: the comparisons above already ran one row beside several"
        elif any(cell.batch_size == 1 for cell in path_cells(model, session.settings.code_paths, B)):
            self.single_row_skipped = "left to the code-path matrix, whose batch-size-1 cells are named as such"

    @property
    def single_row_wanted(self) -> bool:
        return self.single_row_skipped is None

    def screen(self, per_forward: int) -> int:
        """How many rows, from the first, run before the rest is decided on: the first forward's, when the rows
        need more than one and those rows vouch alone (see future_token.py's docstring); else every row."""
        if self.exhaustive or len(self.rows) <= per_forward or per_forward < 2:
            return len(self.rows)
        return per_forward

    def largest_before_cut(self, changes: torch.Tensor) -> float:
        """The largest change of the rows in `changes` (the first rows of the plan) at the positions they compare:
        each cut row's before its cut, the control row's everywhere. inf for NaN."""
        compared = [changes[i, : self.cut_of[i]] if i in self.cut_of else changes[i] for i in range(len(changes))]
        return float(torch.cat(compared).max())

    def single_cut(self, length: int) -> int:
        """Where the single row of `length` tokens is cut: half way, or at the prefix's edge past it."""
        return max(length // 2, self.first or 1)

    def single_row(self, length: int) -> torch.Tensor:
        """Sample 0's first `length` tokens with the later half replaced; drawn once per length."""
        if length not in self._single:
            row = self.session.inputs[0, :length].clone()
            cut = self.single_cut(length)
            row[cut:] = self.session.random_ids((length - cut,), differ_from=row[cut:])
            self._single[length] = row
        return self._single[length]
