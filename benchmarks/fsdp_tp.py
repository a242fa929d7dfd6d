"""paratrain's 2-D FSDP x TP against PyTorch's own, side by side.

    python benchmarks/fsdp_tp.py [--rounds 3] [--steps 10] [--zero 3] [--json out.json]

4 gloo ranks (1 thread each), tp 2 (inner) x dp 2, ZeRO-3 over dp:

- ``paratrain-fsdp-tp``: ``build_engine`` with ``ParallelPlan(dp=2, tp=2, zero=3)``
  (``--zero 0`` swaps ZeRO-3 for paratrain's bucketed all-reduce over dp: not like for
  like, and the summary says so);
- ``torch-fsdp2-tp``: DTensor tensor parallelism
  (``torch.distributed.tensor.parallel.parallelize_module``) on the ``tp`` axis of
  ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``, then
  ``torch.distributed.fsdp.fully_shard`` (FSDP2) on each block and the root over ``dp``.

Both shard the same way (Megatron-LM's plan, as paratrain/parallel/tensor.py does):
attention ``wq, wk, wv`` column-parallel (by heads) and ``wo`` row-parallel; SwiGLU
``w_gate, w_up`` column-parallel and ``w_down`` row-parallel; the embedding split by
vocabulary rows (``RowwiseParallel``) and the head by vocabulary columns
(``ColwiseParallel`` keeping the logits sharded, with ``loss_parallel`` computing the
cross-entropy from the shards: the full logits are never gathered, as in paratrain).
torch's column-parallel outputs are plain local tensors (``use_local_output``), so
paratrain's unchanged ``Attention`` reads the local head count from their width. Norm
gains stay replicated over tp in both.

Same model (``paratrain.model.Decoder``, identically seeded: same weights), same global
batch each step (``paratrain.files.batches.Corpus``, the standard-library corpus), same optimizer
(``paratrain.parallel.optim.build_adamw``: AdamW foreach=False, decay on matrices only; warm-up +
cosine LR from ``lr_at``; clip 1.0 by the global norm), float32, the loss normalised by
the global token count. (torch's ``clip_grad_norm_`` refuses the mix of 2-D and dp-only
DTensors FSDP2 leaves, so the torch side combines torch's per-mesh norms:
``_clip_global_norm``.)

Runs alternate paratrain, torch, paratrain, torch, ... for ``--rounds``; each is a fresh
set of 4 processes. Measuring conventions are
data_parallel.py's (benchmarks/_common.py): ``--warmup`` untimed steps (default 1), then
``--steps`` timed ones; step time = the slower rank's median; peak RSS per rank.

Default model: 4 layers, d_model 256, 8 heads, d_ff 688, context 128, vocabulary 256
(3.29 M parameters), global batch 16 windows (2048 tokens); ``--rounds 1 --steps 5``
takes about a minute on 2 busy cores.

Records (``--json``), one per run: impl, round, zero, step_s, tokens_per_s, peak_rss_mb
(per rank), losses (every step's global mean loss, warm-up included). The summary prints
each impl's medians, the median over rounds of the paratrain/torch ratio of tokens/s and
of peak RSS (the larger rank's; runs of the same round are paired, which cancels load
that drifts between rounds), and the largest loss difference between the two
implementations at the same step (float32: ~1e-7, a few ulps of a loss of ~5).
Peak RSS includes the ~400 MB every process pays for Python and torch; the model's own
state (3.29 M parameters, gradients, AdamW moments: ~53 MB unsharded) is a small part.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics

import torch

from _common import alternate, median_of, peak_rss_mb, timed_steps, torch_step
from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.shapes import as_shape
from paratrain.parallel.process_groups import spawn

DP, TP = 2, 2
IMPLS = ("paratrain-fsdp-tp", "torch-fsdp2-tp")
MODEL = ModelConfig(n_layers=4, d_model=256, n_heads=8, d_ff=688, context=128)  # 3.29 M


def _paratrain(mcfg: ModelConfig, tcfg: TrainConfig, zero: int):
    """step(x, y, tokens, lr) -> local loss sum; the engine (its dp rank, its all_sum)."""
    from paratrain.parallel.api import build_engine
    from paratrain.plan import ParallelPlan
    from paratrain.run.loop import build_model

    plan = ParallelPlan(dp=DP, tp=TP, zero=zero)
    plan.check(mcfg, DP * TP, tcfg.global_batch)
    engine = build_engine(build_model(mcfg, tcfg, torch.device("cpu")), tcfg, plan,
                          torch.device("cpu"))

    def step(x, y, tokens, lr):
        s = engine.forward_backward(x, y, tokens)
        engine.reduce_gradients()
        engine.clip_and_step(lr)
        return s

    return step, engine.dp_rank, engine.dp_size, engine.all_sum


def _clip_global_norm(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """Clip by the norm over every shard of every parameter. FSDP2 on a 2-D mesh leaves
    two kinds of DTensor: (dp, tp) for tensor-parallel weights and dp-only for the norm
    gains (replicated over tp), and ``torch.nn.utils.clip_grad_norm_`` refuses to stack
    norms from different meshes (torch 2.13: "All operands in aten.stack.default must
    have the same mesh"), so the norm is taken per mesh (torch's ``get_total_norm``),
    then combined, then torch's ``clip_grads_with_norm_`` scales every gradient."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p.grad)
    sq = torch.zeros((), dtype=torch.float64)
    for grads in by_mesh.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False)
        n = n.full_tensor() if isinstance(n, DTensor) else n
        sq += n.double() ** 2
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, sq.sqrt().float(), foreach=False)


