"""Expert parallelism: paratrain's token exchange against a plain PyTorch one.

    python benchmarks/expert_parallel.py [--ranks 2,4] [--reps 10] [--json out.json]
    python benchmarks/expert_parallel.py --skip-moe --skip-steps --a2a-ranks 2,4,8 \
        --mib 1,4 --runs 3 --reps 30          # the all-to-all ratio table only

Three measurements, each in fresh gloo processes (one thread each), the two
implementations taking turns in the same processes (a barrier before each call) so
that load drifting on a shared machine hits both:

1. **All-to-all** of ``--mib`` MiB per rank (a list), equal pieces, at each p of
   ``--a2a-ranks``: paratrain's pairwise exchange over isend / irecv (``--collectives
   ours``: :func:`paratrain.comm.all_to_all.all_to_all`, what
   :meth:`paratrain.parallel.expert.ExpertExchange.all_to_all` calls) against torch's
   ``all_to_all_single``, the two taking turns in the same processes, each into an
   output allocated once (a fresh output per call timed the allocator as much as the
   exchange: on 2 cores a 4 MiB call took 15-45% less time into a warm buffer, and which
   kind got one depended on the call before). Bus bandwidth =
   bytes a rank sends to others ((p-1)/p of its buffer) / time; the ratio ours / torch
   from the slower rank's medians, three ways per run: ``own``, each timed only after a
   call of its own kind (turns of 3 calls of one kind, a barrier before each, the
   turn's first untimed: a call's time depends on the one before, and a training run
   calls one kind; the times and bandwidths printed are these); ``alt``,
   strictly alternating single calls (ours, torch, torch, ours, ...; each after each
   kind equally often, so each also pays for the other's aftermath); ``b2b``, alternating
   blocks of 10 calls with no barrier between them, the time per call of a block
   (nccl-tests' way: the throughput a training step's successive exchanges see, without
   the start-up after a barrier that on 2 shared cores is mostly the scheduler's).
   ``--runs`` fresh process groups per (p, size): the table prints every run's three
   ratios, their medians, and the load average when the run started (other sessions'
   work moves single runs by 2x on a shared machine; the medians are the figures to
   quote).
2. **One MoE layer, forward + backward, at ep = p** (every rank holds E / p experts):
   paratrain's :class:`paratrain.model.MoE` under
   :func:`paratrain.parallel.expert.apply_expert_parallel` (native all-to-all) against
   the same computation written plainly with PyTorch: softmax router, top-k,
   ``torch.sort`` by expert, the split sizes exchanged with ``all_to_all_single``, the
   rows with ``torch.distributed.nn.functional.all_to_all_single`` (autograd's), a loop
   over the local experts, the reverse exchange and ``index_add_`` (the shape of
   Megatron-LM's all-to-all token dispatcher). Same weights, same tokens; the outputs
   are checked equal first. Printed per p: median time of each, the ratio, the bytes
   each rank's all-to-alls sent per step (paratrain counts them; the two send the same
   rows), the share of our step spent inside the all-to-alls, and peak RSS. ep = 1 (no
   exchange, all experts local) is timed too, for scale.

3. **An MoE training step at ep = 1, 2, 4** (``--ep``): ``paratrain.run.loop.train`` on
   ep gloo processes (ep ranks are the data ranks, ``--step-seqs`` sequences each), a
   2-layer MoE decoder with the same experts, ``--steps`` timed steps after one untimed.
   Measured: step time (the run's mean after its first step), rank 0's all-to-all bytes
   per step (the runtime's count, ``ep_wire_bytes``) and seconds inside the row
   all-to-alls (forward and backward; the split-size exchange is not timed; mean over
   every step, the first included), rank 0's model states + activation peak (the
   runtime's meters) and peak RSS. Beside each, the systems model's prediction for this
   machine, :func:`paratrain.predict.predict`, priced before the run with the
   other sessions' load sampled then; the ratio measured / predicted. Without a machine
   profile (``paratrain bench calibrate``) one line says so and only the measurements
   print (calibrating in-process would take minutes and load the cores being timed).

Defaults: E = 8 experts, top-2, d_model 128, expert width 256, 2048 tokens per rank
(16 sequences of 128), float32; ``--reps 10`` takes about a minute on 2 busy cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

from _common import peak_rss_mb
from paratrain.config import ModelConfig, TrainConfig
from paratrain.parallel.process_groups import spawn
from paratrain.plan import ParallelPlan
from paratrain.predict import CALIBRATE_HINT, load_machine, predict, sample_other_sessions

BURST = 10  # calls per timed block of the back-to-back measurement
OWN_TURN = 3  # calls per turn of the after-its-own-kind measurement (the first untimed)


def _alternating(calls: dict, reps: int, burst: int = 0, turn: int = 1
                 ) -> dict[str, list[float]]:
    """Seconds per call of each, ``reps`` turns of each, the kinds alternating (the first
    of each turn alternates too, so neither always follows the other); a barrier before
    each timing. With ``burst`` > 0 each timing is that many calls back to back
    (nccl-tests' way: no barrier between them, so a rank that finishes early posts its
    next call while the slow ones finish theirs, as the exchanges of a training step
    do), timed to the barrier after the last (every rank's last call done: the same on
    every rank). With ``turn`` > 1 a turn is that many timings of one kind, the first
    untimed (it follows the other kind), so each is timed after a call of its own kind:
    a call's time depends on the call before it (on 2 cores, ours right after gloo's ran
    slower than ours after ours at 9 of 12 points, outputs allocated once;
    docs/expert-parallel.md), and a training run calls one kind only."""
    out: dict[str, list[float]] = {k: [] for k in calls}
    for i in range(reps):
        for name in list(calls)[::1 if i % 2 == 0 else -1]:
            fn = calls[name]
            for j in range(turn):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(max(1, burst)):
                    fn()
                if burst:
                    dist.barrier()
                if j or turn == 1:
                    out[name].append((time.perf_counter() - t0) / max(1, burst))
    return out


def _slowest_median(times: list[float]) -> float:
    """The slower rank's median (every rank's list is all-reduced with MAX first)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def _a2a_worker(rank: int, world: int, mib: float, reps: int) -> dict:
    from paratrain.comm.all_to_all import all_to_all

    n = int(mib * 2**20 / 4) // world * world
    x = torch.randn(n)
    splits = [n // world] * world
    # each kind's output allocated once, outside the timing (module docstring)
    out_ours, out_torch = torch.empty_like(x), torch.empty_like(x)
    calls = {"ours": lambda: all_to_all(out_ours, x, splits, splits, rank),
             "torch": lambda: dist.all_to_all_single(out_torch, x, splits, splits)}
    _alternating(calls, 2)  # untimed: first-use costs (allocator, sockets' buffers)
    times = _alternating(calls, reps)
    out = {k: _slowest_median(v) for k, v in times.items()} | {"bytes": 4 * n}
    own = _alternating(calls, reps, turn=OWN_TURN)
    own = {f"{k}_own": _slowest_median(v) for k, v in own.items()}
    burst = _alternating(calls, max(2, reps // 3), BURST)
    return out | own | {f"{k}_burst": statistics.median(v) for k, v in burst.items()}


def _a2a_table(a, records: dict) -> None:
    """Section 1: every (p, size) ``--runs`` times, each run timing ours and torch's in
    the same processes three ways (module docstring): each after its own kind (``own``,
    the times and bandwidths printed), strictly alternating, and back to back; prints
    each run's three ratios and their medians, per p and size."""
    print(f"all-to-all, per run: {a.reps} turns of {OWN_TURN} calls of one kind, timed "
          f"after their own kind (own), {a.reps} strictly alternating reps (alt), "
          f"{max(2, a.reps // 3)} alternating blocks of {BURST} calls back to back (b2b); "
          f"slower rank's medians, {a.runs} runs per row; ratio = ours/torch busbw\n"
          f"{'p':>3} {'MiB':>5} {'ours s':>9} {'torch s':>9} {'ours GB/s':>10} "
          f"{'torch GB/s':>10} {'own ratio':>9} {'alt ratio':>9} {'b2b ratio':>9}  runs' "
          f"ratios own/alt/b2b (load average at each start)")
    for p in a.a2a_ranks:
        for mib in a.mib:
            runs = []
            for _ in range(a.runs):
                load = os.getloadavg()[0]
                r = spawn(_a2a_worker, p, mib, a.reps, timeout_s=a.timeout)[0]
                runs.append(r | {"own_ratio": r["torch_own"] / r["ours_own"],
                                 "ratio": r["torch"] / r["ours"],
                                 "burst_ratio": r["torch_burst"] / r["ours_burst"],
                                 "load": load})
            ours, torch_s = (statistics.median(r[k] for r in runs)
                             for k in ("ours_own", "torch_own"))
            moved = runs[0]["bytes"] * (p - 1) / p
            med = {k: statistics.median(r[k] for r in runs)
                   for k in ("own_ratio", "ratio", "burst_ratio")}
            records[f"p{p}_{mib:g}MiB"] = {
                "p": p, "mib": mib, "median_own_ratio": med["own_ratio"],
                "median_ratio": med["ratio"], "median_burst_ratio": med["burst_ratio"],
                "runs": runs}
            each = " ".join(f"{r['own_ratio']:.2f}/{r['ratio']:.2f}/{r['burst_ratio']:.2f} "
                            f"({r['load']:.0f})" for r in runs)
            print(f"{p:>3} {mib:>5g} {ours:9.5f} {torch_s:9.5f} {moved / ours / 1e9:10.3f} "
                  f"{moved / torch_s / 1e9:10.3f} {med['own_ratio']:9.2f} {med['ratio']:9.2f} "
                  f"{med['burst_ratio']:9.2f}  {each}", flush=True)
    for p in a.a2a_ranks:
        row = ", ".join(
            f"{mib:g} MiB {rec['median_own_ratio']:.2f} (alternating "
            f"{rec['median_ratio']:.2f}, back to back {rec['median_burst_ratio']:.2f})"
            for mib in a.mib for rec in [records[f"p{p}_{mib:g}MiB"]])
        print(f"median ours/torch busbw, p = {p}: {row}")


def _numbers(text: str, kind, flag: str) -> list:
    try:
        return [kind(v) for v in text.split(",")]
    except ValueError:
        _fail(f"{flag} {text!r}: give a comma-separated list of numbers, e.g. {flag} 2,4")


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


class _TorchMoE:
    """The plain-PyTorch expert-parallel MoE layer (see the module docstring), on the
    weights of a paratrain MoE whose ``experts`` are this rank's."""

    def __init__(self, moe, rank: int, world: int) -> None:
        self.moe, self.rank, self.world = moe, rank, world

    def __call__(self, x_BTD: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated")
        moe, p = self.moe, self.world
        B, T, D = x_BTD.shape
        E, K = moe.num_experts, moe.top_k
        El = E // p
        x = x_BTD.reshape(-1, D)
        probs = (x @ moe.router.weight.T).softmax(-1)
        w, idx = probs.topk(K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        flat = idx.flatten()
        order = torch.sort(flat, stable=True).indices
        tok = order // K
        counts = torch.bincount(flat, minlength=E)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts)  # counts[e] for my experts, from each rank
        send_splits = counts.view(p, El).sum(1).tolist()
        recv_splits = recv.view(p, El).sum(1).tolist()
        rows = all_to_all_single(torch.empty(sum(recv_splits), D), x[tok], recv_splits,
                                 send_splits)
        # rows arrive by source rank, each sorted by my local expert: regroup by expert
        local = torch.arange(El).repeat(p).repeat_interleave(recv)
        perm = torch.sort(local, stable=True).indices
        sizes = torch.bincount(local, minlength=El).tolist()
        outs = [ex(chunk) for ex, chunk in zip(moe.experts, rows[perm].split(sizes),
                                               strict=True)]
        y_rows = torch.cat(outs)[torch.argsort(perm)]
        back = all_to_all_single(torch.empty(sum(send_splits), D), y_rows, send_splits,
                                 recv_splits)
        y = torch.zeros_like(x).index_add_(0, tok, back * w.flatten()[order][:, None])
        return y.view(B, T, D)


def _moe_worker(rank: int, world: int, cfg: ModelConfig, seqs: int, reps: int) -> dict:
    from paratrain.model import Decoder, moe_modules
    from paratrain.parallel.expert import ExpertExchange

    torch.manual_seed(0)
    full = moe_modules(Decoder(cfg))[0]
    torch.manual_seed(1 + rank)
    x = torch.randn(seqs, cfg.context, cfg.d_model, requires_grad=True)
    ours = moe_modules(Decoder(cfg))[0]
    ours.load_state_dict(full.state_dict())
    El = cfg.experts // world
    ours.experts = torch.nn.ModuleList(list(ours.experts)[rank * El:(rank + 1) * El])
    ex = ExpertExchange(dist.group.WORLD, world, rank, cfg.experts)
    ours.exchange = ex
    plain = _TorchMoE(ours, rank, world)
    spent = []  # seconds inside our all-to-alls (dispatch, combine, their backward)
    inner = ex.all_to_all

    def timed_a2a(*a):
        t0 = time.perf_counter()
        out = inner(*a)
        spent.append(time.perf_counter() - t0)
        return out

    ex.all_to_all = timed_a2a
    with torch.no_grad():
        err = (ours(x) - plain(x)).abs().max().item()
    single = moe_modules(Decoder(cfg))[0]  # ep = 1: every expert here, no exchange
    single.load_state_dict(full.state_dict())

    def step(layer):
        def run():
            layer(x).square().mean().backward()
        return run

    bytes0, spent[:] = ex.wire_bytes, []
    times = _alternating({"ours": step(ours), "torch": step(plain)}, reps)
    a2a_bytes = (ex.wire_bytes - bytes0) / reps
    a2a_s = sum(spent) / reps
    t1 = _alternating({"ep1": step(single)}, max(3, reps // 2))["ep1"]
    return {"ours": _slowest_median(times["ours"]), "torch": _slowest_median(times["torch"]),
            "ep1": _slowest_median(t1), "a2a_bytes": a2a_bytes, "a2a_s": a2a_s,
            "max_abs_diff": err, "rss_mb": peak_rss_mb()}


def _step_config(ep: int, seqs: int, steps: int) -> tuple[TrainConfig, ParallelPlan]:
    """The MoE training run at ``ep``: ep data ranks, ``seqs`` sequences each, float32."""
    tcfg = TrainConfig(steps=steps + 1, global_batch=seqs * ep, lr=1e-3, warmup_steps=1,
                       eval_every=0, eval_batches=1, dtype="float32")
    return tcfg, ParallelPlan(dp=ep, ep=ep)


def _step_worker(rank: int, world: int, cfg: ModelConfig, seqs: int, steps: int) -> dict:
    from paratrain.parallel.expert import ExpertExchange
    from paratrain.run.loop import RunOptions, train

    spent = []  # seconds inside the row all-to-alls (dispatch, combine, their backward)
    inner = ExpertExchange.all_to_all

    def timed(self, *a):
        t0 = time.perf_counter()
        out = inner(self, *a)
        spent.append(time.perf_counter() - t0)
        return out

    ExpertExchange.all_to_all = timed
    tcfg, plan = _step_config(world, seqs, steps)
    s = train(cfg, tcfg, plan if world > 1 else None,
              RunOptions(quiet=True, measure_peak=False))
    mem = s["memory"]["measured_per_rank"][0]
    wire = [m.get("ep_wire_bytes", 0) for m in s["moe_steps"]]
    return {"step_s": s["step_s"], "a2a_s": sum(spent) / len(wire),
            "a2a_bytes": statistics.mean(wire[1:] or wire),
            "states": sum(mem[k] for k in ("params", "grads", "optimizer")),
            "act": mem["activations_peak"], "rss_mb": peak_rss_mb()}


def _moe_steps(a, machine) -> dict:
    """Section 3: an MoE step at each ep, measured beside predicted (module docstring)."""
    cfg = ModelConfig(n_layers=2, d_model=a.d_model, n_heads=4, d_ff=a.moe_ffn,
                      context=a.context, experts=a.experts, top_k=a.top_k,
                      moe_ffn=a.moe_ffn)
    print(f"\nMoE training step, 2 layers, E={a.experts} top-{a.top_k} d={a.d_model} "
          f"ffn={a.moe_ffn}, {a.step_seqs} x {a.context} tokens per rank, float32, ep data "
          "ranks; each quantity: measured, predicted, measured/predicted")
    print(f"{'ep':>3} | {'step s':>7} {'pred':>7} {'m/p':>5} | {'a2a MB':>7} {'pred':>7} "
          f"{'m/p':>5} | {'a2a s':>7} {'pred':>7} {'m/p':>5} | {'peak MB':>7} {'pred':>7} "
          f"{'m/p':>5} | {'RSS MB':>6}")
    out = {}
    for ep in [int(x) for x in a.ep.split(",")]:
        pred = None
        if machine is not None:
            tcfg, plan = _step_config(ep, a.step_seqs, a.steps)
            pred = predict(cfg, tcfg, plan, ep, machine.replace(
                others=sample_other_sessions(samples=5))).to_dict()
        res = spawn(_step_worker, ep, cfg, a.step_seqs, a.steps, timeout_s=a.timeout)
        r = res[0] | {"pred": pred, "rss_mb": max(x["rss_mb"] for x in res)}
        r["peak"] = r["states"] + r["act"]
        out[ep] = r

        def col(m: float, key: str, scale: float, pr=pred) -> str:
            if pr is None:
                return f"{m / scale:7.3f} {'-':>7} {'-':>5}"
            p = pr[key]
            q = f"{m / p:5.2f}" if p else f"{'-':>5}"
            return f"{m / scale:7.3f} {p / scale:7.3f} {q}"

        print(f"{ep:>3} | {col(r['step_s'], 'step_s', 1)} | "
              f"{col(r['a2a_bytes'], 'ep_wire_bytes', 1e6)} | {col(r['a2a_s'], 'ep_comm_s', 1)} | "
              f"{col(r['peak'], 'peak_bytes', 1e6)} | {r['rss_mb']:6.0f}", flush=True)
    notes = sorted({n.split(":")[0].split(";")[0] for r in out.values() if r["pred"]
                    for n in r["pred"]["notes"]})
    if notes:
        print("prediction notes: " + "; ".join(notes) + " (per-run detail in --json)")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--a2a-ranks", default="2,4,8", help="p of the all-to-all table")
    ap.add_argument("--mib", default="1,4", help="all-to-all MiB per rank (a list)")
    ap.add_argument("--runs", type=int, default=3,
                    help="fresh alternating runs per (p, size) of the all-to-all")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--moe-ffn", type=int, default=256)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--seqs", type=int, default=16, help="sequences per rank")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--skip-moe", action="store_true", help="the all-to-all part only")
    ap.add_argument("--ep", default="1,2,4", help="ep sizes of the MoE training step")
    ap.add_argument("--step-seqs", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=3, help="timed MoE steps (one more untimed)")
    ap.add_argument("--skip-steps", action="store_true", help="no MoE training steps")
    ap.add_argument("--profile", default=None,
                    help="machine profile (default ~/.cache/paratrain/hardware.toml)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    ranks = _numbers(a.ranks, int, "--ranks")
    a.a2a_ranks, a.mib = _numbers(a.a2a_ranks, int, "--a2a-ranks"), _numbers(a.mib, float, "--mib")
    if a.runs < 1 or a.reps < 1 or min(a.a2a_ranks) < 2 or min(a.mib) <= 0:
        _fail(f"--runs {a.runs}, --reps {a.reps}, --a2a-ranks {a.a2a_ranks}, --mib {a.mib}: "
              "runs and reps >= 1, every p >= 2 and every size > 0")
    print("command: python " + " ".join(sys.argv[:1] + (sys.argv[1:] if argv is None
                                                        else list(argv))))
    cfg = ModelConfig(n_layers=1, d_model=a.d_model, n_heads=4, d_ff=a.moe_ffn,
                      context=a.context, experts=a.experts, top_k=a.top_k,
                      aux_loss_coef=0.0)
    records = {"a2a": {}, "moe": {}}
    _a2a_table(a, records["a2a"])
    if a.skip_moe:
        ranks = []
    tokens = a.seqs * a.context
    print(f"\nMoE layer forward + backward: E={a.experts} top-{a.top_k} d={a.d_model} "
          f"ffn={a.moe_ffn}, {tokens} tokens per rank, ep = p\n{'p':>3} {'ours s':>9} "
          f"{'torch s':>9} {'ours/torch':>10} {'ep=1 s':>8} {'a2a MB/rank':>12} "
          f"{'a2a share':>10} {'RSS MB':>8} {'max|diff|':>10}")
    for p in ranks:
        res = spawn(_moe_worker, p, cfg, a.seqs, a.reps, timeout_s=a.timeout)
        r = res[0]
        records["moe"][p] = r
        print(f"{p:>3} {r['ours']:9.4f} {r['torch']:9.4f} {r['ours'] / r['torch']:10.3f} "
              f"{r['ep1']:8.4f} {r['a2a_bytes'] / 1e6:12.3f} "
              f"{r['a2a_s'] / r['ours']:10.1%} {max(x['rss_mb'] for x in res):8.0f} "
              f"{max(x['max_abs_diff'] for x in res):10.2e}", flush=True)
    if not a.skip_steps:
        machine = load_machine(a.profile)
        if machine is None:
            print(CALIBRATE_HINT)
        records["steps"] = _moe_steps(a, machine)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
