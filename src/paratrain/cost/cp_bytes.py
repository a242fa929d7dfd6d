"""Context parallelism: sequence pieces per cp rank, the ring's attention blocks, bytes."""

from __future__ import annotations

from paratrain.config import ModelConfig
from paratrain.plan import ParallelPlan


# ---- context parallelism ----------------------------------------------------------------
def cp_chunks(cp: int, i: int) -> tuple[int, int]:
    """The two of the 2 cp sequence chunks cp rank ``i`` holds, in its local order:
    i and 2cp-1-i (an early and a late one, so causal work is equal on every rank)."""
    return i, 2 * cp - 1 - i


def cp_positions(T: int, cp: int, i: int) -> list[int]:
    """Global positions of cp rank ``i``'s T/cp tokens, in its local order."""
    if T % (2 * cp):
        raise ValueError(f"context {T} is not divisible by 2*cp={2 * cp} (the load-balanced "
                         f"split cuts each sequence into 2*cp chunks); use a multiple of "
                         f"{2 * cp}")
    c = T // (2 * cp)
    return [k * c + t for k in cp_chunks(cp, i) for t in range(c)]


def _kind(qc: int, kc: int) -> str | None:
    return "full" if kc < qc else "diag" if kc == qc else None


def ring_blocks(cp: int, i: int) -> list[tuple[int, list[tuple[int, int, str]]]]:
    """The ring schedule of cp rank ``i``, the one :class:`paratrain.parallel.context.
    RingAttention` runs: per step s, the rank whose K/V block it holds (j = i - s mod cp)
    and the (query chunk, key chunk, kind) sub-blocks it computes; kind "full" (every
    key visible), "diag" (causal mask within the chunk); sub-blocks whose keys all lie
    after the queries are skipped (not listed)."""
    out = []
    for s in range(cp):
        j = (i - s) % cp
        blocks = [(qc, kc, k) for qc in cp_chunks(cp, i) for kc in cp_chunks(cp, j)
                  if (k := _kind(qc, kc)) is not None]
        out.append((j, blocks))
    return out


def contiguous_blocks(cp: int, i: int) -> list[tuple[int, list[tuple[int, int, str]]]]:
    """The same schedule for a contiguous split (rank i holds tokens [iT/cp, (i+1)T/cp)),
    for comparison: one chunk per rank."""
    out = []
    for s in range(cp):
        j = (i - s) % cp
        k = _kind(i, j)
        out.append((j, [(i, j, k)] if k else []))
    return out


def attention_pairs_per_rank(T: int, cp: int, balanced: bool = True) -> list[int]:
    """(query, key) pairs each cp rank scores under the causal mask, counted from the
    block schedule (attention FLOPs are proportional): a full c x c sub-block counts c^2,
    a diagonal one c(c+1)/2; c = T/(2cp) balanced, T/cp contiguous."""
    c = T // (2 * cp) if balanced else T // cp
    sched = ring_blocks if balanced else contiguous_blocks
    return [sum(c * c if k == "full" else c * (c + 1) // 2
                for _, blocks in sched(cp, i) for _, _, k in blocks) for i in range(cp)]


A2A_EXCHANGES = 4  # all-to-all CP, per block and direction: q, k, v and the output
# of which issued back to back, with only reshapes between (one wait for the peers):
# q, k and v together, then the output after the attention (forward and backward alike)
A2A_BURSTS = 2


def ring_hops(plan: ParallelPlan) -> int:
    """Point-to-point hops (each a send and a receive waited for) a ring cp rank makes per
    block and micro-batch: K/V cp - 1 hops forward, again under recompute (selective or
    full: the core is rerun), cp - 1 more in backward and the gradients cp (the last one
    home), as :func:`cp_bytes_per_sequence_layer` and :func:`cp_wire_bytes` count bytes."""
    N = plan.cp
    if N == 1:
        return 0
    return (N - 1) * (2 if plan.recompute == "none" else 3) + N


def cp_bytes_per_sequence_layer(mcfg: ModelConfig, plan: ParallelPlan, elem: int
                                ) -> tuple[int, int]:
    """(forward, backward) bytes one cp rank sends per layer and per sequence:

    - ring: forward, K and V blocks (T/cp tokens x kv heads/tp x head_dim) go cp-1 hops;
      backward, K and V again cp-1 hops and their gradients cp hops (the last one home),
      the gradients in float32 when the working dtype is 16-bit;
    - all-to-all: q, k, v to head-sharded and the output back, each sending (cp-1)/cp
      of the local tensor; backward the same four with gradients.
    """
    N, T, E = plan.cp, mcfg.context, mcfg.head_dim
    if N == 1:
        return 0, 0
    L = T // N
    kv = 2 * L * (mcfg.kv_heads // plan.tp) * E * elem
    if plan.cp_algorithm == "ring":
        acc = kv // elem * (4 if elem == 2 else elem)
        return (N - 1) * kv, (N - 1) * kv + N * acc
    q = L * (mcfg.n_heads // plan.tp) * E * elem
    a2a = (N - 1) * (2 * q + kv) // N
    return a2a, a2a


def cp_wire_bytes(mcfg: ModelConfig, plan: ParallelPlan, elem: int, batch: int,
                  layers: int) -> int:
    """Bytes one cp rank sends for attention in one training step of ``batch`` sequences
    (all micro-batches) through ``layers`` blocks; recompute (selective or full) reruns
    the forward's sends in backward, except what torch's checkpoint does not rerun."""
    fwd, bwd = cp_bytes_per_sequence_layer(mcfg, plan, elem)
    again = 0 if plan.recompute == "none" else fwd
    if plan.recompute == "selective" and plan.cp_algorithm == "all-to-all" and plan.cp > 1:
        # torch's checkpoint stops recomputing once the last saved tensor is rebuilt: the
        # core's output all-to-all (nothing after it is saved inside the core) is not rerun
        N = plan.cp
        again -= (N - 1) * (mcfg.context // N) * (mcfg.n_heads // plan.tp) \
            * mcfg.head_dim * elem // N
    return layers * batch * (fwd + again + bwd)
