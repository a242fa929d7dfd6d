"""An MoE decoder (E experts, top-k) against the dense decoder with the same *active*
parameters, trained the same number of steps on the same batches (issue 12).

Equal active parameters: the dense MLP width is ``top_k x moe_ffn``, so a token passes
through the same MLP matrices either way (the MoE adds its router, d x E per layer);
active parameters, and so model FLOPs per token (6 N_active + attention), match to that
router. A third run, the dense model with the MoE's *total* parameters (width E x
moe_ffn), shows what the extra experts could at most buy.

Every run is one process, float32, the default corpus (the Python standard library's
source, byte-level), the same seed, so the same batches in the same order. It prints
each model's parameter counts, FLOPs per token, the mean training loss over the last
``--tail`` steps and the validation loss at the end (``--eval-batches`` windows of the
held-out split).

    PYTHONPATH=src python benchmarks/moe_vs_dense.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.shapes import as_shape
from paratrain.run.loop import RunOptions, train


def models(args) -> dict[str, ModelConfig]:
    base = ModelConfig(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                       d_ff=args.top_k * args.moe_ffn, context=args.context)
    moe = base.replace(experts=args.experts, top_k=args.top_k, moe_ffn=args.moe_ffn,
                       aux_loss_coef=args.aux_loss_coef, z_loss_coef=args.z_loss_coef)
    out = {"dense, equal active": base, f"moe E={args.experts} k={args.top_k}": moe}
    if args.total:
        out["dense, equal total"] = base.replace(d_ff=args.experts * args.moe_ffn)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-ffn", type=int, default=64)
    ap.add_argument("--aux-loss-coef", type=float, default=0.01)
    ap.add_argument("--z-loss-coef", type=float, default=0.0)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-batches", type=int, default=32)
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-total", dest="total", action="store_false",
                    help="skip the dense model with the MoE's total parameters")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t = TrainConfig(steps=args.steps, global_batch=args.global_batch, lr=args.lr,
                    warmup_steps=min(20, args.steps // 10), eval_every=0,
                    eval_batches=args.eval_batches, dtype="float32", seed=args.seed)
    rows = {}
    for name, m in models(args).items():
        t0 = time.perf_counter()
        s = train(m, t, None, RunOptions(quiet=True, measure_peak=False))
        tail = s["losses"][-args.tail:]
        shape = as_shape(m)
        rows[name] = {"params": shape.num_params(), "active_params": shape.active_params(),
                      "flops_per_token": shape.flops_per_token(), "train_loss_tail":
                      sum(tail) / len(tail), "val_loss": s["val_loss"],
                      "seconds": time.perf_counter() - t0}
        if m.experts:
            last = s["moe_steps"][-1]
            rows[name]["load_max_over_mean"] = last["moe_tokens_max"] / last[
                "moe_tokens_mean"]
        r = rows[name]
        print(f"{name:<22} params {r['params']:>9,}  active {r['active_params']:>9,}  "
              f"FLOPs/token {r['flops_per_token']:>11,.0f}  train (mean of last "
              f"{len(tail)}) {r['train_loss_tail']:.4f}  val {r['val_loss']:.4f}  "
              f"({r['seconds']:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
