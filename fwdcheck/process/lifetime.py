"""A process fwdcheck starts must not outlive the one that started it: the worker its supervisor, a rank its
launcher. Killed with SIGKILL, a parent cannot end its children itself."""

from __future__ import annotations

import os
import signal
import threading

from fwdcheck.errors import ExitCode


def die_with_parent(parent: int) -> None:
    """End this process when `parent` dies: on Linux the kernel sends SIGKILL when the parent dies; elsewhere a
    watcher thread notices the parent is gone."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0:
            if os.getppid() != parent:  # it died before the request took effect
                os._exit(ExitCode.INTERRUPTED)
            return
    except (OSError, AttributeError):
        pass

    def watch():
        while os.getppid() == parent:
            threading.Event().wait(0.5)
        os._exit(ExitCode.INTERRUPTED)

    threading.Thread(target=watch, daemon=True, name="fwdcheck-parent-watch").start()
