"""What paratrain's MoE block keeps for backward, counted storage by storage
(docs/moe-activations.md): the routed rows and the bytes beyond the block's input."""

from __future__ import annotations

import math

from paratrain.config import ModelConfig
from paratrain.cost.shapes import as_shape


def moe_rows(model: ModelConfig, seq: int) -> int:
    """Routed rows (token, expert) one sequence of ``seq`` tokens sends to the experts:
    seq k dropless; under capacity C at most min(seq k, E min(cap, seq)), cap =
    ceil(C seq k / E) per expert (an expert takes a token once, so at most seq): exact
    whenever nothing is dropped, e.g. always when cap >= seq (C >= E / k)."""
    m = as_shape(model)
    E, k = m.experts, m.top_k
    if m.capacity_factor <= 0:
        return seq * k
    cap = math.ceil(m.capacity_factor * seq * k / E)
    return min(seq * k, E * min(cap, seq))


def moe_mlp_activation_bytes(model: ModelConfig, seq: int, *, element_bytes: float = 2.0,
                             ep: int = 1) -> float:
    """Bytes paratrain's :class:`paratrain.model.MoE` keeps for backward beyond its input
    (the router's input, counted with the block's linear inputs), per sequence of
    ``seq`` tokens, each storage once as
    :class:`paratrain.parallel.memory.ActivationMeter` counts it. With s = seq, h =
    d_model, E experts, k = top_k, f the expert width, f_s = shared_experts f, e the
    element size, r = max(e, 4) the router's (it runs in float32 at least), 8 bytes an
    index (int64), S = :func:`moe_rows` the routed rows and R the rows this rank's experts
    run (R = S without ep), in bytes:

    ======================  ====================================================  =======
    part                    kept for backward                                     bytes
    ======================  ====================================================  =======
    router                  softmax output (s E), top-k indices (s k), the        r (s E
                            renormalisation's numerator (s k) and sum (s; not     + s k
                            under ``moe_renorm`` false), the aux loss's routed    + s + E)
                            fractions f (E per sequence)                          + 8 s k
    z-loss (coef > 0)       the logits and their log-sum-exp (square's input)     r (s E
                                                                                  + s)
    capacity (C > 0)        the keep mask (bool) that selects the kept weights    s k
    sort                    the argsort order (gathers the weights) and the       16 S
                            token index (gathers the rows, scatters them back)
    experts                 their input rows (one storage) and, per row, the      e R
                            SwiGLU's gate, silu, up and product                   (h + 4 f)
    ep > 1                  the regrouping permutation and its inverse            16 R
    combine                 the sorted weights, the expert outputs (the           e S
                            concatenation, or the return all-to-all's buffer),    (1 + 2 h)
                            their weighted product (index_add_'s source)
    shared experts          SwiGLU of width f_s on every token                    4 e s f_s
    shared gate             under ``shared_gate``: the sigmoid (s) and the        e s
                            shared output it scales (s h)                         (1 + h)
    ======================  ====================================================  =======

    Under ep the rows leave by all-to-all: the dispatched copy (S h) is not kept, the
    received rows, permuted by local expert, are (R h). R depends on the routing: the
    sum over the ep ranks of R is the sum of S (every row lands on one rank), so the
    figure, with R = S, is exact for the mean over ep ranks and for every rank when each
    token uses every expert (k = E); the auxiliary loss pushes R towards S. Nothing is
    divided by tp (an MoE MLP is whole on every tp rank; MoE refuses sp and cp).
    Under bf16 the weights and rows are 2 bytes but the router runs in float32: the
    count uses r for what the router keeps, e for the rest."""
    m = as_shape(model)
    s, h, E, k, e = seq, m.d_model, m.experts, m.top_k, element_bytes
    f, fs = m.expert_ffn, m.shared_experts * m.expert_ffn
    r = max(e, 4.0)
    S = R = moe_rows(m, s)
    out = r * (s * E + (s * k + s if m.moe_renorm else 0) + E) + 8 * s * k
    if m.z_loss_coef > 0:
        out += r * (s * E + s)
    if m.capacity_factor > 0:
        out += s * k
    out += 16 * S + e * R * (h + 4 * f) + e * S * (1 + 2 * h) + 4 * e * s * fs
    if m.shared_gate:
        out += e * s * (1 + h)
    if ep > 1:
        out += 16 * R
    return out
