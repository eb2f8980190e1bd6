"""What a model's library logs while the model runs becomes the run's notes, not lines on stderr ahead of the report.

A model names its library's loggers (ModelUnderTest.library_loggers, filled in by its source: transformers' for a
transformers model). What it says of what fwdcheck itself asked for (transformers' "`sdpa` attention does not support
`output_attentions=True`" when the code-path matrix asks for attentions) is dropped: `asked_for`. Python warnings,
the library's or the model's, are the caller's to collect: the command line makes them notes too.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager


@contextmanager
def kept_as_notes(loggers: tuple[str, ...], notes: list[str]) -> Iterator[None]:
    """What each named logger logs during the block goes into `notes`, each distinct message once. Nested, the
    outermost one keeps the messages: a run's code-path cells have sessions of their own inside the run's. A logger
    whose package is not imported is left alone (nothing of it can log)."""
    with ExitStack() as stack:
        for name in loggers:
            stack.enter_context(_kept(name, notes))
        yield


@contextmanager
def _kept(name: str, notes: list[str]) -> Iterator[None]:
    logger = logging.getLogger(name)  # a library's root logger: its own handler, no propagation
    if name.split(".")[0] not in sys.modules or any(isinstance(h, _NoteHandler) for h in logger.handlers):
        yield
        return
    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [_NoteHandler(name, notes)], False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = handlers, propagate


@contextmanager
def asked_for(loggers: tuple[str, ...], words: str) -> Iterator[None]:
    """During the block, what the named loggers log about `words` is dropped: fwdcheck asked for it (the code-path
    matrix passes output_attentions=True to an sdpa model, and transformers says sdpa does not support it), so it is
    no news about the model. On the handlers, which see the library's child loggers' records too."""
    drop = _Mentioning(words)
    handlers = [handler for name in loggers for handler in logging.getLogger(name).handlers]
    for handler in handlers:
        handler.addFilter(drop)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(drop)


class _Mentioning(logging.Filter):
    def __init__(self, words: str):
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return self.words not in record.getMessage()
        except Exception:  # arguments that do not fit the message: let logging report it
            return True


class _NoteHandler(logging.Handler):
    """Collects log records as notes: each distinct message once, on one line, led by the logger's name."""

    def __init__(self, name: str, notes: list[str]):
        super().__init__()
        self.prefix = f"{name}: "
        self.notes = notes

    def emit(self, record: logging.LogRecord) -> None:
        try:
            note = self.prefix + " ".join(record.getMessage().split())
        except Exception:  # arguments that do not fit the message: logging's own report of it
            self.handleError(record)
            return
        if note not in self.notes:
            self.notes.append(note)
