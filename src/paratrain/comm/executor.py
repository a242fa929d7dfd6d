"""Run a :class:`~paratrain.comm.schedule.CollectiveSchedule` on a process group with isend/irecv.

How one round runs on gloo (the default path):

1. The receives of round j were posted while round j-1 was finishing (so a neighbour
   that races ahead finds a posted receive, not a rendezvous stall); sends of round j are
   posted once round j-1's results they read are final.
2. Every message is cut into pieces of ``piece_bytes``: we wait for piece q, add it into
   its place (or copy it), and meanwhile gloo's I/O threads are moving pieces q+1.. of
   this round and pieces of the next round. That is the segmented pipeline gloo's own
   ring uses; it hides the reduction behind the wire.
3. Forwarding: when the next round re-sends exactly what a receive delivers (the ring:
   the chunk just reduced travels on), each piece goes out as soon as it is final, so
   the pipeline does not drain at round boundaries.

Deadlock avoidance: gloo's send is a rendezvous (it completes only once the peer posted
the matching receive), so a blocking send followed by a receive deadlocks as soon as two
ranks send to each other. Here nothing blocks until every receive and every send of the
round is posted: all ranks can make progress whatever order the peers reach the round
in. Messages between one pair of ranks match in posting order (same tag), and both sides
derive that order from the schedule: by round, then (reduce before copy, first segment).
A peer that never sends (a mismatched schedule, a dead rank) makes ``wait`` time out and
we raise :class:`CommTimeoutError` naming the round, peer and segments: no hang.

Memory: sends read straight from the user's buffer (slices of a contiguous vector are
contiguous: no packing copy); copies land straight in place when safe; reductions land in
a preallocated receive buffer (two per process, reused across calls, one per round
parity) and are added in place into views of the user's buffer.

NCCL: NCCL kernels on one stream run in order, so posting the next round's receives early
could block a send behind them; there each round is one ``batch_isend_irecv`` group,
waited before the next (written for completeness, not exercised by the CPU tests).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratrain.comm.schedule import REDUCE, CollectiveSchedule, chunk_sizes, offsets

DEFAULT_PIECE_BYTES = 4 << 20  # measured: fewer, larger pieces win on a busy 2-core host
REDUCE_OPS = ("sum", "mean", "max", "min")


class CommTimeoutError(RuntimeError):
    """A point-to-point wait timed out: the ranks' schedules do not match, or a peer died."""


@dataclass
class ExecStats:
    """What one execution did on this rank: steps (rounds of the schedule), bytes and
    messages it sent and received, and wall time."""

    op: str
    algorithm: str
    p: int
    rank: int
    steps: int
    bytes_sent: int = 0
    bytes_recv: int = 0
    messages: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class _Msg:
    peer: int          # group rank of the other side
    where: int         # 0: the output buffer; 1: the input buffer (all_to_all sends)
    offset: int        # element offset in that buffer
    length: int        # elements
    reduce: bool
    segs: tuple[int, ...]
    scratch: int = -1  # offset in the round's receive buffer; -1: received in place
    late: bool = False  # posted after the previous round is done (not during it)


@dataclass(frozen=True)
class _Round:
    sends: tuple[_Msg, ...]
    recvs: tuple[_Msg, ...]
    scratch: int       # elements of receive buffer this round needs
    # forward[i] = index of the next round's send that re-sends exactly what receive i
    # delivers (ring: the chunk just reduced travels on): it goes out piece by piece as
    # soon as each piece is final, so the pipeline never drains at a round boundary.
    forward: tuple[int | None, ...] = ()


def _place(s: CollectiveSchedule, rank: int, seg: int, sending: bool) -> tuple[int, int]:
    """(where, offset) of a segment in this rank's buffers."""
    if s.layout == "flat":
        return 0, s.seg_offsets[seg]
    if s.layout == "pair":  # the rank's own block from its input, the peer's into output
        return (1, 0) if sending else (0, 0)
    i, j = divmod(seg, s.p)  # block (i, j): rank i's chunk j, received by rank j
    if sending:
        return 1, offsets(chunk_sizes(s.n, s.p))[j]
    return 0, i * chunk_sizes(s.n, s.p)[rank]


