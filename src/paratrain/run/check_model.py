"""Close the loop on this machine: run a grid of plans, set the prediction beside each.

Why: a model that is never checked is an opinion (issue 7). ``paratrain check-model``
first fits this machine's CPU constants once from single-process runs of the grid's model
(:func:`paratrain.predict.fit_from_runs`: eta of small one-thread matmuls, the fixed cost
of a block pass and of a step), saves them beside the hardware profile, then trains every
plan of the grid for a few steps in fresh gloo processes and compares, per plan:

- step time: predicted vs the median measured step (steps after the first: warm-up),
  with the error; the median absolute error over the grid is the headline figure;
- wire bytes per rank (data-parallel sync counted by the runtime, TP blocks' collectives):
  exact or not;
- model-state bytes (parameters, gradients, AdamW state) of every rank: exact or not;
- rank 0's CPU seconds per step, predicted (its compute, fixed costs and collectives on a
  whole core) vs measured (``cpu_s`` in the run's metrics): the work model, checked
  independently of how many cores the other sessions leave to this run.

While each run trains, a thread samples the other sessions' runnable threads
(:func:`paratrain.predict.sample_other_sessions`): on a shared box the cores this run gets
are part of the machine's state, and the prediction uses them through the scheduler's
fair split between sessions and the oversubscribed CPU's physics
(:mod:`paratrain.predict.sched`: the same for every plan; never a per-plan factor). The
table says the load each plan ran under.

The grid covers DP, ZeRO-1/2/3, TP, PP (1F1B, interleaved), CP (ring and all-to-all) and
EP, alone and composed, on 2-8 ranks; the EP plan trains the grid's model with a small
MoE MLP (:func:`plan_model`). Every plan passes :meth:`ParallelPlan.check_run` before any
run starts. The whole grid takes about 5 minutes on 2 quiet cores.

Importing this module does not import torch (the CLI must start instantly).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from paratrain.config import ModelConfig, TrainConfig
from paratrain.plan import ParallelPlan

# Small enough for 8 processes on 2 cores, big enough that matmuls dominate the noise.
GRID_MODEL = ModelConfig(n_layers=4, d_model=128, n_heads=4, d_ff=384, context=128)
GRID_BATCH = 16

GRID: dict[str, ParallelPlan] = {
    "dp2": ParallelPlan(dp=2),
    "dp4": ParallelPlan(dp=4),
    "dp2 zero1": ParallelPlan(dp=2, zero=1),
    "dp2 zero3": ParallelPlan(dp=2, zero=3),
    "dp4 zero3": ParallelPlan(dp=4, zero=3),
    "tp2": ParallelPlan(tp=2),
    "pp2 1f1b m4": ParallelPlan(pp=2, micro_batches=4),
    "tp2 x pp2 m4": ParallelPlan(tp=2, pp=2, micro_batches=4),
    "dp2 x tp2": ParallelPlan(dp=2, tp=2),
    "dp2 x pp2 x tp2": ParallelPlan(dp=2, pp=2, tp=2, micro_batches=2),
    "dp2 x tp2 zero1": ParallelPlan(dp=2, tp=2, zero=1),
    "dp2 x tp2 zero3": ParallelPlan(dp=2, tp=2, zero=3),
    "dp2 x pp2 zero2 m4": ParallelPlan(dp=2, pp=2, zero=2, micro_batches=4),
    "dp2 x pp2 zero3 m4": ParallelPlan(dp=2, pp=2, zero=3, micro_batches=4),
    "dp2 x pp2 interleaved v2 m4": ParallelPlan(dp=2, pp=2, micro_batches=4,
                                                schedule="interleaved", virtual_stages=2),
    "dp8": ParallelPlan(dp=8),
    "cp2 ring": ParallelPlan(cp=2),
    "cp2 all-to-all": ParallelPlan(cp=2, cp_algorithm="all-to-all"),
    "dp2 x cp2 ring": ParallelPlan(dp=2, cp=2),
    "dp2 x ep2": ParallelPlan(dp=2, ep=2),
}
MINI = ("dp2", "dp2 zero1")
# The EP plan needs experts: the grid's model with a small MoE MLP in every block (4
# experts of half the width, top-2), so its FLOPs stay near the dense model's.
MOE = {"experts": 4, "top_k": 2}


def plan_model(plan: ParallelPlan, mcfg: ModelConfig) -> ModelConfig:
    """The model a grid plan trains: ``mcfg``, made MoE (:data:`MOE`, experts of half
    the FFN width) for an expert-parallel plan when it is dense."""
    if plan.ep > 1 and not mcfg.experts:
        return mcfg.replace(**MOE, moe_ffn=max(1, mcfg.d_ff // 2))
    return mcfg


def _train_worker(rank: int, world: int, mcfg: dict, tcfg: dict, plan: dict,
                  run_dir: str) -> dict:
    """One rank of one grid run (spawned). Rank 0 returns its summary and step times."""
    from paratrain.run.loop import RunOptions, train

    opts = RunOptions(run_dir=run_dir if rank == 0 else None, quiet=True, measure_peak=False)
    c0, w0 = time.process_time(), time.perf_counter()
    s = train(ModelConfig(**mcfg), TrainConfig(**tcfg), ParallelPlan(**plan), opts)
    got = (time.process_time() - c0) / (time.perf_counter() - w0)  # core share, diagnostic
    if rank != 0:
        return {}
    s["cpu_share_rank0"] = got
    s = {k: v for k, v in s.items() if k != "prediction"}
    with open(Path(run_dir) / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    s["step_times"] = [r["step_s"] for r in recs]
    s["cpu_times"] = [r.get("cpu_s", float("nan")) for r in recs]
    return json.loads(json.dumps(s))  # plain containers for torch.load(weights_only)


def _one_process(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan) -> float:
    """Seconds per step of a one-process, one-thread run on a whole core: the median CPU
    time of a step (after the first), so the other sessions' load does not leak in."""
    import torch

    from paratrain.run.loop import RunOptions, train

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as d:
            train(mcfg, tcfg, plan, RunOptions(run_dir=d, quiet=True, measure_peak=False))
            with open(Path(d) / "metrics.jsonl") as f:
                cpu = [json.loads(line)["cpu_s"] for line in f]
    finally:
        torch.set_num_threads(old)
    return statistics.median(cpu[1:] or cpu)


