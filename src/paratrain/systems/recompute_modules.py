"""What a selective recomputation that names its modules reruns, as Megatron-Core runs it.

Megatron-Core's selective recomputation (``recompute_granularity`` selective) reruns, in
the backward, the forward of the modules ``recompute_modules`` names, and only those
(``core_attn``, its default, is Korthikanti et al. 2022's selective recompute, the
attention core). A runs-table row that lists them ("selective (modules layernorm, moe)")
is priced module by module, not as the attention core (``selective``) nor as the whole
block (``full``): at 128K tokens the attention core is most of a step, and a list that
leaves it out must not rerun it.

==================  ========================================  ==========================
module              what it reruns                            priced as
==================  ========================================  ==========================
``core_attn``       the attention core                        its forward again
``mlp``             a dense block's MLP                       the ``mlp`` GEMMs' forward
``moe``             an MoE layer: router, experts, shared     ``router``, ``experts``,
                    experts, their dispatch and combine       ``mlp`` forward; the
                                                              all-to-alls again
``shared_experts``  the shared experts                        the ``mlp`` GEMMs' forward
``mla_up_proj``     MLA's up projections of q and kv          the ``qkv`` GEMMs' forward
``layernorm``,      norms, activation functions: element-     not priced (a few percent
``moe_act``, ...    wise work                                 of a block's bytes)
==================  ========================================  ==========================

``mla_up_proj`` is priced as all of MLA's query and key/value GEMMs, of which the up
projections are most (78% of DeepSeek-V3's: 1,536 x 24,576 and 512 x 32,768 of its
7,168-wide layer's four). A module list that reruns a GEMM also reruns the block's
element-wise work (the activation and the permutation of the rows it feeds); one that
names only element-wise modules reruns nothing the step model prices.
"""

from __future__ import annotations

import re

# module -> the GEMM classes (systems.layer_cost.GEMM_CLASSES) whose forward it reruns
RERUN_CLASSES = {
    "core_attn": ("attention",),
    "mlp": ("mlp",),
    "moe": ("router", "experts", "mlp"),
    "shared_experts": ("mlp",),
    "mla_up_proj": ("qkv",),
}
ELEMENTWISE = ("layernorm", "moe_act", "act", "shared_experts_act")
MODULES = (*RERUN_CLASSES, *ELEMENTWISE)


def modules_said(text: str) -> tuple[str, ...]:
    """The recompute modules a row's words list after "modules" (Megatron-Core's names,
    sorted), or () when they list none."""
    low = text.lower()
    if "modules" not in low:
        return ()
    words = re.findall(r"[a-z_]+", low.split("modules", 1)[1])
    return tuple(sorted({w for w in words if w in MODULES}))


def rerun_classes(modules: tuple[str, ...]) -> frozenset[str]:
    """The GEMM classes whose forward the named modules rerun."""
    return frozenset(c for mod in modules for c in RERUN_CLASSES.get(mod, ()))
