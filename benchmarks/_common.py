"""Measuring conventions shared by the side-by-side benchmarks (data_parallel.py,
fsdp_tp.py), so every comparison times and weighs runs the same way:

- every run is a fresh set of gloo processes (one intra-op thread each, set by
  :func:`paratrain.parallel.process_groups.spawn`), so a rank's peak RSS belongs to one
  implementation;
- a run takes ``warmup`` untimed steps, then ``steps`` timed ones, each timed step
  starting after a barrier; a run's step time is the slower rank's median;
- peak memory is the process's peak resident set size (``ru_maxrss``), per rank;
- the torch baselines take the same AdamW recipe as paratrain (``build_adamw``:
  foreach=False, no decay on gains; clip by the global norm; ``set_lr``).
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

import torch


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MB (Linux: ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_steps(step: Callable[[int], object], warmup: int, steps: int
                ) -> tuple[list[float], list[object]]:
    """Run ``step(k)`` for k in [0, warmup + steps), a barrier before each; return the
    seconds of the timed steps (after the warm-up) and every step's return value."""
    times, outs = [], []
    for k in range(warmup + steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        outs.append(step(k))
        dt = time.perf_counter() - t0
        if k >= warmup:
            times.append(dt)
    return times, outs


def torch_step(loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               opt: torch.optim.Optimizer, clip: Callable[[], object], grad_scale: float,
               loss_context: Callable[[], AbstractContextManager] = nullcontext):
    """One optimizer step of a torch baseline, as ``step(x, y, tokens, lr) -> loss sum``:
    ``loss_sum(x, y)`` (this rank's summed token losses) times ``grad_scale / tokens``
    -> backward -> ``clip()`` -> AdamW step. ``tokens`` is the global token count;
    ``grad_scale`` undoes the wrapper's averaging over data ranks (DDP, FSDP2: their
    world). ``loss_context`` wraps loss and backward (tensor parallel's
    ``loss_parallel``). Returns the detached loss sum (a DTensor under loss_parallel)."""
    from paratrain.parallel.optim import set_lr

    def step(x, y, tokens, lr):
        with loss_context():
            loss = loss_sum(x, y)
            (loss * (grad_scale / tokens)).backward()
        clip()
        set_lr(opt, lr)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def alternate(impls: list[str], rounds: int, rotate: bool) -> Iterator[tuple[int, str]]:
    """(round, impl) in run order: every impl once per round; ``rotate`` starts round r
    at impl r (so no impl always runs first), else the order is the same every round."""
    for rnd in range(rounds):
        k = rnd % len(impls) if rotate else 0
        for impl in impls[k:] + impls[:k]:
            yield rnd, impl


def median_of(records: list[dict], impl: str, key: Callable[[dict], float]) -> float:
    """Median over an impl's runs of ``key(record)``."""
    return statistics.median(key(r) for r in records if r["impl"] == impl)
