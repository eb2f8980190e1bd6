"""Imported by the fork server that a distributed run's ranks are forked from (multiprocessing's, preloaded with
fwdcheck.process.launch.RANK_PRELOAD), and meant for it alone: importing it ties the importing process's life to
its parent's, here the launcher that started the server. (A server forked from the launcher, on the CPU, is tied to it
before it imports anything.)

Each rank dies with the server, its parent (lifetime.die_with_parent), and the server stays while any rank lives
(each holds the server's alive pipe), so a launcher killed with SIGKILL would otherwise leave both behind."""

from __future__ import annotations

import os

from fwdcheck.process.lifetime import die_with_parent

die_with_parent(os.getppid())