def _messages(s: CollectiveSchedule, rank: int, transfers, sending: bool) -> list[_Msg]:
    groups: dict[tuple[int, bool], list[int]] = {}
    for t in transfers:
        groups.setdefault((t.dst if sending else t.src, t.op == REDUCE), []).append(t.seg)
    out = []
    # Both sides sort by (peer, reduce first, first segment): the pair's posting order.
    for (peer, red), segs in sorted(groups.items(), key=lambda kv: (kv[0][0], not kv[0][1])):
        segs.sort()
        runs: list[list[int]] = []
        for g in segs:
            # coalesce neighbouring segments of a flat vector into one message
            if runs and s.layout == "flat" and g == runs[-1][-1] + 1:
                runs[-1].append(g)
            else:
                runs.append([g])
        for run in runs:
            length = sum(s.seg_sizes[g] for g in run)
            if length == 0:
                continue  # empty chunks: both sides skip them (same rule on both ends)
            where, off = _place(s, rank, run[0], sending)
            out.append(_Msg(peer, where, off, length, red, tuple(run)))
    return out


LATE_MIN_ELEMS = 1 << 18


def plan(s: CollectiveSchedule, rank: int, late_min_elems: int = LATE_MIN_ELEMS
         ) -> tuple[_Round, ...]:
    """This rank's messages per round, with receive-buffer offsets (memoised).

    ``late_min_elems``: a copy that must wait for the previous round lands in place only
    if it is at least this long; a shorter one goes through the receive buffer, posted
    early: an extra copy of a few KiB costs less than a late receive's rendezvous."""
    key = ("plan", rank, late_min_elems)
    if key in s._memo:
        return s._memo[key]
    per = s.rank_rounds(rank)
    sent = [{t.seg for t in snd} for snd, _ in per]
    got = [{t.seg for t in rcv} for _, rcv in per]
    rounds = []
    for j, (snd, rcv) in enumerate(per):
        # Where a copy lands: in place and posted early (during round j-1) if nothing
        # touches those segments meanwhile; in place but posted LATE (after round j-1 is
        # done and its sends of them completed) if round j-1 still sends or writes them;
        # through the receive buffer only if round j itself sends them (its sends read
        # the state from before the round). Reductions always go through the buffer.
        before = sent[j - 1] | got[j - 1] if j else set()
        recvs, used = [], 0
        msgs = _messages(s, rank, rcv, sending=False)
        late_peers = {m.peer for m in msgs if not m.reduce and not sent[j].intersection(m.segs)
                      and before.intersection(m.segs) and m.length >= late_min_elems}
        for m in msgs:
            scratch = -1
            if (m.reduce or sent[j].intersection(m.segs)
                    or (before.intersection(m.segs) and m.peer not in late_peers)):
                scratch, used = used, used + m.length
            # all of a late peer's receives of the round go late: posting order per peer
            # is what pairs messages, so it must stay the schedule's order
            recvs.append(_Msg(m.peer, m.where, m.offset, m.length, m.reduce, m.segs, scratch,
                              m.peer in late_peers))
        rounds.append(_Round(tuple(_messages(s, rank, snd, sending=True)), tuple(recvs), used))
    for j in range(len(rounds) - 1):
        rounds[j] = _with_forwarding(rounds[j], rounds[j + 1])
    s._memo[key] = tuple(rounds)
    return s._memo[key]


def _with_forwarding(cur: _Round, nxt: _Round) -> _Round:
    fwd: list[int | None] = []
    first_to_peer = {}
    for i, m in enumerate(nxt.sends):
        first_to_peer.setdefault(m.peer, i)
    for m in cur.recvs:
        hit = None
        for i, sm in enumerate(nxt.sends):
            # Same bytes, written by this receive alone, and first in line to its peer
            # (messages to one peer must be posted in the order the peer expects).
            same = (sm.where, sm.offset, sm.length) == (m.where, m.offset, m.length)
            alone = sum(1 for o in cur.recvs if set(o.segs) & set(m.segs)) == 1
            if same and alone and first_to_peer[sm.peer] == i:
                hit = i
                break
        fwd.append(hit)
    return _Round(cur.sends, cur.recvs, cur.scratch, tuple(fwd))


_SCRATCH: dict[tuple, torch.Tensor] = {}


def _scratch(dtype: torch.dtype, device: torch.device, parity: int, plane: int,
             numel: int) -> torch.Tensor:
    """Preallocated receive buffer, grown on demand and reused across calls."""
    key = (dtype, str(device), parity, plane)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _SCRATCH[key] = buf
    return buf


