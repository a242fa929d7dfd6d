"""paratrain's all-to-all with variable splits, written over point-to-point messages.

The token exchange of expert parallelism (:class:`paratrain.parallel.expert.
ExpertExchange`, ``--collectives ours``) moves uneven row counts between every pair of
ranks; this is the pairwise exchange that does it with ``isend`` / ``irecv`` only, so
that what crosses the wire is paratrain's own schedule, not a library collective.

Rank r's input rows are split by ``in_splits`` (rows for rank 0, 1, ...), its output by
``out_splits`` (rows from rank 0, 1, ...). Each pair of ranks carries at most one
message each way per call, so gloo's per-pair, per-tag ordering matches every send with
its receive whatever the order of posting, and successive calls stay in order because
each rank posts them in call order. What the order does decide is which transfers the
event loops start first:

- Partners (:func:`partners`): for power-of-two p, round s pairs r with r xor s, so both
  ends of a pair post their two transfers in the same round (the pairwise exchange's xor
  pairing in Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
  Operations in MPICH"); otherwise r sends to r + s and receives from r - s (mod p),
  the order of gloo's own ``alltoallv`` (which also posts every round before waiting,
  from its C++ worker thread). Every rank posts its send before its receive in each
  round: letting the lower rank of an xor pair post its receive first (so that the
  receive's announcement, which gloo's TCP transport waits for, leaves first) measured
  1.65-1.75 ms against 1.10-1.13 ms at p 4, 1 MiB, on the quiet 2-core machine.
- Every round is posted before any is waited, so the p - 1 rounds overlap on the wire
  (waiting round by round ran at 0.3-0.5x gloo's own at p 2 and 4). The waits go in
  reverse order of posting: the last-posted receive is usually the last to land, so the
  thread sleeps about once instead of once per message (each wake-up is a scheduler slice
  on an oversubscribed machine).
- No staging: sends are contiguous row views of the input (``split_with_sizes``),
  receives land in the output's own row slices. Empty pieces are not sent (both ends
  know the sizes). The local piece is copied first, before anything is posted, as
  gloo's own ``alltoall`` does (copied after posting, it competes for a core with the
  event loop's socket copies); in the same processes, the turns cycling through every
  order, that was ahead of copying after posting at 11 of 18 (p, size) points, by at most
  0.08 of gloo's rate (docs/expert-parallel.md: an earlier rotating comparison that said
  29 of 33 favoured whichever variant ran second).
- Messages go straight to the group's ``ProcessGroup.send`` / ``recv`` with group ranks:
  ``dist.isend``'s Python wrapper (group checks, rank translation) cost more per message
  than the message's own posting, and on 2 shared cores every microsecond of a rank's CPU
  is a microsecond its peers' transfers wait for a core.

Speed, of gloo's ``all_to_all_single`` per call, each into an output allocated once and
timed after a call of its own kind, the benchmark's medians over two invocations on the
2-core machine: level at 4 MiB per rank for p 2, 4 and 8 (0.96-1.02x; strictly
alternating 0.96-1.05x); at 1 MiB 1.06-1.44x at p 4, 0.91-1.02x at p 2, 0.76-0.87x at p
8 (docs/expert-parallel.md, "Expert-parallel exchange vs PyTorch", which also shows how
a fresh output per call timed the allocator instead). The gap at p 8 and 1 MiB is the
same messages, posted from Python instead of gloo's C++ worker thread, which costs each
rank about 14 us more CPU per message at p 8 (process CPU time per call, 1.15 against
0.95 ms at 1 MiB). Most of that is not Python but gloo's TCP event loop (2026-12-05, p
8, tiny pieces, calls back to back; per-thread CPU from ``/proc/self/task``, syscalls
counted with ``perf stat``): its thread spent 0.8 ms a call under ours against 0.5 ms
under gloo's own, and called ``epoll_wait`` about 850 times a call against 525, for
about 40 reads either way. A pair's event handler only try-locks the pair; while the
posting thread holds that lock (each post writes a notice to the peer, and the wake-up
it causes can preempt the poster before it unlocks) the loop polls the same ready socket
again, and a post from Python holds the pairs busy longer (about 17 us of CPU per post).
Orders tried against gloo's in the same processes moved the ratio by less than the runs'
noise: gloo's shift order, all sends before all receives and all receives first (each
also timed after its own kind at p 8: behind at 6 of 6 points), the backend's ``send`` /
``recv`` without the dispatcher, prebuilt argument lists, posting and waiting from a
persistent helper thread as gloo's worker thread does (behind at 10 of 18 points),
``os.sched_yield()`` before posting; a two-phase (2 x 4, 4 x 2) exchange with half the
messages took 1.3-3x as long (two waits in a row).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def partners(p: int, rank: int) -> list[tuple[int, int]]:
    """(send to, receive from) group ranks for rounds 1..p-1 (module docstring)."""
    if p & (p - 1) == 0:
        return [(rank ^ s, rank ^ s) for s in range(1, p)]
    return [((rank + s) % p, (rank - s) % p) for s in range(1, p)]


def all_to_all(out: torch.Tensor, x: torch.Tensor, out_splits: list[int],
               in_splits: list[int], rank: int, group=None) -> int:
    """Fill ``out`` (rows from each rank, ``out_splits``) from every rank's ``x`` (rows
    for each rank, ``in_splits``). ``x`` and ``out`` are contiguous; ``rank`` is this
    rank's index in ``group`` (None: the world). Returns the bytes this rank sent (what
    went to other ranks: the counters' ground truth)."""
    pg = group if group is not None else dist.group.WORLD
    sends, recvs = x.split_with_sizes(in_splits), out.split_with_sizes(out_splits)
    recvs[rank].copy_(sends[rank])
    works, sent = [], 0
    for dst, src in partners(len(in_splits), rank):
        if in_splits[dst]:
            works.append(pg.send([sends[dst]], dst, 0))
            sent += sends[dst].nbytes
        if out_splits[src]:
            works.append(pg.recv([recvs[src]], src, 0))
    for w in reversed(works):
        w.wait()
    return sent
