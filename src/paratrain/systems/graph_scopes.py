"""Which of a block's kernels a partial CUDA graph replays (``Engine.graph_scopes``).

Megatron-Core can capture parts of each transformer layer in CUDA graphs through
Transformer Engine (``cuda_graph_impl = "transformer_engine"`` with a
``cuda_graph_scope`` list), the rest launched from the host as usual: MoE layers route a
different number of tokens to each expert every micro-batch, which a graph cannot
replay, so their recipes capture only the static parts. A replayed kernel pays the GPU's
own gap (``overlap.GRAPH_KERNEL_S``) in place of the fitted launch cost ``kernel_s``;
Grace-hosted Blackwell (GB200, GB300) is where the host's launch rate bounds a
fine-grained MoE layer, and where Megatron-Bridge's and the MoE model zoo's recipes turn
these graphs on.

Scopes, by Megatron-Core's names (``layer`` is ours for an empty scope list, the whole
layer), and the forward kernels of :data:`paratrain.systems.layer_cost.KERNELS_FWD`
and :data:`paratrain.systems.moe_step.MOE_KERNELS_FWD` each one replays:

==============  ============================================================  ==========
scope           what it captures                                              kernels
==============  ============================================================  ==========
attn            the attention half of the layer: input norm, QKV GEMM, RoPE,  ATTN
                the attention kernel, output GEMM, residual add, with the
                GEMMs' FP8 casts
mlp             a dense layer's MLP half (norm, GEMMs, activation, add)       the rest
moe_router      the router: gating GEMM, score function, top-k, the load      ROUTER
                balancing loss
moe_preprocess  the dispatcher's bookkeeping before the token exchange        PREPROCESS
                (tokens per expert, their exchange and reductions)
moe             the whole MoE MLP (only with a fixed expert capacity)         MoE's all
layer           everything in the layer                                       all
==============  ============================================================  ==========

``full_iteration`` (the whole step in one graph) is not a scope here but
``Engine.graphed``, which also covers the collectives and the loss.
"""

from __future__ import annotations

import re

from paratrain.systems.moe_step import MOE_PREPROCESS_KERNELS_FWD, MOE_ROUTER_KERNELS_FWD

# the attention half of a dense block's forward kernels (layer_cost.KERNELS_FWD's 14):
# norm, QKV GEMM, RoPE, attention, output GEMM, residual add, and one of the TP pair
ATTN_KERNELS_FWD = 7
SCOPES = ("attn", "mlp", "moe_router", "moe_preprocess", "moe", "layer")
# GEMM classes (layer_cost.GEMM_CLASSES) whose FP8 casts each scope replays
_CAST_CLASSES = {"attn": ("qkv", "out"), "mlp": ("mlp",),
                 "moe": ("router", "experts", "mlp"), "layer": None}


def graphed_kernels(scopes: tuple[str, ...], dense_fwd: int, moe_fwd: int,
                    casts: dict[str, int]) -> int:
    """Forward kernels of one block that ``scopes`` replay from graphs: ``dense_fwd`` the
    block's dense kernels, ``moe_fwd`` its MoE layer's beyond them (0 for a dense block;
    of them, the router's and the dispatcher's bookkeeping are :data:`paratrain.systems.
    moe_step.MOE_ROUTER_KERNELS_FWD` and ``MOE_PREPROCESS_KERNELS_FWD``); ``casts`` the
    FP8 cast kernels per GEMM class."""
    s = set(scopes)
    every = dense_fwd + moe_fwd + sum(casts.values())
    if "layer" in s:
        return every

    def cast(scope: str) -> int:
        return sum(casts.get(c, 0) for c in _CAST_CLASSES[scope])

    n = ATTN_KERNELS_FWD + cast("attn") if "attn" in s else 0
    if moe_fwd and "moe" in s:
        n += dense_fwd - ATTN_KERNELS_FWD + moe_fwd + cast("moe")
    elif moe_fwd:
        n += (MOE_ROUTER_KERNELS_FWD * ("moe_router" in s)
              + MOE_PREPROCESS_KERNELS_FWD * ("moe_preprocess" in s))
    elif "mlp" in s:
        n += dense_fwd - ATTN_KERNELS_FWD + cast("mlp")
    return min(n, every)


_SAID = re.compile(r"cuda graph scopes?:?\s+([a-z_ +&]+)")


def _words(text: str) -> list[str]:
    """The words after "CUDA graph scope" in ``text`` (up to a comma or bracket)."""
    hit = _SAID.search(text.lower())
    return [w for w in re.split(r"[\s+&]+", hit.group(1)) if w and w != "and"] if hit else []


def scopes_said(text: str) -> tuple[str, ...]:
    """The scopes a runs-table engine cell (or ``plan --engine``) names after "CUDA graph
    scope": "NeMo (Megatron-Bridge), CUDA graph scope attn moe_router moe_preprocess"
    gives ("attn", "moe_router", "moe_preprocess"); words that are no scope are left
    out (:func:`unknown_scopes` names them)."""
    return tuple(w for w in _words(text) if w in SCOPES)


def unknown_scopes(text: str) -> tuple[str, ...]:
    """The words after "CUDA graph scope" in ``text`` that are no scope of :data:`SCOPES`."""
    return tuple(w for w in _words(text) if w not in SCOPES)
