"""A model whose module reads RANK as it is imported, as some training code does: a rank imports the model's code
after it has its RANK, as a spawned rank would, whatever process it was forked from (tests/test_distributed.py)."""

from __future__ import annotations

import os

from tests.distributed_models import GPT, RankServer, gpt, tensor_parallel

__all__ = ["RankServer"]  # a check a config names from the model's module, which the launcher then imports

RANK_AT_IMPORT = os.environ.get("RANK")


def gpt_reading_rank_at_import() -> GPT:
    if RANK_AT_IMPORT is None:
        raise RuntimeError("the model's module was imported before this process had its RANK")
    return gpt()


def parallelize(model: GPT, mesh) -> GPT:
    return tensor_parallel(model, mesh)