def execute(s: CollectiveSchedule, planes: list[tuple[torch.Tensor, torch.Tensor | None]], *,
            group=None, reduce_op: str = "sum", piece_bytes: int = DEFAULT_PIECE_BYTES,
            timeout_s: float = 120.0) -> ExecStats:
    """Run ``s`` on this rank's buffers; return what it did.

    ``planes``: one or more (out, inp) pairs of flat contiguous tensors moved together
    (top-k sends values and indices side by side); ``inp`` is used only by all_to_all,
    whose sends read the input and whose receives fill the output. ``reduce_op`` "mean"
    reduces like "sum" (the caller divides once at the end).
    """
    if reduce_op not in REDUCE_OPS:
        raise ValueError(f"op={reduce_op!r} is not supported; use one of {REDUCE_OPS}")
    rank = dist.get_rank(group)
    if dist.get_world_size(group) != s.p:
        raise ValueError(f"schedule for p={s.p} run on a group of {dist.get_world_size(group)}")
    glob = list(range(s.p)) if group is None else [dist.get_global_rank(group, i)
                                                   for i in range(s.p)]
    run = _Run(s, rank, planes, group, glob, reduce_op, piece_bytes, timeout_s)
    t0 = time.perf_counter()
    if planes[0][0].device.type == "cuda":
        run.run_batched()
    else:
        run.run_gloo()
    run.stats.seconds = time.perf_counter() - t0
    return run.stats


