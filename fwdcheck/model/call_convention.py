"""What to do when a model's forward does not fit fwdcheck's call (`model(input_ids)` -> logits [B, T, V]): the
`forward:` adapter, said in one place for every model-raised finding (errors.Own.MODEL_RAISED) of a call convention
and for `fwdcheck explain` of that code.

A call convention is the model's way of being called, not a bug: a forward that needs another argument (a cache, a
mask), returns a dict under another key than `logits`, or returns something else around the logits. The adapter is a
function of the user's that makes the call and returns the logits; a config names it as `model.forward`.
"""

from __future__ import annotations

import re

from fwdcheck.errors import Own

ADAPTER_EXAMPLE = "def logits(model, input_ids, position_ids=None):\n    return model(input_ids)['out']"


def adapter_hint(call: str = "model(input_ids)[...]") -> str:
    """The fix, to end a model-raised finding of a call convention: the config's `forward:` adapter, its two lines
    with `call` in them."""
    return (
        "; name a `forward:` adapter in the config that makes the call and returns the logits, e.g. `forward: "
        f"'my_module:logits'` beside `def logits(model, input_ids, position_ids=None): return {call}` "
        f"(`fwdcheck explain {Own.MODEL_RAISED}`)"
    )


def call_for(exc: BaseException) -> str:
    """The call an adapter would make for a forward that needs an argument: `model(input_ids, cache=...)`."""
    needed = re.findall(r"'(\w+)'", str(exc)) if "missing" in str(exc) else []
    return f"model(input_ids, {', '.join(f'{n}=...' for n in needed)})" if needed else "model(input_ids, ...)"


# TypeError of a call that does not fit the forward's signature, as Python words it
_SIGNATURE = re.compile(
    r"forward\(\) (missing \d+ required (positional|keyword-only) arguments?|got an unexpected keyword argument|"
    r"takes \d+ positional arguments? but \d+ (were|was) given)"
)


def is_call_convention(exc: BaseException | None) -> bool:
    """A TypeError saying the call does not fit forward's signature (an argument it needs, one it does not take)."""
    return isinstance(exc, TypeError) and bool(_SIGNATURE.search(str(exc)))


FIX = f"""When the model raised, the message names the line of model code that raised: fix the model there, or the \
config (sizes, dtype) if the model is right. When the call does not fit the model (a forward that needs another \
argument, such as a cache or a mask; a dict under another key than `logits`; a tuple whose first item is not the \
logits; only the last position, nanoGPT-style), write a forward adapter: a function that calls the model as it is \
meant to be called and returns the logits [B, T, V] for every position, and name it in the config as \
`model.forward: 'my_module:logits'` (a module beside the config):

{ADAPTER_EXAMPLE}

A dict with a `logits` key, an object with `.logits` (Hugging Face) and a tuple whose first item is the logits work \
without one."""
