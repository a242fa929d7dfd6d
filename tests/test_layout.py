"""paratrain.cost.layout: the torch-free per-rank layout agrees with the runtime's pieces
(mesh coordinates, bucket packing, vocabulary rows, parameter counts), and neither it
nor the prediction imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import TINY
from paratrain.config import ModelConfig
from paratrain.cost import layout as L
from paratrain.cost.shapes import as_shape
from paratrain.plan import ParallelPlan

M4 = TINY.replace(n_layers=4, vocab_size=131)


def test_layout_and_predict_import_no_torch():
    code = ("import sys, paratrain.cost.layout, paratrain.predict; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize(("pp", "dp", "tp"), [(1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2),
                                              (3, 1, 2)])
def test_coords_agree_with_the_mesh(pp, dp, tp):
    from paratrain.parallel.mesh import coords_of, rank_of

    plan = ParallelPlan(pp=pp, dp=dp, tp=tp, micro_batches=2)
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    for r in range(pp * dp * tp):
        c = coords_of(r, sizes)
        assert L.coords(r, plan) == (c["pp"], c["dp"], c["tp"])
        assert L.rank_of(*L.coords(r, plan), plan) == r == rank_of(c, sizes)


@pytest.mark.parametrize(("pp", "dp", "cp", "tp"), [(1, 1, 4, 1), (1, 2, 2, 1), (2, 1, 2, 2),
                                                    (2, 2, 2, 2), (1, 3, 2, 2)])
def test_cp_coords_agree_with_the_mesh(pp, dp, cp, tp):
    from paratrain.parallel.mesh import axis_ranks, coords_of, rank_of

    plan = ParallelPlan(pp=pp, dp=dp, cp=cp, tp=tp)
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    for r in range(pp * dp * cp * tp):
        c = coords_of(r, sizes)
        assert L.mesh_coords(r, plan) == (c["pp"], c["dp"], c["cp"], c["tp"])
        assert L.rank_of(c["pp"], c["dp"], c["tp"], plan, cp=c["cp"]) == r == rank_of(c, sizes)
        # the reducer's view (cp folded into dp) numbers ranks the same way, and the
        # rank's dp index there is its index in the mesh's dp x cp group
        red = L.reducer_plan(plan)
        assert L.coords(r, red) == (c["pp"], axis_ranks(r, "dpcp", sizes).index(r), c["tp"])


def test_pack_matches_ddp_pack():
    import torch

    from paratrain.parallel.ddp import pack

    sizes = [5, 300, 7, 7, 1000, 3, 3, 3, 200]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for cap in (16, 40, 1200, 5000, 10**6):
        got = [b.numel for b in pack(params, cap, 4)]
        assert got == [sum(sizes[i] for i in g) for g in L.pack_groups(
            [4 * n for n in sizes], cap)]
        assert got == L.bucket_sizes(list(reversed(sizes)), 4, cap)


def test_vocab_rows_uneven_and_same_as_tensor():
    from paratrain.parallel.tensor import vocab_range

    assert vocab_range is L.vocab_range
    assert [L.vocab_range(131, 2, r) for r in range(2)] == [(0, 66), (66, 131)]
    assert [L.vocab_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    with pytest.raises(ValueError, match="smaller than tp"):
        L.vocab_range(3, 4, 0)


def test_rank_layout_tp_uneven_vocab_and_pp_split():
    plan = ParallelPlan(tp=2, pp=2, micro_batches=2)
    lays = [L.rank_layout(M4, plan, r) for r in range(4)]
    assert [(x.pp, x.tp) for x in lays] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert sum(x.blocks for x in lays[::2]) == 4
    assert lays[0].first and lays[2].last and not lays[0].last
    assert lays[0].param_sizes[0] == 66 * 32 and lays[1].param_sizes[0] == 65 * 32
    norms = 2 * 4 * 32 + 32  # replicated: counted on each tp rank
    assert sum(x.params for x in lays) == as_shape(M4).num_params() + norms
    one = ParallelPlan(pp=2, micro_batches=2)
    assert sum(L.rank_layout(M4, one, r).params for r in range(2)) == as_shape(M4).num_params()


def test_interleaved_chunks_and_fsdp_units():
    m8 = TINY.replace(n_layers=8)
    plan = ParallelPlan(pp=2, micro_batches=4, schedule="interleaved", virtual_stages=2)
    lays = [L.rank_layout(m8, plan, r) for r in range(2)]
    assert [x.stages for x in lays] == [(0, 2), (1, 3)]
    assert sum(x.params for x in lays) == as_shape(m8).num_params()
    units = [L.fsdp_unit_sizes(x) for x in lays]
    assert len(units[0]) == 2 and units[0][0][0] == m8.vocab_size * 32  # embedding unit
    assert units[1][1][-1] == 32 + m8.vocab_size * 32  # norm + head
    tied = ModelConfig(n_layers=2, d_model=32, n_heads=4, d_ff=64, context=16,
                       tie_embeddings=True)
    lay = L.rank_layout(tied, ParallelPlan(dp=2, zero=3), 0)
    assert lay.params == as_shape(tied).num_params()
    assert L.fsdp_unit_sizes(lay)[0][0] == tied.vocab_size * 32 + 32  # tok_emb + norm


def test_wire_factor():
    assert L.dp_wire_factor(ParallelPlan(dp=1)) == 0
    assert L.dp_wire_factor(ParallelPlan(dp=2, zero=1), 4) == 2
    assert L.dp_wire_factor(ParallelPlan(dp=2, zero=2, micro_batches=4)) == 5
    assert L.dp_wire_factor(ParallelPlan(dp=2, zero=3, micro_batches=4)) == 12
    assert L.dp_wire_factor(ParallelPlan(dp=2, pp=2, zero=2, micro_batches=4)) == 2
    assert L.dp_wire_factor(ParallelPlan(dp=2, pp=2, zero=3, micro_batches=4)) == 2
    assert L.dp_wire_factor(ParallelPlan(dp=4, compress="topk:8")) == 4


def test_padding_to_the_data_parallel_size_is_counted():
    """On 4 ranks ODD's flat buffers need padding (N = 2 mod 4): parameters held in flat
    buckets (ZeRO-1) count it, AdamW state holds only owned real elements."""
    odd = ModelConfig(n_layers=2, d_model=42, n_heads=3, d_ff=51, context=16)
    n = as_shape(odd).num_params()
    assert n % 4 == 2
    st = [L.state_bytes(odd, ParallelPlan(dp=4, zero=1), "float32", r) for r in range(4)]
    assert st[0]["params"] == 4 * (n + 2)
    assert sum(x["optimizer"] for x in st) == 8 * n
