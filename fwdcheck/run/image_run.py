"""The image run: a vision-language model's text path run once more with an image held fixed before it.

A model from `source: hf` that takes pixel_values beside its token ids (capabilities.HeldImage, filled in by
fwdcheck/model/sources/vlm_image.py) runs its text path twice: the default run on text alone, as every causal LM, and
one more cell of the code-path matrix with an image: the image's tokens first, the tokens under test after them,
the image's pixels beside them. The checks that run per code path (future-token, mask-audit) judge the cell as any
other: the cuts of future-token lie in the text after the image, mask-audit reads the whole sequence (the image's
block as the model designs it, the text causal over the image and itself), and mask-audit runs the text once more
beside another image, whose logits must move (FWD215 where they do not: the model does not read its image).

Why a cell and not the default run: the image drive puts hundreds of ids before the tokens under test (LLaVA's 576),
which the other checks (rope's probes, the kv-cache's decode, the shape ledger's axes) would have to learn to read
around, while the bugs an image brings (a mask built anew for the merged sequence, features never merged) show in
the logits and masks the per-path checks judge. The cell runs also where the matrix is off (`code_paths.enabled:
false`), unless `code_paths.image: false`: the text path with an image is a path the model takes in every real use.

Finding how the model takes an image runs model code, so it happens here, with the model placed for the run; where
it cannot be driven the text path has run alone and the notes say why no image was drawn.
"""

from __future__ import annotations

import torch

from fwdcheck.errors import ModelRaised
from fwdcheck.model.capabilities import ImageNotDrawn
from fwdcheck.model.tested import ModelUnderTest, model_code
from fwdcheck.run.code_paths import CodePath
from fwdcheck.run.session import Session
from fwdcheck.run.settings import Settings


def image_cell(model: ModelUnderTest, settings: Settings, session: Session) -> CodePath | None:
    """The image run's cell, its image prepared and what was held fixed in the session's notes; None where the
    model takes no image this way, the config turns it off, or the image cannot be drawn (the notes say why)."""
    image = model.image
    if image is None or not settings.code_paths.image or model.forward_adapter is not None:
        return None
    try:
        with model_code("drawing the image raised"), torch.no_grad():
            image.prepare(model.module)
    except ModelRaised as exc:
        cause = exc.__cause__
        why = str(cause) if isinstance(cause, ImageNotDrawn) else str(exc)
        reason = f"no image drawn: {why}; the text path ran alone"
        model.unavailable["image"] = reason
        session.notes.append(reason)
        return None
    session.notes.append(f"held fixed in the image run: {image.description()}")
    return CodePath(None, None, "absent", max(settings.inputs.batch_size, 2), image=True)


def with_image_cell(cells: list[CodePath], image: CodePath | None) -> list[CodePath]:
    """The cells with the image run's before the train path's (which comes last: code_paths.train_cell)."""
    if image is None:
        return cells
    return [*(c for c in cells if not c.train), image, *(c for c in cells if c.train)]
