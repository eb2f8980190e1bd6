"""The model sources a config can name: each `source:` value is one `Source` row in SOURCES, and everything that
lists the sources reads this table. The config's `model:` section is validated as the source's config class, chosen
by its `source:` key through the table (schema.py); load_model dispatches to the row's loader
(fwdcheck/model/sources/); `fwdcheck init` offers the rows' starter configs and its `--source` help lists them; and
`fwdcheck shrink` follows the row's rules (fwdcheck/model/sources/shrink.py).

The table sits in the config layer, below the loaders, because a config file is validated through it; as the check
registry (registry.py) names checks, a row names the code of the layers above as 'module:name' strings, imported
when used, so the table is read without torch or pydantic: `fwdcheck --help` reads it for `init --source`'s help.

Adding a source is one module (its config class, a ModelSpec with a `source: Literal["name"]` field and
`resolve_paths` / `files_read` if it names files; its loader, turning that class and the Config into a
ModelUnderTest) and its row here: a config file naming it validates, load_model loads it; with a starter config,
`init` offers it; with rules (a torch-free function, as shrink.py's), `shrink` shrinks it. tests/test_source_seam.py
adds one so.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fwdcheck.config import templates


@dataclass(frozen=True)
class Source:
    """One `source:` a config can name. What it refers to is a 'module:name' string, imported when used (or the object
    itself, for a source defined where it is registered)."""

    name: str  # the `source:` value
    spec: str | type  # its config class: a subclass of fwdcheck.config.schema.ModelSpec
    loader: str | Callable[..., Any]  # (spec, config) -> ModelUnderTest, importing torch itself
    template: str | None = None  # the model section of its starter config; None: `fwdcheck init` does not offer it
    shrink: str | Callable[..., Any] | None = None  # shrink.py's `(Original) -> (model section, Edits)`; None: no rules


def resolve(reference: str | Any) -> Any:
    """What a record refers to: a 'module:name' string imported now, or the object itself."""
    return pkgutil.resolve_name(reference) if isinstance(reference, str) else reference


# Every source, by its `source:` value, in the order `fwdcheck init` lists them. transformers and safetensors are
# imported by the hf and checkpoint loaders themselves, when they run; the shrink rules import no torch.
SOURCES: dict[str, Source] = {
    source.name: source
    for source in (
        Source(
            "reference",
            spec="fwdcheck.config.schema:ReferenceModel",
            loader="fwdcheck.model.sources.reference:load_reference",
            template=templates.REFERENCE,
            shrink="fwdcheck.model.sources.shrink:shrink_reference",
        ),
        Source(
            "python",
            spec="fwdcheck.config.schema:PythonModel",
            loader="fwdcheck.model.sources.python:load_python",
            template=templates.PYTHON,
            shrink="fwdcheck.model.sources.shrink:shrink_factory",
        ),
        Source(
            "hf",
            spec="fwdcheck.config.schema:HFModel",
            loader="fwdcheck.model.sources.hf:load_hf",
            template=templates.HF,
            shrink="fwdcheck.model.sources.shrink:shrink_hf",
        ),
        Source(
            "checkpoint",
            spec="fwdcheck.config.schema:CheckpointModel",
            loader="fwdcheck.model.sources.checkpoint:load_checkpoint",
            template=templates.CHECKPOINT,
            shrink="fwdcheck.model.sources.shrink:shrink_factory",  # the same factory, randomly initialised
        ),
    )
}
