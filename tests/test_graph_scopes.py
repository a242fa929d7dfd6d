"""Partial CUDA graphs (systems/graph_scopes.py): which of a block's kernels each scope
replays, how an engine cell or `plan --engine` names them, and what the step model
charges for them. Pure Python, no torch."""

from __future__ import annotations

import pytest

from paratrain.systems.graph_scopes import (
    ATTN_KERNELS_FWD,
    SCOPES,
    graphed_kernels,
    scopes_said,
    unknown_scopes,
)
from paratrain.systems.layer_cost import KERNELS_FWD
from paratrain.systems.moe_step import (
    MOE_KERNELS_FWD,
    MOE_PREPROCESS_KERNELS_FWD,
    MOE_ROUTER_KERNELS_FWD,
)

ROUTER, PRE = MOE_ROUTER_KERNELS_FWD, MOE_PREPROCESS_KERNELS_FWD


def test_each_scope_replays_its_own_kernels():
    moe = MOE_KERNELS_FWD + 2 * 16  # sixteen local experts
    casts = {"qkv": 1, "out": 1, "experts": 4, "router": 0}

    def n(*scopes, moe_fwd=moe, c=None):
        return graphed_kernels(scopes, KERNELS_FWD, moe_fwd, c or {})

    assert n() == 0
    assert n("attn") == ATTN_KERNELS_FWD
    assert n("attn", c=casts) == ATTN_KERNELS_FWD + 2  # the QKV and output GEMMs' casts
    assert n("attn", "moe_router", "moe_preprocess") == ATTN_KERNELS_FWD + ROUTER + PRE
    assert n("moe_router", moe_fwd=0) == 0  # a dense block has no router
    assert n("mlp", moe_fwd=0) == KERNELS_FWD - ATTN_KERNELS_FWD
    assert n("mlp") == 0  # Megatron's mlp scope is the dense MLP's
    assert n("moe", c=casts) == KERNELS_FWD - ATTN_KERNELS_FWD + moe + 4
    assert n("attn", "moe", c=casts) == KERNELS_FWD + moe + sum(casts.values())
    assert n("layer", c=casts) == KERNELS_FWD + moe + sum(casts.values())
    assert ROUTER + PRE < MOE_KERNELS_FWD


def test_an_engine_cell_names_its_scopes_and_a_wrong_one_is_refused():
    cell = "NeMo (Megatron-Bridge), HybridEP, CUDA graph scope attn moe_router moe_preprocess"
    assert scopes_said(cell) == ("attn", "moe_router", "moe_preprocess")
    assert scopes_said("Megatron-Core, CUDA graph scope: layer") == ("layer",)
    assert scopes_said("nemo, full-iteration CUDA graph") == ()
    assert unknown_scopes("nemo, CUDA graph scope attn moe_routr") == ("moe_routr",)
    assert set(SCOPES) >= {"attn", "moe_router", "moe_preprocess", "layer"}

    from paratrain.systems.row_engine import engine_as_said, engine_options

    fields, why = engine_options({"engine": cell})
    assert dict(fields)["graph_scopes"] == ("attn", "moe_router", "moe_preprocess")
    assert "replay from CUDA graphs" in why
    assert engine_as_said(cell).graph_scopes == ("attn", "moe_router", "moe_preprocess")
    assert engine_options({"engine": "NeMo (Megatron-Bridge)"}) == ((), "")
    with pytest.raises(ValueError, match="'moe_routr' is unknown"):
        engine_as_said("nemo, CUDA graph scope attn moe_routr")


def test_graphed_kernels_cost_the_gpus_gap_and_nothing_else_changes():
    """The model zoo's Qwen3-235B on 256 GB200 (its command graphs attention, router and
    preprocessing): the same row without the words launches every kernel from the host;
    the difference is exactly the graphed kernels' launches, three per forward kernel
    (forward, and backward's two), per block and micro-batch."""
    from paratrain.systems.fitting import breakdown, load_params
    from paratrain.systems.overlap import GRAPH_KERNEL_S
    from paratrain.systems.runs import read_runs, row_to_case

    row = next(r for r in read_runs() if r["id"] == "mz_qwen3_235b_gb200_256_bf16")
    assert "CUDA graph scope attn moe_router moe_preprocess" in row["engine"]
    graphed = row_to_case(row)
    plain = row_to_case({**row, "engine": row["engine"].split(", CUDA graph")[0]})
    p = load_params()
    g, b = breakdown(graphed, p), breakdown(plain, p)
    per_block = 3 * (ATTN_KERNELS_FWD + ROUTER + PRE) * (p.kernel_s - GRAPH_KERNEL_S)
    assert b.overhead_s - g.overhead_s == pytest.approx(per_block * g.blocks * g.micro_batches)
    assert g.comm == b.comm and g.step_s < b.step_s


def test_plan_refuses_an_unknown_scope_in_one_line(capsys):
    from paratrain.cli import main

    assert main(["plan", "--model", "qwen3-235b-a22b", "--gpus", "256", "--pp", "8",
                 "--ep", "8", "--engine", "nemo, CUDA graph scope attn moe_routr"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: CUDA graph scope 'moe_routr'")
