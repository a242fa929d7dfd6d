"""paratrain's context parallelism (cp 2 and 4, ring and all-to-all) against one process
attending over the whole sequence, side by side, at a long context.

    python benchmarks/context_parallel.py [--rounds 2] [--steps 3] [--context 2048]
        [--try-torch] [--json out.json]

Why not torch's own: ``torch.distributed.tensor.experimental.context_parallel`` (torch
2.13) swaps the sdpa kernels it knows (flash, efficient, cuDNN: CUDA kernels) for its
ring; on CPU sdpa dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``,
which has no context-parallel rule, so on gloo/CPU it stops with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
strategy registered" (``--try-torch`` runs that attempt and prints what it raised). The
baseline here is therefore ``cp1``: one process, torch's fused causal sdpa over the
full sequence (the plain model).

Every run is ``paratrain.run.loop.train`` in a fresh set of gloo processes (one thread
each, :func:`paratrain.parallel.process_groups.spawn`): cp1 on 1 process, cpN on N, one sequence
per step (global batch 1), float32, the same weights and batches. Runs alternate cp1,
cp2 ring, cp4 ring, cp2 all-to-all, cp4 all-to-all, rotating the start each round
(``benchmarks/_common.alternate``). Per run: step time (the run's mean after its first
step), exposed CP communication (seconds per step rank 0 waited for K/V blocks, or spent
in the all-to-alls: what overlap did not hide), rank 0's activation peak (bytes saved for
backward, measured by the saved-tensor meter) beside the systems model's
(``paratrain.cost.memory.activation_bytes``), and bytes rank 0 sent for attention
beside ``paratrain.cost.layout.cp_wire_bytes``. The summary prints medians over rounds and
the ratios to cp1 (each round's runs paired).

Predicted beside measured: before each run the parent prices it with
:func:`paratrain.predict.predict` on this machine's profile (``paratrain bench
calibrate``; the CPU fit of ``paratrain check-model``), with the other sessions' load
sampled just then: step time, exposed CP communication, rank 0's activation peak and the
bytes it sends; the summary prints measured | predicted | measured / predicted. Without a
profile it prints one line saying how to make one and the measured columns only
(calibrating inside the benchmark would take minutes and load the cores it times).

On 2 busy cores cpN runs N processes on them: its step time measures the algorithm's
overhead (block bookkeeping, the merge, sends) more than any speed-up, which needs N
real devices. The activation and byte columns do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics

from _common import alternate
from paratrain.config import ModelConfig, TrainConfig
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.predict import CALIBRATE_HINT, load_machine, predict, sample_other_sessions

IMPLS = {"cp1": (1, "ring"), "cp2-ring": (2, "ring"), "cp4-ring": (4, "ring"),
         "cp2-all-to-all": (2, "all-to-all"), "cp4-all-to-all": (4, "all-to-all")}


def _run_config(world: int, algo: str, steps: int) -> tuple[TrainConfig, ParallelPlan]:
    """The run each impl makes: one sequence per step, float32, cp = world."""
    tcfg = TrainConfig(steps=steps + 1, global_batch=1, lr=1e-3, warmup_steps=1,
                       eval_every=0, eval_batches=1, dtype="float32")
    return tcfg, ParallelPlan(cp=world, cp_algorithm=algo)


def _worker(rank: int, world: int, mcfg: ModelConfig, algo: str, steps: int) -> dict:
    from paratrain.run.loop import RunOptions, train

    tcfg, plan = _run_config(world, algo, steps)
    s = train(mcfg, tcfg, plan if world > 1 else None,
              RunOptions(quiet=True, measure_peak=False))
    cp = s["model_parallel"].get("cp", {})
    mem = s["memory"]
    return {"step_s": s["step_s"], "losses": s["losses"],
            "exposed_s": cp.get("exposed_comm_s_per_step", 0.0),
            "bytes": cp.get("wire_bytes_per_step", 0.0),
            "bytes_formula": cp.get("formula_wire_bytes_per_step", 0.0),
            "act": mem["measured_per_rank"][0]["activations_peak"],
            "act_pred": mem["predicted_per_rank"]["activations_peak"]}


def _try_torch(rank: int, world: int) -> str:
    """One causal sdpa under torch's context_parallel on a gloo cp mesh: what happens."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    x = torch.randn(1, 2, 16, 8)
    w = torch.randn(8, 8, requires_grad=True)
    try:
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[2]):
            q = x @ w
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        return "ran"
    except Exception as e:  # noqa: BLE001 - reported, this is the point of the probe
        return f"{type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (one more untimed)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--n-layers", type=int, default=2)
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset")
    ap.add_argument("--try-torch", action="store_true",
                    help="also try torch's context_parallel on 2 gloo ranks and print why")
    ap.add_argument("--json", default=None, help="write every run's record here")
    ap.add_argument("--profile", default=None,
                    help="machine profile (default ~/.cache/paratrain/hardware.toml)")
    args = ap.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    for i in impls:
        if i not in IMPLS:
            raise SystemExit(f"error: --impls {i!r} is unknown; use some of {', '.join(IMPLS)}")
    mcfg = ModelConfig(n_layers=args.n_layers, d_model=args.d_model, n_heads=args.n_heads,
                       d_ff=int(8 * args.d_model / 3), context=args.context)
    if args.try_torch:
        print("torch context_parallel on gloo/CPU:", spawn(_try_torch, 2, timeout_s=300)[0])
    machine = load_machine(args.profile)
    if machine is None:
        print(CALIBRATE_HINT)
    records = []
    for rnd, impl in alternate(impls, args.rounds, rotate=True):
        world, algo = IMPLS[impl]
        pred = None
        if machine is not None:
            tcfg, plan = _run_config(world, algo, args.steps)
            pred = predict(mcfg, tcfg, plan, world, machine.replace(
                others=sample_other_sessions(samples=5))).to_dict()
        r = spawn(_worker, world, mcfg, algo, args.steps, timeout_s=1800)[0]
        r.update(impl=impl, round=rnd, pred=pred)
        records.append(r)
        p = (f"; predicted step {pred['step_s']:.3f} s, exposed {pred['cp_exposed_s']:.3f} s "
             f"({pred['share']:.2f} core per rank)") if pred else ""
        print(f"round {rnd} {impl:>15}: step {r['step_s']:.3f} s, exposed comm "
              f"{r['exposed_s']:.3f} s, activations {r['act'] / 1e6:.2f} MB "
              f"(model {r['act_pred'] / 1e6:.2f}), sent {r['bytes'] / 1e6:.2f} MB "
              f"(formula {r['bytes_formula'] / 1e6:.2f}){p}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    _summary(records, impls, mcfg)


def _summary(records: list[dict], impls: list[str], mcfg: ModelConfig) -> None:
    def med(impl: str, key) -> float:
        get = key if callable(key) else (lambda r: r[key])
        return statistics.median(get(r) for r in records if r["impl"] == impl)

    def ratio(impl: str, key: str) -> float:
        """Median over rounds of impl / cp1 within a round."""
        base = {r["round"]: r[key] for r in records if r["impl"] == "cp1"}
        vals = [r[key] / base[r["round"]] for r in records
                if r["impl"] == impl and r["round"] in base and base[r["round"]]]
        return statistics.median(vals) if vals else float("nan")

    def mp(impl: str, key: str, pkey: str, scale: float = 1.0, w: int = 7) -> str:
        """measured | predicted | measured / predicted (medians over rounds)."""
        m = med(impl, key) / scale
        if any(r["pred"] is None for r in records if r["impl"] == impl):
            return f"{m:{w}.3f} {'-':>{w}} {'-':>5}"
        p = med(impl, lambda r: r["pred"][pkey]) / scale
        q = f"{m / p:5.2f}" if p else f"{'-':>5}"
        return f"{m:{w}.3f} {p:{w}.3f} {q}"

    print(f"\ncontext {mcfg.context}, d_model {mcfg.d_model}, {mcfg.n_heads} heads, "
          f"{mcfg.n_layers} layers, float32, one sequence per step; medians over rounds; "
          "each quantity: measured, predicted, measured/predicted")
    print(f"{'impl':>15} | {'step s':>7} {'pred':>7} {'m/p':>5} {'x cp1':>5} | "
          f"{'exposed':>7} {'pred':>7} {'m/p':>5} | {'act MB':>7} {'pred':>7} {'m/p':>5} "
          f"{'x cp1':>5} | {'sent MB':>7} {'pred':>7} {'m/p':>5}")
    for impl in impls:
        print(f"{impl:>15} | {mp(impl, 'step_s', 'step_s')} {ratio(impl, 'step_s'):5.2f} | "
              f"{mp(impl, 'exposed_s', 'cp_exposed_s')} | "
              f"{mp(impl, 'act', 'activations_bytes', 1e6)} {ratio(impl, 'act'):5.3f} | "
              f"{mp(impl, 'bytes', 'cp_wire_bytes', 1e6)}")
    preds = [r["pred"] for r in records if r["pred"]]
    notes = sorted({n.split(":")[0] for p in preds for n in p["notes"]})
    if notes:
        print("prediction notes: " + "; ".join(notes) + " (per-run detail in --json)")
    ref = [r["losses"] for r in records if r["impl"] == "cp1"]
    if ref:
        worst = max(abs(a - b) for r in records for a, b in zip(r["losses"], ref[0],
                                                                 strict=True))
        print(f"largest loss difference to cp1 at the same step: {worst:.2e} (float32)")


if __name__ == "__main__":
    main()
