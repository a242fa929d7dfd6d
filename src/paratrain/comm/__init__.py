"""Collective schedules (pure data), the point-to-point executor and a simulator.

Pure, torch-free: :mod:`~paratrain.comm.schedule` (data types), :mod:`~.algorithms`
(``build(op, algorithm, p, n)``), :mod:`~.cost` (``count``, ``time_s``),
:mod:`~.simulator` (numpy). Needs torch: :mod:`~.executor` and :mod:`~.api`
(``all_reduce``, ``reduce_scatter``, ``all_gather``, ``broadcast``, ``reduce``,
``all_to_all``, ``topk_all_reduce``), imported lazily here so that importing
``paratrain.comm`` stays torch-free.
"""

from paratrain.comm.algorithms import ALGORITHMS, build
from paratrain.comm.cost import Counts, count, time_s
from paratrain.comm.schedule import COPY, REDUCE, CollectiveSchedule, Transfer, chunk_sizes

_API = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all",
        "topk_all_reduce", "CollectiveCounts", "PendingCollective")

__all__ = ["ALGORITHMS", "COPY", "REDUCE", "Counts", "CollectiveSchedule", "Transfer", "build",
           "chunk_sizes", "count", "time_s", *_API]


def __getattr__(name: str):
    if name in _API:
        from paratrain.comm import api

        return getattr(api, name)
    raise AttributeError(f"module 'paratrain.comm' has no attribute {name!r}")
