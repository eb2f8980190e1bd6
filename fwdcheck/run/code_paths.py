"""The matrix of code paths a model offers, for the checks whose bugs hide on paths a default run never takes.

Leaks that reached users lived on an eager fallback used only when attention weights are requested, a mask dropped
when nothing is padded, a kernel chosen for batch size 1, a fast path in eval. So the checks that declare
`per_code_path = True` (future-token and mask-audit among the built-ins) run once more per cell of: attention
implementation x output_attentions x attention_mask (absent / all ones / left padding) x batch size, each cell a view
of the same model whose forward applies that path, and each cell is reported.

The train path is one more cell, for every source (train_cell): the model in train() mode with every dropout forced
to zero and gradients recorded (fwdcheck/run/train_path.py), as a training job runs it, since model code branches on
`self.training` and `torch.is_grad_enabled()` whatever built it. The per-path checks judge it like any other cell,
and its logits must be the eval path's on the same tokens (future-token holds them to its own bar, and names the
first module where they part). Where the default run ran two rows of its short length alone on the eval path (the
prefix and the single row of future-token, at inputs.seq_len 64 and up), the cell runs on those rows and is held to
their logits, which cost it no forward: one train-mode forward then takes the default path's pass (see below). A
model that records no gradients on some kernel runs the cell without them, and the cell says so; one that cannot run
in train mode at all skips it, saying why.

What a cell costs. The default run already ran every check at the full length on the default path; a cell only has
to show whether its path is wrong, and a path that drops, inverts or misreads a mask does so at any length of a few
tokens. So a cell is one code path at one short shape (CELL_LENGTH tokens, or what the config and the model allow),
with one session shared by every per-path check of the cell: the observation pass and the baseline are computed once
per cell, not once per check and cell. A cell runs no forward shorter than its own length (its session's
min_seq_len is the cell's length), so passes at other lengths, such as future-token's prefix ladder, stay with the
default run. benchmarks/matrix_cost.py prints what each cell costs.

Cells that take the same code path share a verdict. Every cell runs its own observation pass; when it saw exactly what
an earlier cell's pass saw on the same tokens (the same modules called in the same order with the same shapes, the
same attention calls with the same masks, the same dropout calls, and bitwise the same logits: `path_signature`),
the two paths computed the same thing on those tokens, and the cell takes the earlier cell's verdict instead of
running its comparisons again (on Hugging Face models, `mask ones` usually builds the mask `mask absent` builds, and
`output_attentions` changes nothing on the eager path). A path bug changes what its cell's pass sees (a mask dropped
or ignored, an eager fallback instead of SDPA, another kernel for one row), so it is never shared away.

Cells that compute the same logits share the verdict of a check that judges logits alone. future-token judges a
cell by what its logits do when tokens change, and says so (`verdict_from_logits = True`): a cell whose observed
logits are, within the tolerance future-token itself judges by, those of a cell where it passed on the same tokens
(SDPA against eager, left padding against none on the real tokens, batch size 1 against the first row of a larger
batch: the cells run the larger batch first and draw the same tokens) takes that pass. A path that reads a future
token, a pad or another sample computes other logits from the same tokens than a path that does not, by the weight
it gives what it should not read, so such a path runs its comparisons in full and is judged on its own; a failure is
never shared this way. Only the cell's own tokens are compared: the agreement is evidence on them, as future-token's
comparisons are on theirs. The other checks of the cell (mask-audit reads the cell's own observation) still run.

Both rules read the cell's observation pass, which runs under the observer, a torch function mode; a cell that
shares runs no untouched forward. So a model holding torch's own attention modules, whose fast paths step aside
while a torch function mode is active (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder:
`changes_under_observer`), shares nothing: every cell runs its comparisons on untouched forwards. What neither rule
can see is a branch taken only for tokens other than the cell's own inputs, inside the same calls, or model code of
its own that looks at torch function modes: the cell then gets the earlier cell's verdict, which is why its row says
which cell it shares.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from fwdcheck.config.schema import CodePaths
from fwdcheck.model.capabilities import AttentionPattern, Positions
from fwdcheck.model.library_logs import asked_for
from fwdcheck.model.tested import ModelUnderTest, extract_logits
from fwdcheck.observe.records import Observation
from fwdcheck.run.compare import logit_scale, position_change
from fwdcheck.run.session import Session
from fwdcheck.run.settings import Settings

LEFT_PADDING = 3  # pad tokens put before every row in the left-pad cells
# Tokens per row in a cell, unless code_paths.seq_len says otherwise. At eight positions future-token cuts at 1, 4 and 7
# and mask-audit reads the whole 8 x 8 mask: a causal mask dropped, inverted, shifted by one or ignored for the pads
# shows in both. Longer cells cost tokens in proportion and find nothing more of what differs between paths; what
# needs length (a window, a chunk) is checked on the default path at inputs.seq_len.
CELL_LENGTH = 8
# Implementations that run only when code_paths.attn_implementation names them, and then on fewer cells: every
# attention mask, but without output_attentions=True and at the larger batch size only. flex_attention computes no
# attention weights (asking for them switches to no path of its own), and picking a kernel by batch size is SDPA's
# habit, not flex's; its BlockMask is built from the attention mask, which every mask cell still varies. Not by
# default: on CPU, transformers refuses it for several architectures that claim it (attention sinks: gpt_oss,
# granite_swa, flint; a sub-model without it: fuyu), and its cells are the dearest there, where it runs unfused.
NARROW = frozenset({"flex_attention"})


@dataclass(frozen=True)
class CodePath:
    attn_implementation: str | None  # None: whatever the model uses
    output_attentions: bool | None  # None: not passed
    attention_mask: str  # absent | ones | left-pad
    batch_size: int
    train: bool = False  # the train path: train() mode, dropout zeroed, gradients on (fwdcheck/run/train_path.py)
    image: bool = False  # the image run: an image held fixed before the tokens under test (fwdcheck/run/image_run.py)

    @property
    def label(self) -> str:
        parts = ["train mode"] if self.train else []
        parts += ["with an image"] if self.image else []
        parts += [self.attn_implementation or "default attention", f"mask {self.attention_mask}"]
        if self.output_attentions is not None:
            parts.append(f"output_attentions={self.output_attentions}")
        parts.append(f"B={self.batch_size}")
        return ", ".join(parts)

    @property
    def padding(self) -> int:
        """Pad tokens the cell's forward puts before the real ones."""
        return LEFT_PADDING if self.attention_mask == "left-pad" else 0


