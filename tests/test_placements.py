"""Placements: what each transform records on a parameter is where it really sits.

The oracle is the plain model itself: every rank builds the same seeded Decoder, keeps a
copy, and applies the layout. For every piece its optimizer owns, the placement's box of
the plain tensor (narrowed to the owned flat range) must hold exactly the optimizer's
value, and over all ranks the canonical pieces must cover every element of every plain
tensor exactly once (which is what the checkpoint writes and the norm counts).
"""

from __future__ import annotations

import pytest
import torch

from paratrain.config import ModelConfig, TrainConfig
from paratrain.parallel.placement import Placement, placement_of, record_plain
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan

M4 = ModelConfig(n_layers=4, d_model=32, n_heads=4, d_ff=64, context=16)
ODD = ModelConfig(n_layers=4, d_model=36, n_heads=2, d_ff=50, context=16, vocab_size=131)
MOE = M4.replace(experts=4, top_k=2)
LAYOUTS = {  # name: (model, plan, the data-axis classes the plan chooses)
    "tp2 zero3 odd vocab": (ODD, ParallelPlan(dp=2, tp=2, zero=3), ["Units"]),
    "tp2 zero0": (M4, ParallelPlan(dp=2, tp=2), ["Buckets"]),
    "pp2 zero1 interleaved": (M4.replace(n_layers=8),
                              ParallelPlan(dp=2, pp=2, zero=1, micro_batches=4,
                                           schedule="interleaved", virtual_stages=2),
                              ["Zero"]),
    "dp4 zero2": (M4, ParallelPlan(dp=4, zero=2), ["Zero"]),
    "dp4 topk": (M4, ParallelPlan(dp=4, compress="topk:8"), ["TopK"]),
    "ep2 zero3 moe": (MOE, ParallelPlan(dp=4, ep=2, zero=3), ["Units", "Units"]),
    "ep2 tp2 zero1 moe": (MOE, ParallelPlan(dp=2, ep=2, tp=2, zero=1), ["Zero", "DataAxis"]),
    "cp2 zero0": (M4, ParallelPlan(dp=2, cp=2), ["Buckets"]),
    "tp2 zero3 qwen": (M4.replace(n_kv_heads=2, qkv_bias=True, qk_norm=True),
                       ParallelPlan(dp=2, tp=2, zero=3), ["Units"]),
}


def _worker(rank: int, world: int, layouts: dict) -> dict:
    import torch.distributed as dist

    from paratrain.model import Decoder
    from paratrain.parallel.api import build_engine

    cfg = TrainConfig(steps=1, global_batch=8, dtype="float64")
    out = {}
    for name, (mcfg, plan, _) in layouts.items():
        torch.manual_seed(0)
        model = Decoder(mcfg).double()
        plain = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine = build_engine(model, cfg, plan, torch.device("cpu"))
        cover = {n: torch.zeros(t.numel(), dtype=torch.int64) for n, t in plain.items()}
        wrong = []
        for p, key, _ in engine.owned_state():
            pl = placement_of(p)
            lo, hi = pl.owned
            box = plain[pl.name][tuple(slice(o, o + s) for o, s
                                       in zip(pl.offsets, pl.sizes, strict=True))]
            if not torch.equal(box.reshape(-1)[lo:hi], key.detach().reshape(-1)):
                wrong.append(pl.name)
            if pl.canonical(engine.axis_index) and lo < hi:
                idx = torch.arange(plain[pl.name].numel()).view(pl.shape)[
                    tuple(slice(o, o + s) for o, s in zip(pl.offsets, pl.sizes, strict=True))]
                cover[pl.name][idx.reshape(-1)[lo:hi]] += 1
        flat = torch.cat(list(cover.values()))
        dist.all_reduce(flat)
        parts = getattr(engine.data, "parts", (engine.data,))
        out[name] = (wrong, int(flat.min()), int(flat.max()),
                     [type(d).__name__ for d in parts])
    return out


def test_placement_is_a_frozen_record():
    pl = Placement("w", (4, 6), (0, 3), (4, 3), ("tp",), ("dp",))
    with pytest.raises(AttributeError):
        pl.name = "v"
    assert pl.owned == (0, 12)
    assert pl.canonical(lambda a: 0) and not pl.canonical(lambda a: 1)
    assert pl.canonical(lambda a: 1, skip=("dp",))


def test_one_process_records_the_plain_model():
    from paratrain.model import Decoder

    model = Decoder(M4)
    record_plain(model)
    for n, p in model.named_parameters():
        assert placement_of(p) == Placement(n, tuple(p.shape), (0,) * p.dim(),
                                            tuple(p.shape))


def test_every_layout_records_where_each_piece_sits():
    """4 ranks, eight layouts: boxes and owned ranges hold the plain values; canonical
    pieces cover each plain element exactly once; the plan chose its reducer once."""
    for name, (wrong, lo, hi, classes) in spawn(_worker, 4, LAYOUTS,
                                                timeout_s=600)[0].items():
        assert not wrong, (name, wrong)
        assert (lo, hi) == (1, 1), (name, lo, hi)
        assert classes == LAYOUTS[name][2], (name, classes)