def _thread_peak(n: int = 512, reps: int = 8) -> float:
    """One thread's fp32 matmul FLOP/s on CPU time (best of 3 bursts), so that other
    sessions' load, which steals wall time, does not lower it."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = 0.0
        for _ in range(3):
            c0 = time.process_time()
            for _ in range(reps):
                a @ b
            best = max(best, reps * 2 * n**3 / max(time.process_time() - c0, 1e-9))
        return best
    finally:
        torch.set_num_threads(old)


COLL_CPU_BUFFERS = 32  # distinct vectors per size, taken in turn: 32 MiB at 1 MiB, more
# than the caches hold, so every call reads memory the others have evicted
COLL_CPU_BLOCKS = 7  # timed blocks per size; their median is kept


def _coll_cpu_worker(rank: int, world: int) -> list[tuple[int, float]]:
    """CPU seconds per all-reduce call of this rank at two sizes, the median of
    :data:`COLL_CPU_BLOCKS` blocks, each call on the next of :data:`COLL_CPU_BUFFERS`
    vectors. A training step sends activations and gradients that its compute has just
    pushed out of the caches, never the same hot buffer again: one buffer reduced over
    and over measured 0.71-1.07 ns per byte, 32 in turn 1.15-1.34 (1 MiB, two runs each
    on the quiet 2-core box). The blocks vary with where the scheduler puts the ranks and
    their progress threads; a run pays the typical block, so the median, not the best."""
    import torch
    import torch.distributed as dist

    out = []
    for nbytes, iters in ((4096, 96), (1 << 20, 32)):
        xs = [torch.zeros(nbytes // 4) for _ in range(COLL_CPU_BUFFERS)]
        for x in xs:  # untimed: every buffer's pages touched once
            dist.all_reduce(x)
        blocks = []
        for _ in range(COLL_CPU_BLOCKS):
            dist.barrier()
            c0 = time.process_time()
            for i in range(iters):
                dist.all_reduce(xs[i % COLL_CPU_BUFFERS])
            blocks.append((time.process_time() - c0) / iters)
        out.append((nbytes, statistics.median(blocks)))
    return out


def collective_cpu(log=print) -> tuple[float, float]:
    """(CPU s per ring step, CPU s per byte sent) of gloo on this machine: 2 ranks, an
    all-reduce of 4 KiB and of 1 MiB (2 steps; each rank sends the vector once)."""
    from paratrain.parallel.process_groups import spawn

    res = spawn(_coll_cpu_worker, 2)
    (n0, t0), (n1, t1) = [(n, sum(r[i][1] for r in res) / 2) for i, (n, _) in
                          enumerate(res[0])]
    per_byte = max(0.0, (t1 - t0) / (n1 - n0))
    per_step = max(0.0, (t0 - n0 * per_byte) / 2)
    log(f"gloo CPU: {per_step * 1e6:.1f} us per ring step, {per_byte * 1e9:.3f} ns per byte")
    return per_step, per_byte


def fit_machine(mcfg: ModelConfig, tcfg: TrainConfig, profile: str | None,
                save: bool = True, log=print):
    """Fit eta and the fixed costs from three one-process runs (batch B and B/4 with one
    micro-batch, B with four), on CPU time, against one thread's matmul peak; measure the
    CPU a collective costs (:func:`collective_cpu`). The peak, each run and the collective
    CPU (judged on its per-byte figure, which sets most of it) are repeated
    until stable, or refused on a busy machine
    (:func:`paratrain.bench.calibrate.until_stable`)."""
    from paratrain.bench.calibrate import default_rule, until_stable
    from paratrain.predict import fit_from_runs, load_machine, save_fit

    machine = load_machine(profile)
    if machine is None:
        raise ValueError("no hardware profile of this machine; run `paratrain bench "
                         "calibrate` first (or pass --profile PATH)")
    again = "paratrain check-model"
    (peak,) = until_stable(lambda: [_thread_peak()], "one thread's matmul peak",
                           default_rule(), command=again)
    B = tcfg.global_batch
    runs = []
    for gb, m in ((B, 1), (max(1, B // 4), 1), (B, 4)):
        t_cfg = TrainConfig(**{**asdict(tcfg), "global_batch": gb})
        (t,) = until_stable(lambda t_cfg=t_cfg, m=m: [_one_process(
            mcfg, t_cfg, ParallelPlan(micro_batches=m))],
            f"the fit run's CPU s per step (batch {gb}, {m} micro-batches)", default_rule(),
            command=again)
        runs.append((gb, m, t))
        log(f"fit run: batch {gb}, micro-batches {m}: {t:.4f} CPU s/step")
    step_cpu, byte_cpu = until_stable(
        lambda: collective_cpu(log=lambda *_: None), "gloo's CPU per byte sent",
        default_rule(), judged=lambda r: r[1:], command=again)
    log(f"gloo CPU: {step_cpu * 1e6:.1f} us per ring step, {byte_cpu * 1e9:.3f} ns per byte")
    fitted = fit_from_runs(mcfg, runs, machine.hw, peak).replace(
        coll_step_cpu_s=step_cpu, coll_byte_cpu_s=byte_cpu, wake_s=machine.wake_s,
        busy_sync_s=machine.busy_sync_s, sched=machine.sched)
    shape = f"{mcfg.n_layers}x{mcfg.d_model}, ff {mcfg.d_ff}, T {mcfg.context}"
    if save:
        path = save_fit(fitted, profile, shape)
        fitted = fitted.replace(source=f"fit {path}")
        log(f"saved the CPU fit to {path}")
    log(f"fit: eta {fitted.eta:.3f} of {peak / 1e9:.1f} GFLOP/s (one thread), "
        f"block pass {fitted.pass_s * 1e3:.3f} ms, step {fitted.step_s * 1e3:.2f} ms")
    return fitted


class _Sampler:
    """Samples the other sessions' runnable threads in a thread while a run trains."""

    def __init__(self, interval_s: float = 0.25) -> None:
        import threading

        self.samples: list[tuple[int, ...]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, args=(interval_s,), daemon=True)

    def _loop(self, interval_s: float) -> None:
        from paratrain.predict import sample_other_sessions

        while not self._stop.is_set():
            self.samples += sample_other_sessions(samples=1)
            self._stop.wait(interval_s)

    def __enter__(self) -> _Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def run_grid(names: list[str] | None = None, *, profile: str | None = None, steps: int = 6,
             fit: bool = True, mcfg: ModelConfig = GRID_MODEL, global_batch: int = GRID_BATCH,
             data: str | None = None, log=print) -> dict:
    """Run the grid (or ``names`` of it); return {"records": [...], "median_abs_error",
    "machine": {...}}."""
    from paratrain.parallel.process_groups import spawn
    from paratrain.predict import load_machine

    names = list(GRID) if names is None else names
    unknown = [n for n in names if n not in GRID]
    if unknown:
        raise ValueError(f"unknown plan(s) {unknown}; choose from {', '.join(GRID)}")
    if steps < 3:
        raise ValueError(f"--steps {steps}: need at least 3 (the first is warm-up)")
    tcfg = TrainConfig(steps=steps, global_batch=global_batch, lr=1e-3, warmup_steps=1,
                       eval_every=0, eval_batches=1, data=data)
    machine = fit_machine(mcfg, tcfg, profile, log=log) if fit else load_machine(profile)
    if machine is None:
        raise ValueError("no hardware profile of this machine; run `paratrain bench "
                         "calibrate` first (or pass --profile PATH)")
    plans = {name: (GRID[name], plan_model(GRID[name], mcfg)) for name in names}
    for plan, model in plans.values():
        plan.check_run(model, plan.world_size, global_batch)
    records = []
    for name, (plan, model) in plans.items():
        with tempfile.TemporaryDirectory(prefix="paratrain-check-") as d, _Sampler() as smp:
            s = spawn(_train_worker, plan.world_size, asdict(model), asdict(tcfg),
                      asdict(plan), d, timeout_s=600)[0]
        rec = _record(name, plan, model, tcfg, machine.replace(others=tuple(smp.samples)), s)
        records.append(rec)
        log(f"{name:<18} predicted {rec['predicted_s']:.4f} s  measured "
            f"{rec['measured_s']:.4f} s  {100 * rec['error']:+.0f}%  wire "
            f"{_yes(rec['wire_exact'])}  states {_yes(rec['states_exact'])}  (core per rank: "
            f"predicted {rec['share']:.2f}, rank 0 got {s['cpu_share_rank0']:.2f}; "
            f"{rec['other_threads']:.1f} other runnable threads)")
    errs = [abs(r["error"]) for r in records]
    cpu_errs = [abs(r["cpu_rank0_s"]["error"]) for r in records]
    return {"records": records, "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs, default=None),
            "median_abs_cpu_error": statistics.median(cpu_errs) if cpu_errs else None,
            "machine": {"eta": machine.eta, "pass_s": machine.pass_s,
                        "step_s": machine.step_s, "cores": machine.cores,
                        "thread_peak_flops": machine.thread_peak, "alpha_s": machine.hw.intra_alpha,
                        "bw_bytes_per_s": machine.hw.intra_bw, "wake_s": machine.wake_s,
                        "busy_sync_s": machine.busy_sync_s, "sched": machine.sched,
                        "source": machine.source},
            "model": asdict(mcfg), "global_batch": global_batch, "steps": steps}