def path_cells(model: ModelUnderTest, code_paths: CodePaths, batch_size: int) -> list[CodePath]:
    """Every cell of the matrix, the train path's last (train_cell); only that one when the matrix is off for the
    model (the default for models whose forward does not pick its path by its arguments: model.matrix_by_default),
    none when code_paths.enabled is false."""
    if code_paths.enabled is False:
        return []
    train = [train_cell(batch_size)] if code_paths.train else []
    if not (code_paths.enabled or model.matrix_by_default):
        return train
    return eval_cells(model, code_paths, batch_size) + train


def train_cell(batch_size: int) -> CodePath:
    """The train path: the model's own attention, no mask argument, at the larger batch size. Every source trains,
    and model code branches on self.training and torch.is_grad_enabled() whatever built it. Its tokens are those of
    the eval cell of the same shape, whose logits it must reproduce (where it does, that cell's pass holds here), or,
    when the default run ran rows of the short length alone on the eval path, those rows (rows_ran_alone)."""
    return CodePath(None, None, "absent", max(batch_size, 2), train=True)


def eval_cells(model: ModelUnderTest, code_paths: CodePaths, batch_size: int) -> list[CodePath]:
    """The matrix's cells in eval mode: implementation x output_attentions x attention mask x batch size."""
    offered = list(model.attention.implementations) if model.attention is not None else []
    # A NARROW implementation runs only when code_paths.attn_implementation names it (see NARROW).
    implementations: Sequence[str | None] = (
        code_paths.attn_implementation or [i for i in offered if i not in NARROW] or [None]
    )
    implementations = [i for i in implementations if not offered or i in offered]
    attentions: Sequence[bool | None] = code_paths.output_attentions or (
        [False, True] if model.accepts("output_attentions") else [None]
    )
    masks = code_paths.attention_mask
    if masks is None:
        masks = ["absent"]
        if model.accepts("attention_mask"):
            masks.append("ones")
            if model.accepts_position_ids:  # left padding is only fair when positions can skip the pads
                masks.append("left-pad")
    # Larger batches first: a batch-size-1 cell draws the first row of the larger cell's tokens, whose logits are
    # then there to compare with (see the module docstring).
    batches = sorted(set(code_paths.batch_size or {1, max(batch_size, 2)}), reverse=True)
    cells = [CodePath(*cell) for cell in itertools.product(implementations, attentions, masks, batches)]
    return [c for c in cells if c.attn_implementation not in NARROW or _narrow_cell(c, attentions, batches)]