class _Run:
    """One execution's state: posted works, pending sends per segment, counters."""

    def __init__(self, s, rank, planes, group, glob, reduce_op, piece_bytes, timeout_s):
        self.s, self.rank, self.planes, self.group, self.glob = s, rank, planes, group, glob
        self.rounds = plan(s, rank)
        self.reduce_op = reduce_op
        esize = planes[0][0].element_size()
        self.piece = max(1, piece_bytes // esize)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.pending: dict[int, list] = {}  # segment -> sends still reading it
        self.recv_works: dict[int, list] = {}  # round -> [(msg, plane, off, len, work)]
        self.forwarded: set[int] = set()  # next round's sends already posted
        self.stats = ExecStats(s.op, s.algorithm, s.p, rank, s.steps)
        # one receive buffer per round parity, sized for the largest round of that parity:
        # round j+1's receives are posted while round j's buffer is still being read
        need = [max((r.scratch for r in self.rounds[par::2]), default=0) for par in (0, 1)]
        self.scratch = [[_scratch(out.dtype, out.device, par, i, need[par])
                         for par in (0, 1)] for i, (out, _) in enumerate(planes)]

    # -- buffers -------------------------------------------------------------------------
    def _buf(self, plane: int, where: int) -> torch.Tensor:
        out, inp = self.planes[plane]
        return out if where == 0 else inp

    def _pieces(self, m: _Msg):
        for off in range(0, m.length, self.piece):
            yield off, min(self.piece, m.length - off)

    def _recv_target(self, j: int, m: _Msg, plane: int, off: int, k: int) -> torch.Tensor:
        if m.scratch < 0:
            return self._buf(plane, m.where)[m.offset + off:m.offset + off + k]
        return self.scratch[plane][j % 2][m.scratch + off:m.scratch + off + k]

    def _wait_sends(self, segs) -> None:
        # A message spanning several segments is listed under each of them; gloo counts
        # completions, so a second wait on one send would block: wait each work once.
        for g in segs:
            for entry in self.pending.pop(g, ()):
                if entry[1]:
                    self._wait(entry[0], "send to", entry[2], g)
                    entry[1] = False

    def _wait(self, work, what: str, m: _Msg | None, seg=None, j: int | None = None) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            peer = f"group rank {m.peer}" if m else "a peer"
            segs = m.segs if m else (seg,)
            raise CommTimeoutError(
                f"rank {self.rank}: {self.s.op}/{self.s.algorithm} (p={self.s.p}, "
                f"n={self.s.n}) round {j}: {what} {peer} (segments {list(segs)}) did not "
                f"complete within {self.timeout_s:g} s; the ranks ran mismatched schedules "
                f"(op, algorithm, size or root differ) or a peer failed ({e})") from None

    # -- gloo: post early, pipeline by pieces --------------------------------------------
    def _post_recvs(self, j: int, late: bool = False) -> None:
        works = self.recv_works.setdefault(j, [])
        for m in self.rounds[j].recvs:
            if m.late != late:
                continue
            if m.scratch < 0:
                self._wait_sends(m.segs)  # in-place copy: earlier sends of it must be done
            for plane in range(len(self.planes)):
                for off, k in self._pieces(m):
                    t = self._recv_target(j, m, plane, off, k)
                    works.append((m, plane, off, k,
                                  dist.irecv(t, self.glob[m.peer], group=self.group)))

    def _send_piece(self, m: _Msg, plane: int, off: int, k: int) -> None:
        v = self._buf(plane, m.where)[m.offset + off:m.offset + off + k]
        entry = [dist.isend(v, self.glob[m.peer], group=self.group), True, m]  # work, to wait
        for g in m.segs:
            self.pending.setdefault(g, []).append(entry)
        self.stats.bytes_sent += k * v.element_size()
        self.stats.messages += 1

    def _post_sends(self, j: int) -> None:
        early = self.forwarded if j > 0 else ()
        for i, m in enumerate(self.rounds[j].sends):
            if i in early:
                continue  # already went out piece by piece during round j-1
            for plane in range(len(self.planes)):
                for off, k in self._pieces(m):
                    self._send_piece(m, plane, off, k)

    def _finish_recvs(self, j: int) -> None:
        cleared = set()
        rnd = self.rounds[j]
        # forwarding piece by piece would interleave planes differently from the
        # receiver's posting order: single-plane runs only
        fwd = dict(zip(rnd.recvs, rnd.forward, strict=False)) if len(self.planes) == 1 else {}
        nxt = self.rounds[j + 1].sends if j + 1 < len(self.rounds) else ()
        self.forwarded = {i for i in fwd.values() if i is not None}
        for m, plane, off, k, w in self.recv_works.pop(j):
            self._wait(w, "receive from", m, j=j)
            buf = self._buf(plane, m.where)
            self.stats.bytes_recv += k * buf.element_size()
            if m.scratch >= 0:
                if m not in cleared:  # we are about to write these segments
                    self._wait_sends(m.segs)
                    cleared.add(m)
                self._apply(buf[m.offset + off:m.offset + off + k],
                            self._recv_target(j, m, plane, off, k), m.reduce)
            if fwd.get(m) is not None:
                self._send_piece(nxt[fwd[m]], plane, off, k)

    def _apply(self, dst: torch.Tensor, got: torch.Tensor, reduce: bool) -> None:
        if not reduce:
            dst.copy_(got)
        elif self.reduce_op in ("sum", "mean"):
            dst.add_(got)
        elif self.reduce_op == "max":
            torch.maximum(dst, got, out=dst)
        else:
            torch.minimum(dst, got, out=dst)

    def run_gloo(self) -> None:
        n = len(self.rounds)
        if n == 0:
            return
        self._post_recvs(0)
        self._post_sends(0)
        for j in range(n):
            if j + 1 < n:
                self._post_recvs(j + 1)  # early: the peer's next sends find them posted
            self._finish_recvs(j)
            if j + 1 < n:
                self._post_recvs(j + 1, late=True)  # in place, now that round j is done
                self._post_sends(j + 1)  # after round j: they read its results
        for g in list(self.pending):
            self._wait_sends((g,))

    # -- NCCL: one batch per round -------------------------------------------------------
    def run_batched(self) -> None:
        for j, rnd in enumerate(self.rounds):
            ops, recvs = [], []
            for m in rnd.sends:
                for plane in range(len(self.planes)):
                    src = self._buf(plane, m.where)
                    for off, k in self._pieces(m):
                        v = src[m.offset + off:m.offset + off + k]
                        ops.append(dist.P2POp(dist.isend, v, self.glob[m.peer], self.group))
                        self.stats.bytes_sent += k * v.element_size()
                        self.stats.messages += 1
            for m in rnd.recvs:
                for plane in range(len(self.planes)):
                    for off, k in self._pieces(m):
                        t = self._recv_target(j, m, plane, off, k)
                        ops.append(dist.P2POp(dist.irecv, t, self.glob[m.peer], self.group))
                        recvs.append((m, plane, off, k, t))
            for w in (dist.batch_isend_irecv(ops) if ops else []):
                self._wait(w, "exchange with", None, j=j)
            for m, plane, off, k, t in recvs:
                buf = self._buf(plane, m.where)
                self.stats.bytes_recv += k * buf.element_size()
                if m.scratch >= 0:
                    self._apply(buf[m.offset + off:m.offset + off + k], t, m.reduce)