def _record(name: str, plan: ParallelPlan, model: ModelConfig, tcfg: TrainConfig,
            machine, s: dict) -> dict:
    """One plan's record: the prediction (with the load sampled while it ran) beside
    rank 0's summary ``s``."""
    from paratrain.predict import compare, predict

    pred = predict(model, tcfg, plan, plan.world_size, machine)
    cmp = compare(pred, s, plan, 0, model, tcfg)
    measured = statistics.median(s["step_times"][1:])
    cpu = statistics.median(s["cpu_times"][1:])
    return {"plan": name, "nproc": plan.world_size, "moe": bool(model.experts),
            "other_sessions": machine.other_sessions, "other_threads": machine.other_threads,
            "others_samples": [list(o) for o in machine.others],
            "share": pred.share, "predicted_s": pred.step_s, "measured_s": measured,
            "error": pred.step_s / measured - 1, "measured_mean_s": s["step_s"],
            "cpu_share_rank0": s["cpu_share_rank0"],
            "cpu_rank0_s": {"predicted": pred.cpu_rank0_s, "measured": cpu,
                            "error": pred.cpu_rank0_s / cpu - 1},
            "critical_path_s": pred.critical_path_s,
            "session_bound_s": pred.session_work_s / pred.session_cores,
            "syncs": pred.syncs, "sync_s": pred.sync_s,
            "predicted": pred.to_dict(), "compare": cmp,
            "wire_exact": _wire_exact(cmp), "states_exact": cmp["states_bytes"]["exact"]}


