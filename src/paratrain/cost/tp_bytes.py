"""Tensor-parallel collectives per transformer block (torch-free, shared with the runtime).

Megatron-LM's tensor parallelism (Shoeybi et al. 2019) puts two conjugate operators
around attention and around the MLP: the entry ``f`` (identity forward, all-reduce
backward) and the exit ``g`` (all-reduce forward, identity backward). A block therefore
all-reduces b*s*h elements twice forward (the exits, in the compute dtype) and twice
backward (the entries' gradients, in the weights' dtype). Sequence parallelism (Korthikanti
et al. 2022, section 4.2.2) replaces each all-reduce with an all-gather and a
reduce-scatter: the same wire bytes, 2(t-1)/t x payload per all-reduce.

Full recomputation reruns the block's forward during backward, but torch's non-reentrant
checkpoint stops once every saved tensor is rebuilt: the attention exit's collective is
repeated (the MLP's norm saves what follows it), the MLP exit's is not (nothing after it is
saved). So a block costs 5 all-reduce-sized transfers under full recomputation, 4
otherwise; :func:`paratrain.parallel.tensor.tp_wire_bytes_per_layer` counts the same.
"""

from __future__ import annotations

from paratrain.cost.collectives import ring_factor


def tp_forward_backward(recompute: str = "none") -> tuple[int, int]:
    """All-reduce-sized TP transfers per block per micro-batch: (forward, backward)."""
    return (3 if recompute == "full" else 2), 2


def tp_collectives_per_layer(sp: bool, recompute: str = "none") -> dict[str, int]:
    """Collective calls per block per micro-batch by kind (forward + backward)."""
    n = sum(tp_forward_backward(recompute))
    return {"all_gather": n, "reduce_scatter": n} if sp else {"all_reduce": n}


def tp_wire_bytes_per_layer(batch: int, seq: int, d_model: int, tp: int, fwd_elem: int,
                            bwd_elem: int, recompute: str = "none") -> float:
    """Bytes one rank sends per block per micro-batch, forward + backward: each
    all-reduce-sized transfer of batch*seq*d_model elements sends 2(tp-1)/tp of them,
    ``fwd_elem`` bytes each forward (2 under bf16 autocast) and ``bwd_elem`` backward."""
    n_fwd, n_bwd = tp_forward_backward(recompute)
    per_elem = ring_factor("all_reduce", tp)
    return (n_fwd * fwd_elem + n_bwd * bwd_elem) * per_elem * batch * seq * d_model