def _torch(mcfg: ModelConfig, tcfg: TrainConfig):
    """Same contract as :func:`_paratrain`, with DTensor TP + FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    from paratrain.parallel.engine import token_loss_sum
    from paratrain.parallel.optim import build_adamw
    from paratrain.run.loop import build_model

    # DTensor warns, once per process, that the (dp, tp) gradient norm takes two
    # sequential all-reduces; that is torch's path and it is what we time: keep it quiet.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model = build_model(mcfg, tcfg, torch.device("cpu"))
    parallelize_module(model, mesh["tp"], {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    block_plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                  "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
                  "mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(),
                  "mlp.w_down": RowwiseParallel()}
    for blk in model.blocks:
        parallelize_module(blk, mesh["tp"], block_plan)
        fully_shard(blk, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = build_adamw(model, tcfg)
    params = list(model.parameters())
    step = torch_step(lambda x, y: token_loss_sum(model(x), y), opt,
                      lambda: _clip_global_norm(params, tcfg.grad_clip),
                      grad_scale=float(DP),  # FSDP2 averages its reduce-scatter over dp
                      loss_context=loss_parallel)
    dp_group = mesh["dp"].get_group()

    def local(x, y, tokens, lr):
        loss = step(x, y, tokens, lr)
        return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)

    def all_sum(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        torch.distributed.all_reduce(t, group=dp_group)  # tp ranks hold the same loss
        return t.tolist()

    return local, mesh["dp"].get_local_rank(), DP, all_sum


def _worker(rank: int, world: int, impl: str, mcfg: ModelConfig, batch: int, steps: int,
            warmup: int, zero: int) -> dict:
    from paratrain.files.batches import Corpus
    from paratrain.parallel.optim import lr_at

    tcfg = TrainConfig(steps=warmup + steps, global_batch=batch, lr=1e-3, warmup_steps=1,
                       dtype="float32")
    corpus = Corpus.load(tcfg.data, tcfg.val_fraction, mcfg.context)
    if impl == "torch-fsdp2-tp":
        step, dp_rank, dp_size, all_sum = _torch(mcfg, tcfg)
    else:
        step, dp_rank, dp_size, all_sum = _paratrain(mcfg, tcfg, zero)
    tokens = batch * mcfg.context

    def one(k: int) -> float:
        x, y = corpus.batch(tcfg.seed, k, batch, mcfg.context, dp_rank, dp_size)
        return step(x, y, tokens, lr_at(k, tcfg))

    times, sums = timed_steps(one, warmup, steps)
    losses = [s / tokens for s in all_sum(sums)]  # after timing: not part of a step
    return {"step_s": statistics.median(times), "losses": losses, "peak_rss_mb": peak_rss_mb()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16, help="global batch (windows)")
    ap.add_argument("--zero", type=int, default=3, choices=(0, 3),
                    help="paratrain's ZeRO stage over dp (0: all-reduce; torch is FSDP2)")
    ap.add_argument("--n-layers", type=int, default=MODEL.n_layers)
    ap.add_argument("--d-model", type=int, default=MODEL.d_model)
    ap.add_argument("--n-heads", type=int, default=MODEL.n_heads)
    ap.add_argument("--d-ff", type=int, default=MODEL.d_ff)
    ap.add_argument("--context", type=int, default=MODEL.context)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--impls", default=",".join(IMPLS), help="a subset, comma-separated")
    ap.add_argument("--json", default=None, help="write the records here")
    a = ap.parse_args(argv)
    impls = [i for i in IMPLS if i in a.impls.split(",")]
    mcfg = MODEL.replace(n_layers=a.n_layers, d_model=a.d_model, n_heads=a.n_heads,
                         d_ff=a.d_ff, context=a.context)
    tokens = a.batch * mcfg.context
    print(f"{os.cpu_count()} CPU cores; model {as_shape(mcfg).num_params():,} parameters "
          f"(L={mcfg.n_layers} d={mcfg.d_model} H={mcfg.n_heads} ff={mcfg.d_ff} "
          f"T={mcfg.context}), {a.batch} x {mcfg.context} tokens/step, "
          f"dp {DP} x tp {TP} = {DP * TP} ranks gloo, 1 thread each; paratrain zero={a.zero}, "
          f"torch FSDP2 (ZeRO-3); {a.rounds} rounds x {a.steps} steps (+{a.warmup} warm-up)",
          flush=True)
    records = []
    for rnd, impl in alternate(impls, a.rounds, rotate=False):
        res = spawn(_worker, DP * TP, impl, mcfg, a.batch, a.steps, a.warmup, a.zero,
                    timeout_s=a.timeout)
        step_s = max(r["step_s"] for r in res)
        rec = {"impl": impl, "round": rnd, "zero": a.zero if impl.startswith("paratrain")
               else 3, "step_s": step_s, "tokens_per_s": tokens / step_s,
               "peak_rss_mb": [r["peak_rss_mb"] for r in res], "losses": res[0]["losses"]}
        records.append(rec)
        print(f"  round {rnd} {impl:<18} {step_s:.4f} s/step  {tokens / step_s:8.0f} tok/s  "
              f"peak RSS {max(rec['peak_rss_mb']):.1f} MB  loss {rec['losses'][0]:.5f} -> "
              f"{rec['losses'][-1]:.5f}", flush=True)
    print(f"\n{'impl':<18} {'s/step':>8} {'tokens/s':>9} {'peak RSS MB':>12}")
    for impl in impls:
        s = median_of(records, impl, lambda r: r["step_s"])
        print(f"{impl:<18} {s:8.4f} {tokens / s:9.0f} "
              f"{median_of(records, impl, lambda r: max(r['peak_rss_mb'])):12.1f}")
    if len(impls) == 2:
        _compare(records)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


def _compare(records: list[dict]) -> None:
    ours, theirs = IMPLS
    tps = statistics.median(o["tokens_per_s"] / t["tokens_per_s"]
                            for o, t in _pairs(records, ours, theirs))
    rss = statistics.median(max(o["peak_rss_mb"]) / max(t["peak_rss_mb"])
                            for o, t in _pairs(records, ours, theirs))
    print(f"{ours} / {theirs}, median of the per-round ratios: tokens/s {tps:.3f}, "
          f"peak RSS {rss:.3f}")
    if ours_zero := {r["zero"] for r in records if r["impl"] == ours} - {3}:
        print(f"  (paratrain ran zero={min(ours_zero)}, torch ZeRO-3: not like for like)")
    first, worst = loss_differences(records)
    print(f"largest |loss difference| paratrain vs torch at the same step: {worst:.3g} "
          f"(first step {first:.3g}; float32, {len(records[0]['losses'])} steps per run)")


def _pairs(records: list[dict], ours: str, theirs: str):
    """(ours, theirs) records of the same round."""
    by = {(r["impl"], r["round"]): r for r in records}
    return [(by[ours, k], by[theirs, k]) for k in sorted({r["round"] for r in records})
            if (ours, k) in by and (theirs, k) in by]


def loss_differences(records: list[dict]) -> tuple[float, float]:
    """Largest |loss_ours - loss_torch| over every pair of runs: at the first step, and
    at any step."""
    ours = [r["losses"] for r in records if r["impl"] == IMPLS[0]]
    theirs = [r["losses"] for r in records if r["impl"] == IMPLS[1]]
    first = max(abs(a[0] - b[0]) for a in ours for b in theirs)
    worst = max(abs(u - v) for a in ours for b in theirs for u, v in zip(a, b, strict=True))
    return first, worst


if __name__ == "__main__":
    main()
