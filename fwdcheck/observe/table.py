"""The kernel table: which attention functions and kernels the observer reads, and the reader of each, in the
spirit of transformers' ALL_ATTENTION_FUNCTIONS. One module per kernel family (fwdcheck/observe/kernels/) registers
its rows here as it is imported; the dispatcher looks a call up here and names no kernel itself.

Two kinds of row, one table:

- a reader, keyed by the torch function it reads (F.scaled_dot_product_attention, a higher-order operator) or by the
  qualified name of a custom op ("flash_attn::_flash_attn_forward"): called as reader(observer, func, args, kwargs)
  in place of the op, it runs the op (observer.plain), records what it read (observer.record) and returns the op's
  result;
- a wrapper, keyed by a name of its own: for calls no torch function mode sees (a CUDA extension's function looked
  up at call time, transformers' registry of attention functions), a context manager factory wrapper(observer)
  entered for the whole observation pass, which puts back what it wrapped on exit.

Free of torch: a row is a key and a function.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

# (observer, func, args, kwargs) -> the op's result. The observer is the dispatcher (dispatcher.Observer).
Reader = Callable[[Any, Any, tuple, dict], Any]
# observer -> a context manager that wraps calls for as long as the observation pass runs
Wrapper = Callable[[Any], AbstractContextManager]


class KernelTable:
    """The rows: readers by the function or custom-op name they read, wrappers by name, in registration order."""

    def __init__(self) -> None:
        self.readers: dict[Any, Reader] = {}
        self.wrappers: dict[str, Wrapper] = {}

    def reader(self, *keys: Any) -> Callable[[Reader], Reader]:
        """Registers the decorated function as the reader of each key: a torch function, or a custom op's qualified
        name. A key that is None (a function this torch does not have) is passed over; a key that already has a
        reader is refused, naming both."""

        def register(function: Reader) -> Reader:
            for key in keys:
                if key is None:
                    continue
                if key in self.readers:
                    raise ValueError(f"{key!r} already has a reader: {_name(self.readers[key])}, not {_name(function)}")
                self.readers[key] = function
            return function

        return register

    def wrapper(self, name: str) -> Callable[[Wrapper], Wrapper]:
        """Registers the decorated context manager factory under `name`, entered for every observation pass."""

        def register(function: Wrapper) -> Wrapper:
            if name in self.wrappers:
                raise ValueError(f"{name!r} already has a wrapper: {_name(self.wrappers[name])}, not {_name(function)}")
            self.wrappers[name] = function
            return function

        return register

    def remove(self, *keys: Any) -> None:
        """Takes out the rows of these keys (readers' keys or wrappers' names); a key without a row is no error."""
        for key in keys:
            self.readers.pop(key, None)
            if isinstance(key, str):
                self.wrappers.pop(key, None)


def _name(function: Any) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


KERNELS = KernelTable()
