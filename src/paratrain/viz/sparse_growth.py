"""Why top-k gradient exchange stops paying as data parallelism grows: bytes each rank
sends per step against the number of ranks p, sparse all-gather beside the dense ring
all-reduce it replaces.

Top-k with ratio K (``--compress topk:K``, :mod:`paratrain.parallel.compress`) keeps
k = n / K of a rank's n gradient entries, each a 4-byte value plus a 4-byte index. The
picks differ between ranks, so nothing can be summed on the way: they are all-gathered,
and each rank sends (p - 1) x its payload, growing with p. The dense ring all-reduce sends
2 (p - 1) / p x n x 4 bytes, bounded by 2 n x 4. The lines cross at p = K. Both counts
come from the very schedules the executor runs (:func:`paratrain.comm.cost.count`).
"""

from __future__ import annotations

from pathlib import Path

from paratrain.viz import save_figure

VALUE_BYTES = INDEX_BYTES = 4


def sent_bytes(p: int, n: int, ratio: int) -> tuple[int, int]:
    """(sparse all-gather, dense ring all-reduce) bytes rank 0 sends for one step."""
    from paratrain.comm.algorithms import build
    from paratrain.comm.cost import count

    k = max(1, n // ratio)
    sparse = count(build("sparse_all_gather", "ring", p, k)).sent[0]
    dense = count(build("all_reduce", "ring", p, n)).sent[0]
    return sparse * (VALUE_BYTES + INDEX_BYTES), dense * VALUE_BYTES


def draw_growth(p: int, out_dir: str | Path, n: int = 1 << 20, ratio: int = 16,
                p_max: int = 32) -> Path:
    """Write ``sparse_all_gather_growth.png``: bytes sent per rank for p = 2..p_max, the
    drawn ``p`` marked; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = list(range(2, max(p_max, p) + 1))
    sparse, dense = zip(*(sent_bytes(q, n, ratio) for q in ps), strict=True)
    mb = 1e6
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=100)
    ax.plot(ps, [b / mb for b in sparse], color="#C0392B", lw=2,
            label=f"top-k all-gather (k = n/{ratio}, value + index)")
    ax.plot(ps, [b / mb for b in dense], color="#1F618D", lw=2,
            label="dense ring all-reduce")
    s_p, d_p = sent_bytes(p, n, ratio)
    ax.plot([p, p], [s_p / mb, d_p / mb], "o", color="black", ms=5)
    ax.annotate(f"p = {p}: sparse {s_p / mb:.2f} MB, dense {d_p / mb:.2f} MB",
                (p, s_p / mb), textcoords="offset points", xytext=(10, -16), fontsize=9)
    ax.axvline(ratio, color="#999999", ls=":", lw=1.2)
    ax.text(ratio, ax.get_ylim()[1] * 0.97, f" p = K = {ratio}: break-even", fontsize=9,
            va="top", color="#555555")
    ax.set_xlabel("data-parallel ranks p")
    ax.set_ylabel("MB each rank sends per step")
    ax.set_title(f"Sparse all-gather grows with p; the dense ring does not "
                 f"(n = {n:,} fp32 gradient entries)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="lower right")
    fig.tight_layout()
    return save_figure(fig, out_dir, "sparse_all_gather_growth.png")
