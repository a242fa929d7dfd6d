"""Which free parameters of the step model a set of runs informs.

A parameter is fitted only where rows price with it: a chip family's GEMM efficiency with
``MIN_ROWS`` rows on that family, its FlashAttention-2 class efficiency with ``MIN_ROWS``
rows that run such a kernel, the broad scalars always, and a :data:`NARROW` scalar (one
that prices a single class of rows) with ``MIN_ROWS`` rows of its class. Leaving a source
out (:func:`paratrain.systems.fitting.leave_source_out`), whatever the remaining rows do
not inform goes back to its unfitted start (:func:`unseen_start`): a fit never moves a
parameter no row prices with, so without the reset it would keep the value the left-out
rows gave it.
"""

from __future__ import annotations

from paratrain.systems.gemm import family, is_tpu
from paratrain.systems.row_engine import case_kernel, fp8_scaling
from paratrain.systems.runs import Case
from paratrain.systems.step_params import (
    LEGACY_MMA,
    NATIVE_ATTN,
    SCALARS,
    StepParams,
    native_attention,
    native_attn_name,
)

MIN_ROWS = 3  # a generation's efficiencies are fitted only with this many rows on it


def _prices_attn_eff(c: Case) -> bool:
    """Whether a case's attention core runs at its generation's ``attn_eff``: a
    FlashAttention-2 class kernel (``StepParams.attn_for``), not the chip's native fused
    one (``StepParams.native_attn``), not eager attention's batched GEMMs, not a TPU's."""
    kernel = case_kernel(c)
    return kernel != "eager" and not native_attention(family(c.hw.name), kernel)


def _native(c: Case) -> str | None:
    """The native attention figure a case's attention core runs at
    (``StepParams.native_attn``), or None when it runs another kernel."""
    fam = family(c.hw.name)
    if not native_attention(fam, case_kernel(c)):
        return None
    return native_attn_name(fam)


def _prices_gmm(c: Case) -> bool:
    """Whether a case's expert GEMMs run at the TPU's grouped-matmul share
    (``tpu_gmm_eff``): a dropless MoE on a TPU."""
    return is_tpu(family(c.hw.name)) and c.model.grouped_experts


def _prices_rowwise(c: Case) -> bool:
    """Whether a case's linear layers run row-scaled FP8 (``fp8_rowwise_eff``)."""
    return str(fp8_scaling(c)).startswith("rowwise")


# the scalars that price one class of rows only, with the test for a row of that class:
# each is fitted only with MIN_ROWS such rows, and a fit whose rows have fewer keeps its
# unfitted start (:func:`unseen_start`), not a value that other rows never informed
NARROW = {"tpu_gmm_eff": _prices_gmm, "fp8_rowwise_eff": _prices_rowwise,
          **{name: (lambda c, n=name: _native(c) == n)
             for name in NATIVE_ATTN}}


def _informed(name: str, cases: list[Case]) -> bool:
    """Whether ``cases`` inform the scalar ``name``: every row informs the broad ones,
    MIN_ROWS of its class a :data:`NARROW` one."""
    test = NARROW.get(name)
    return test is None or sum(map(test, cases)) >= MIN_ROWS


def free_params(cases: list[Case]) -> list[tuple[str, str | None]]:
    """The parameters the rows can inform: each generation's GEMM efficiency when it has
    MIN_ROWS rows, its FlashAttention-2 efficiency when MIN_ROWS of them run such a
    kernel (freed with fewer, a fit once pushed B200's to its bound; Blackwell's rows
    that run one count toward Hopper's, at whose rate they run:
    :data:`~paratrain.systems.step_params.LEGACY_MMA`), and the scalars (a
    :data:`NARROW` one only with MIN_ROWS rows of its class)."""
    rows: dict = {}
    attn: dict = {}
    for c in cases:
        g = family(c.hw.name)
        rows[g] = rows.get(g, 0) + 1
        a = LEGACY_MMA.get(g, g)  # Blackwell's FlashAttention-2 rows inform Hopper's
        attn[a] = attn.get(a, 0) + _prices_attn_eff(c)
    gens = sorted(g for g, n in rows.items() if n >= MIN_ROWS)
    return ([("gemm_eff", g) for g in gens]
            + [("attn_eff", g) for g in gens if attn.get(g, 0) >= MIN_ROWS]
            + [(s, None) for s in SCALARS if _informed(s, cases)])


def unseen_start(start: StepParams, rows: list[Case]) -> StepParams:
    """``start`` with each per-family efficiency that ``rows`` do not inform (no
    parameter of :func:`free_params`) back at its unfitted start, or absent where it has none
    (``StepParams.gemm_for`` then takes the mean of its kind), and so each :data:`NARROW`
    scalar: left out, the only source of row-scaled FP8 runs must not be priced at the
    rate its own runs fitted (which stays put, a parameter no remaining row moves)."""
    base, free = StepParams(), set(free_params(rows))
    narrow = {s: getattr(base, s) for s in NARROW if (s, None) not in free}

    def table(name: str) -> dict:
        mine, theirs = getattr(start, name), getattr(base, name)
        return {k: (mine[k] if (name, k) in free else theirs[k])
                for k in mine if (name, k) in free or k in theirs}

    return start.replace(gemm_eff=table("gemm_eff"), attn_eff=table("attn_eff"), **narrow)