def _narrow_cell(cell: CodePath, attentions: Sequence[bool | None], batches: list[int]) -> bool:
    """Whether a cell of a NARROW implementation is run: not asked for attention weights (unless only that was asked
    for) and at the larger batch size."""
    plain: list[bool | None] = [a for a in attentions if not a] or list(attentions)
    return cell.output_attentions == plain[0] and cell.batch_size == batches[0]


# The label of the anchor the train path's cell is held to when its rows are ones the default run ran alone.
RAN_ALONE = "the eval path on rows the default run ran alone"


def rows_ran_alone(session: Session, count: int, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`count` rows [count, L] the session ran alone on the eval path, untouched (Session.row_logits: future-token's
    prefix of the short length and its single row), with their logits [count, L, V]; None when it ran fewer, or
    rows shorter than `length`.

    The train path's cell runs on them: where its logits are theirs (within the tolerance future-token judges by),
    the train path computes on those tokens what the eval path computed, and takes the default path's verdict of a
    check that judges logits alone, as a cell does from another (the module docstring says why that holds); the
    eval logits it is held to need no forward of their own. Where they are not, the cell runs its comparisons in full
    on the same rows."""
    found = session.ran_alone[:count]
    if len(found) < count or found[0][0].shape[0] < length:
        return None
    return torch.stack([row for row, _ in found]), torch.cat([logits for _, logits in found])


def runs_per_code_path(check) -> bool:
    """Whether a check asks to run once per cell of the matrix: `per_code_path = True` on its class. Read with a
    default, so that a plugin written before the attribute existed (or not deriving from Check) runs once."""
    return bool(getattr(check, "per_code_path", False))


def verdict_from_logits(check) -> bool:
    """Whether a check's verdict on a cell follows from the cell's logits alone (`verdict_from_logits = True` on its
    class), so that a cell computing the same logits as one it passed on may take that pass."""
    return bool(getattr(check, "verdict_from_logits", False))


def cell_length(settings: Settings, model: ModelUnderTest, cell: CodePath, shortest: int = 1) -> int:
    """The sequence length of a cell's inputs: code_paths.seq_len or CELL_LENGTH, never longer than inputs.seq_len
    nor shorter than the model accepts (`shortest`: the default session's min_seq_len, declared or found out), and
    with the left padding still within the model's positions."""
    wanted = settings.code_paths.seq_len or CELL_LENGTH
    length = min(settings.inputs.seq_len, max(wanted, shortest))
    if model.max_positions:
        held = model.image.prefix_length() if cell.image and model.image is not None else 0
        length = min(length, max(model.max_positions - cell.padding - held, 2))
    return length


def cell_settings(
    settings: Settings, model: ModelUnderTest, cell: CodePath, shortest: int = 1, max_rows: int | None = None
) -> Settings:
    """The settings of one cell's session: the cell's batch size at the cell's length.

    min_seq_len is the cell's length: a cell is one shape, and a check asking for a shorter forward there (a prefix)
    would test another shape than the cell names. max_rows keeps the run's budget in tokens per forward (max_rows
    rows of inputs.seq_len, the run's own session's), so the shorter rows of a cell go through in fewer forwards
    without any forward holding more than the run's (the image run's rows hold the image's ids too)."""
    length = cell_length(settings, model, cell, shortest)
    rows = max_rows or settings.max_rows or max(settings.inputs.batch_size, 2)
    inputs = settings.inputs.model_copy(
        update={"batch_size": cell.batch_size, "seq_len": length, "min_seq_len": length}
    )
    held = model.image.prefix_length() if cell.image and model.image is not None else 0  # the image's ids, each row
    # rows in the run's tokens per forward; never fewer than the cell's batch, which its baseline runs at once
    budget = max(rows * settings.inputs.seq_len // (length + held), cell.batch_size if held else 1)
    return dataclasses.replace(settings.with_config(inputs=inputs), max_rows=budget)


def path_view(model: ModelUnderTest, path: CodePath) -> ModelUnderTest:
    """The same module, with a forward that takes this path. Its logits are those of the real tokens only. The image
    run's cell is the model driven with its image (image_variant 0), through its own forward, so that a check can
    run it on another image (image_variant 1); it counts positions over the image and the text itself."""
    if path.image:
        suffix = model.image.suffix() if model.image is not None else None
        design = model.pattern
        if suffix is not None and design.kind == "bidirectional":  # a prefix-LM whose prefix the token types mark
            design = AttentionPattern("causal", suffix)
        return dataclasses.replace(
            model,
            image_variant=0,
            pattern=design,
            positions=Positions("own", "the image's tokens come first: the model counts positions over them"),
            label=f"{model.label} [{path.label}]",
        )
    padding = path.padding
    pad_id = getattr(getattr(model.module, "config", None), "pad_token_id", None) or 0

    def forward(module, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        B, T = input_ids.shape
        kwargs: dict[str, Any] = {}
        if path.output_attentions is not None:
            kwargs["output_attentions"] = path.output_attentions
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if path.attention_mask == "ones":
            kwargs["attention_mask"] = torch.ones_like(input_ids)
        elif padding:
            pads = torch.full((B, padding), pad_id, dtype=input_ids.dtype, device=input_ids.device)
            input_ids = torch.cat([pads, input_ids], dim=1)  # (B, P + T)
            mask = torch.cat([torch.zeros_like(pads), torch.ones(B, T, dtype=pads.dtype, device=pads.device)], 1)
            kwargs["attention_mask"] = mask
            if position_ids is None:  # as generate() does: real tokens count from 0, pads sit at 1
                position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
            else:
                position_ids = torch.cat([torch.ones_like(pads), position_ids], dim=1)
            kwargs["position_ids"] = position_ids
        asked = asked_for(model.library_loggers, "output_attentions") if path.output_attentions else nullcontext()
        with asked:  # what the library says of the output_attentions this cell passed is not the model's news
            output = (
                model.forward_adapter(module, input_ids, **kwargs)
                if model.forward_adapter
                else model.drive(module, input_ids, **kwargs)
            )
        return extract_logits(output)[:, padding:]  # (B, T, V): the real tokens

    takes = {"position_ids"} if model.accepts_position_ids else set()
    return dataclasses.replace(
        model, forward_adapter=forward, padding=padding, forward_kwargs=takes, label=f"{model.label} [{path.label}]"
    )


def plain_view(model: ModelUnderTest, path: CodePath) -> ModelUnderTest:
    """The same cell without padding: what the left-padded real tokens must reproduce."""
    return path_view(model, dataclasses.replace(path, attention_mask="absent"))


def path_signature(observation: Observation, logits: torch.Tensor | None, inputs: torch.Tensor) -> str | None:
    """A digest of what one cell's observation pass saw: its inputs, every module call, attention call (masks,
    positions, the line of code that made it), product and dropout call in order, and its logits bitwise. Two cells
    with the same digest computed the same thing on the same tokens. None when there is nothing to vouch for: no
    logits kept (dropout live in eval makes them dice) or no values (the meta device)."""
    if logits is None or logits.is_meta or inputs.is_meta:
        return None
    digest = hashlib.blake2b(digest_size=20)

    def feed(value) -> bool:
        """Whether the value could be read into the digest (a tensor on the meta device cannot)."""
        if isinstance(value, torch.Tensor):
            if value.is_meta:
                return False
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            return True
        digest.update(repr(value).encode())
        return True

    records: list[Any] = [*observation.modules, *observation.attention, *observation.matmuls, *observation.dropouts]
    for record in records:
        digest.update(type(record).__name__.encode())
        for item in dataclasses.fields(record):
            if not feed(getattr(record, item.name)):
                return None
    return digest.hexdigest() if feed(inputs) and feed(logits) else None


# torch's own modules whose fast paths step aside while a torch function mode (the observer) is active.
MODE_SENSITIVE = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerEncoder)


def changes_under_observer(model: ModelUnderTest) -> bool:
    """Whether the model holds a module whose code path changes under the observer: its cells then share nothing."""
    return any(isinstance(module, MODE_SENSITIVE) for module in model.module.modules())


def verdicts_for(model: ModelUnderTest) -> Verdicts | None:
    """What the cells of this model's matrix may share, to be filled as they run; None when they may share nothing."""
    return None if changes_under_observer(model) else Verdicts()


@dataclass
class LogitsAnchor:
    """A check that passed on a cell by running in full, with the cell's tokens and the logits it passed on."""

    label: str  # the cell's
    check: str
    result: Any  # its CheckResult there
    inputs: torch.Tensor  # (B, L) token ids
    logits: torch.Tensor  # (B, L, V): the observation pass's, of the real tokens


@dataclass
class SameLogits:
    """A cell's logits found to be an anchor's: by how much they differ, and the bar they were held to."""

    anchor: LogitsAnchor
    difference: float
    tolerance: float


@dataclass
class Verdicts:
    """What the cells run so far vouch for (the module docstring says why each holds): by path_signature, the cell
    that ran that code path in full; and the passes of checks whose verdict follows from logits, with the logits."""

    by_signature: dict[str, Any] = field(default_factory=dict)  # path_signature -> the CellRun
    anchors: list[LogitsAnchor] = field(default_factory=list)

    def same_logits(self, check: str, session: Session, logits: torch.Tensor) -> SameLogits | None:
        """The first anchor of this check whose first rows are this session's tokens and whose logits there are
        this cell's, within the session's logits tolerance; None when there is none."""
        inputs = session.inputs
        B = inputs.shape[0]
        for anchor in self.anchors:
            same_tokens = (
                anchor.inputs.shape[0] >= B
                and anchor.inputs.shape[1:] == inputs.shape[1:]
                and torch.equal(anchor.inputs[:B], inputs)
            )
            if anchor.check != check or not same_tokens or anchor.logits.shape[1:] != logits.shape[1:]:
                continue
            theirs = anchor.logits[:B]  # (B, L, V): the anchor's first B rows, this cell's tokens
            difference = float(position_change(logits, theirs).max())  # inf for NaN: never within the bar
            tolerance = session.tolerance(logit_scale(theirs))
            if difference <= tolerance:
                return SameLogits(anchor, difference, tolerance)
        return None
