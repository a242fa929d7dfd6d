"""paratrain's data parallelism against PyTorch's own, side by side.

    python benchmarks/data_parallel.py [--rounds 3] [--steps 10] [--json out.json]

Pairs, on the same model, global batch and world size (2 ranks, gloo, 1 thread each):

- ``paratrain-ddp`` (bucketed, overlapped all-reduce) vs ``torch-ddp``
  (``torch.nn.parallel.DistributedDataParallel``), both with 4 MB buckets;
- ``paratrain-zero3`` (FSDP units: embedding, each block, head) vs ``torch-fsdp2``
  (``torch.distributed.fsdp.fully_shard`` on each block, then on the root);
- ``paratrain-ddp-sync`` (overlap off) to show the exposed communication overlap hides;
- ``one-process-2-threads``: the whole batch in one process with 2 intra-op threads, the
  bar data parallelism on 2 cores has to approach.

Every run is a fresh pair of processes (so peak RSS belongs to one implementation), and
the implementations alternate round by round (so drifting machine load hits all alike).
Each run takes ``--warmup`` untimed steps, then ``--steps`` timed ones; the table shows
medians over rounds of the per-run median step time (the slower rank's), and of the
per-run peak RSS (the larger rank's). All runs share one optimizer recipe
(AdamW, foreach=False, clip 1.0) and the loss normalised by the global token count.
These conventions live in benchmarks/_common.py, shared with fsdp_tp.py.

Records (``--json``): impl, round, step_s, tokens_per_s, peak_rss_mb (per rank),
exposed_comm_s (paratrain only: wall time waiting on gradient communication after
backward; torch does not expose it).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from _common import alternate, median_of, peak_rss_mb, timed_steps, torch_step
from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.shapes import as_shape
from paratrain.parallel.process_groups import spawn

MODEL = ModelConfig(n_layers=4, d_model=256, n_heads=8, d_ff=688, context=128)  # 3.29 M
IMPLS = ("paratrain-ddp", "torch-ddp", "paratrain-zero3", "torch-fsdp2", "paratrain-ddp-sync",
         "one-process-2-threads")
BUCKET_MB = 4.0


def _batch(step: int, rank: int, world: int, batch: int, ctx: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, MODEL.vocab_size, (batch, ctx + 1), generator=g)
    per = batch // world
    x = x[rank * per:(rank + 1) * per]
    return x[:, :-1], x[:, 1:]


def _paratrain(impl: str, tcfg: TrainConfig):
    from paratrain.parallel.api import build_engine
    from paratrain.plan import ParallelPlan
    from paratrain.run.loop import build_model

    zero = 3 if impl == "paratrain-zero3" else 0
    world = 1 if impl == "one-process-2-threads" else 2
    plan = ParallelPlan(dp=world, zero=zero, bucket_mb=BUCKET_MB,
                        overlap=impl != "paratrain-ddp-sync")
    model = build_model(MODEL, tcfg, torch.device("cpu"))
    engine = build_engine(model, tcfg, plan, torch.device("cpu"))

    def step(x, y, tokens, lr):
        engine.forward_backward(x, y, tokens)
        comm = engine.reduce_gradients()
        engine.clip_and_step(lr)
        return comm.seconds

    return step


def _torch(impl: str, tcfg: TrainConfig):
    from paratrain.parallel.engine import token_loss_sum
    from paratrain.parallel.optim import build_adamw
    from paratrain.run.loop import build_model

    model = build_model(MODEL, tcfg, torch.device("cpu"))
    if impl == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        scale = 2.0  # DDP averages over ranks; the loss is normalised globally already
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
        scale = 2.0  # FSDP2 also averages its reduce-scatter over ranks
    opt = build_adamw(model, tcfg)
    params = list(model.parameters())
    torch_update = torch_step(
        lambda x, y: token_loss_sum(wrapped(x), y), opt,
        lambda: torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip, foreach=False),
        grad_scale=scale)

    def step(x, y, tokens, lr):
        torch_update(x, y, tokens, lr)
        return None  # torch does not expose its communication wait

    return step


def _worker(rank: int, world: int, impl: str, steps: int, warmup: int, batch: int) -> dict:
    tcfg = TrainConfig(steps=steps + warmup, global_batch=batch, lr=1e-3, warmup_steps=1)
    if impl == "one-process-2-threads":
        torch.set_num_threads(2)
    make = _torch if impl.startswith("torch") else _paratrain
    step = make(impl, tcfg)
    tokens = batch * MODEL.context
    times, outs = timed_steps(
        lambda k: step(*_batch(k, rank, world, batch, MODEL.context), tokens, 1e-3),
        warmup, steps)
    exposed = [e for e in outs[warmup:] if e is not None] if world > 1 else []
    return {"step_s": statistics.median(times),
            "exposed_comm_s": statistics.median(exposed) if exposed else None,
            "peak_rss_mb": peak_rss_mb()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--json", default=None, help="write the records here")
    a = ap.parse_args()
    impls = a.impls.split(",")
    tokens = a.batch * MODEL.context
    records = []
    print(f"model {as_shape(MODEL).num_params():,} parameters, {a.batch} x {MODEL.context} "
          "tokens/step, "
          f"2 ranks gloo, 1 thread each; {a.rounds} rounds x {a.steps} steps", flush=True)
    for rnd, impl in alternate(impls, a.rounds, rotate=True):
        world = 1 if impl == "one-process-2-threads" else 2
        res = spawn(_worker, world, impl, a.steps, a.warmup, a.batch)
        step_s = max(r["step_s"] for r in res)
        exposed = [r["exposed_comm_s"] for r in res]
        rec = {"impl": impl, "round": rnd, "step_s": step_s,
               "tokens_per_s": tokens / step_s,
               "peak_rss_mb": [r["peak_rss_mb"] for r in res],
               "exposed_comm_s": None if exposed[0] is None else max(exposed)}
        records.append(rec)
        print(f"  round {rnd} {impl:<20} {step_s:.4f} s/step", flush=True)
    rows = {}
    for impl in impls:
        ex = [r["exposed_comm_s"] for r in records
              if r["impl"] == impl and r["exposed_comm_s"] is not None]
        rows[impl] = {"step_s": median_of(records, impl, lambda r: r["step_s"]),
                      "rss": median_of(records, impl, lambda r: max(r["peak_rss_mb"])),
                      "exposed": statistics.median(ex) if ex else None}
    print(f"\n{'impl':<20} {'s/step':>8} {'tokens/s':>9} {'peak RSS MB':>12} "
          f"{'exposed comm s':>15}")
    for impl, r in rows.items():
        ex = f"{r['exposed']:.4f}" if r["exposed"] is not None else "-"
        print(f"{impl:<20} {r['step_s']:8.4f} {tokens / r['step_s']:9.0f} {r['rss']:12.1f} "
              f"{ex:>15}")
    for ours, theirs in (("paratrain-ddp", "torch-ddp"), ("paratrain-zero3", "torch-fsdp2"),
                         ("paratrain-ddp", "one-process-2-threads")):
        if ours in rows and theirs in rows:
            print(f"{ours} / {theirs}: tokens/s ratio "
                  f"{rows[theirs]['step_s'] / rows[ours]['step_s']:.3f}, peak RSS ratio "
                  f"{rows[ours]['rss'] / rows[theirs]['rss']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
