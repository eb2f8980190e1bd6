"""torch's global default device, read and put back the same way on every torch fwdcheck supports (>= 2.5).

`torch.set_default_device(d)` installs a global default; `with torch.device(d):` a block around some code. Whoever
puts back what model code changed needs the global one alone, and `torch.get_default_device()` cannot say it on every
torch: on 2.5 it ignores a `with torch.device()` block but raises AttributeError after `set_default_device(None)`
(it reads `.device` off the None that call leaves), and from 2.6 on it answers the innermost block, which, put back
with set_default_device, would install the block's device (meta, say) for good. So the global is read where
set_default_device writes it, a thread-local that every torch of the range keeps under the same name.
"""

from __future__ import annotations

import torch


def global_default_device() -> torch.device | None:
    """The device torch.set_default_device installed in this thread; None when there is none (tensors then go to
    the CPU, or where an enclosing `with torch.device()` block says)."""
    holder = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
    context = getattr(holder, "device_context", None)
    if holder is None:  # a torch that moved the global: its public reader, where no block can confuse it
        device = torch.get_default_device()
        return None if device == torch.device("cpu") else device
    return None if context is None else context.device


def set_global_default_device(device: torch.device | None) -> None:
    """Puts back what global_default_device read: None removes the global default."""
    torch.set_default_device(device)