def _wire_exact(cmp: dict) -> bool:
    """DP and TP bytes equal the runtime's count; CP too, and EP's the count from the
    run's own routing (:func:`paratrain.predict.compare`), where the run has them."""
    dp = cmp["dp_wire_bytes"]
    ok = round(dp["predicted"]) == round(dp["measured"])
    for axis in ("tp_wire_bytes", "cp_wire_bytes"):
        c = cmp[axis]
        if c["measured"] is not None:
            ok = ok and round(c["predicted"]) == round(c["measured"])
    return ok and cmp["ep_wire_bytes"]["exact"] is not False


def _yes(b: bool) -> str:
    return "exact" if b else "DIFFERENT"


def _wire_measured(c: dict) -> float:
    """Bytes rank 0 sent per step, as the runtime counted them (DP, TP, CP, EP)."""
    return sum(c[k]["measured"] or 0.0 for k in ("dp_wire_bytes", "tp_wire_bytes",
                                                  "cp_wire_bytes", "ep_wire_bytes"))


def format_table(result: dict) -> str:
    """Predicted vs measured per plan, the median and worst absolute error, the load the
    plans ran under (other sessions' runnable threads), the exactness columns."""
    m = result["machine"]
    lines = [
        f"machine: {m['cores']} cores, {m['thread_peak_flops'] / 1e9:.1f} GFLOP/s one-thread peak, "
        f"eta {m['eta']:.3f}, block pass {m['pass_s'] * 1e3:.3f} ms, step "
        f"{m['step_s'] * 1e3:.2f} ms, gloo alpha {m['alpha_s'] * 1e6:.0f} us, "
        f"{m['bw_bytes_per_s'] / 1e9:.2f} GB/s, sync wake {m.get('wake_s', 0) * 1e6:.0f} us, "
        f"oversubscribed sync {m.get('busy_sync_s', 0) * 1e6:.0f} us",
        f"{'plan':<27} {'procs':>5} {'others':>6} {'core':>5} {'predicted s':>11} "
        f"{'measured s':>10} {'error':>7} {'CPU s r0':>14} {'error':>7} {'wire B/rank':>12} "
        f"{'wire':>9} {'states':>9}",
    ]
    for r in result["records"]:
        cpu = r["cpu_rank0_s"]
        lines.append(f"{r['plan']:<27} {r['nproc']:>5} {r['other_threads']:>6.1f} "
                     f"{r['share']:>5.2f} {r['predicted_s']:>11.4f} {r['measured_s']:>10.4f} "
                     f"{100 * r['error']:>+6.0f}% {cpu['predicted']:>6.3f}/{cpu['measured']:<7.3f}"
                     f"{100 * cpu['error']:>+6.0f}% {_wire_measured(r['compare']):>12,.0f} "
                     f"{_yes(r['wire_exact']):>9} {_yes(r['states_exact']):>9}")
    recs = result["records"]
    n_w = sum(r["wire_exact"] for r in recs)
    n_s = sum(r["states_exact"] for r in recs)
    k = len(recs)
    load = statistics.fmean(r["other_threads"] for r in recs) if recs else 0.0
    lines.append(f"median absolute error of step time: {100 * result['median_abs_error']:.1f}% "
                 f"over {k} plans, worst {100 * result['max_abs_error']:.1f}%; wire bytes exact "
                 f"{n_w}/{k}; model states exact on every rank {n_s}/{k}")
    lines.append(f"median absolute error of rank 0's CPU s per step (the work, whatever the "
                 f"other sessions take): {100 * result['median_abs_cpu_error']:.1f}%; 'core' is "
                 f"the predicted core share per rank; 'others' the other sessions' runnable "
                 f"threads sampled while the plan ran (mean {load:.1f})")
    return "\n".join(lines)
