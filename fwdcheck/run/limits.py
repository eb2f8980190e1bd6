"""The time limit of a check: SIGALRM interrupts a block that runs past it with CheckTimeout, keeping any timer the
code around the run uses, and says whether the block was waiting in one of torch.distributed's collectives (a rank
waiting for another)."""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager


class CheckTimeout(BaseException):
    """Raised inside a check that ran past its time limit. A BaseException, so that a model's own
    `except Exception` cannot swallow it."""

    def __init__(self, seconds: float, interrupted=None):
        super().__init__(seconds)
        self.seconds = seconds
        self.in_collective = _in_collective(interrupted)


def _in_collective(frame) -> bool:
    """Whether the frame a time limit interrupted is torch's code, called by torch.distributed's (a collective, a
    DTensor's redistribution, a functional collective's wait): this process waited for another rank. The calls
    are followed out from the interrupted frame for as long as they are torch's own; model code ends the search."""
    import torch

    root = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    distributed = os.path.join(root, "distributed") + os.sep
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        if os.path.abspath(frame.f_code.co_filename).startswith(distributed):
            return True
        frame = frame.f_back
    return False


# Longer limits (inf included) are no limit: setitimer cannot count them on every platform (OverflowError).
_LONGEST_LIMIT = 1e8  # seconds, three years


_SOON = 1e-4  # seconds: an enclosing timer whose time ran out during the block fires at once (0 would disarm it)


@contextmanager
def time_limit(seconds: float | None):
    """Interrupt the block after `seconds` with CheckTimeout. It uses SIGALRM, so it works in the main thread of
    a Unix process and reaches Python code (a hung kernel returns control only when it ends); elsewhere no limit.

    A process has one such timer, and the code around the run may be using it (pytest-timeout's signal method, an
    enclosing time_limit). That timer keeps its deadline: while the block runs, the timer is armed for whichever
    deadline comes first, and when it is the enclosing one's, its handler runs then, as it would have, while the
    block's own limit carries on. An enclosing timer without a Python handler to call fires as soon as the block
    ends. Afterwards it is armed again with the time it had left, its handler back in place."""
    usable = (
        seconds
        and seconds < _LONGEST_LIMIT
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable or seconds is None:  # (usable implies a number)
        yield
        return
    deadline = time.monotonic() + seconds
    previous = signal.getsignal(signal.SIGALRM)
    delay, interval = signal.getitimer(signal.ITIMER_REAL)
    enclosing = time.monotonic() + delay if delay else None  # when the enclosing timer fires next, if it is armed

    def arm():
        due = deadline if enclosing is None or not callable(previous) else min(deadline, enclosing)
        signal.setitimer(signal.ITIMER_REAL, max(due - time.monotonic(), _SOON))

    def expire(signum, frame):
        nonlocal enclosing
        if enclosing is not None and enclosing < deadline and callable(previous):  # the enclosing timer's turn
            enclosing = enclosing + interval if interval else None
            arm()
            previous(signum, frame)
            return
        raise CheckTimeout(seconds, frame)

    signal.signal(signal.SIGALRM, expire)
    try:
        arm()
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        # a handler installed outside Python (getsignal says None) cannot be put back; the default is the nearest
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        if enclosing is not None:
            signal.setitimer(signal.ITIMER_REAL, max(enclosing - time.monotonic(), _SOON), interval)
