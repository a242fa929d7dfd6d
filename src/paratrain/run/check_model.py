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


def _coll_cost_worker(rank: int, world: int, sizes: list[int]) -> list[tuple[float, float]]:
    """(CPU s, wall s) per all-reduce call of this rank at each size: the median over
    :data:`COLL_CPU_BLOCKS` blocks of the block's mean, each call on the next of
    :data:`COLL_CPU_BUFFERS` vectors. A training step sends activations and gradients that
    its compute has just pushed out of the caches, never the same hot buffer again: one
    buffer reduced over and over measured 0.71-1.07 ns per byte, 32 in turn 1.15-1.34
    (1 MiB, two runs each on the quiet 2-core box). A step pays every call, its
    scheduler hiccups included, so each block keeps the mean of its calls (a 4 KiB
    all-reduce's median call took 0.70 ms on one box, the mean 1.73 ms); the blocks vary
    with where the scheduler puts the ranks and their progress threads, so the median of
    the blocks, not the best."""
    import torch
    import torch.distributed as dist

    out = []
    for nbytes in sizes:
        iters = 96 if nbytes < 1 << 16 else 32
        xs = [torch.zeros(nbytes // 4) for _ in range(COLL_CPU_BUFFERS)]
        for x in xs:  # untimed: every buffer's pages touched once
            dist.all_reduce(x)
        blocks = []
        for _ in range(COLL_CPU_BLOCKS):
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            for i in range(iters):
                dist.all_reduce(xs[i % COLL_CPU_BUFFERS])
            blocks.append(((time.process_time() - c0) / iters,
                           (time.perf_counter() - w0) / iters))
        out.append((statistics.median(b[0] for b in blocks),
                    statistics.median(b[1] for b in blocks)))
    return out


COLL_SMALL, COLL_LARGE = 4096, 1 << 20  # bytes of the two all-reduce sizes measured


def collective_costs(log=print) -> tuple[float, float, float, float, float]:
    """What a gloo all-reduce costs a training step on this machine: (CPU s per call, CPU
    s per ring step, CPU s per byte sent, wall s per ring step, wall bytes per s), from
    blocks of calls (:func:`_coll_cost_worker`) on 2 ranks at 4 KiB and 1 MiB and on 4
    ranks at 4 KiB. CPU per call = per call + ring steps x per step + bytes sent x per
    byte (2 ranks: 2 steps, 4 ranks: 6): the per-call part (handing the call to gloo's
    worker thread and back) does not grow with the group, the per-step part does, so
    the two group sizes tell them apart. Wall, on 2 ranks (free cores): the ring's
    latency per step and its bandwidth, as the critical path prices a call; with ranks
    beyond the cores the oversubscribed sync (:mod:`paratrain.predict.sched`) prices the
    wait instead."""
    from paratrain.parallel.process_groups import spawn

    def mean_over_ranks(p: int, sizes: list[int]) -> list[tuple[float, float]]:
        res = spawn(_coll_cost_worker, p, sizes)
        return [tuple(sum(r[i][j] for r in res) / p for j in range(2)) for i in range(len(sizes))]

    (c0, w0), (c1, w1) = mean_over_ranks(2, [COLL_SMALL, COLL_LARGE])
    ((c4, _),) = mean_over_ranks(4, [COLL_SMALL])
    per_call, per_step, per_byte, alpha, bw = solve_collective_costs(c0, c1, c4, w0, w1)
    log(f"gloo all-reduce: CPU {per_call * 1e6:.1f} us per call, {per_step * 1e6:.1f} us per "
        f"ring step, {per_byte * 1e9:.3f} ns per byte; wall {alpha * 1e6:.1f} us per ring "
        f"step, {bw / 1e9:.3f} GB/s")
    return per_call, per_step, per_byte, alpha, bw


def solve_collective_costs(c2_small: float, c2_large: float, c4_small: float,
                           w2_small: float, w2_large: float
                           ) -> tuple[float, float, float, float, float]:
    """(CPU per call, per ring step, per byte sent; wall per ring step, bytes per s) from
    the per-call CPU of 2 ranks at :data:`COLL_SMALL` and :data:`COLL_LARGE` bytes and of
    4 ranks at the small size, and the wall of the two 2-rank sizes
    (:func:`collective_costs`). Each is clamped at 0, so that the 2-rank call keeps its
    measured CPU: 4 ranks costing no more than 2 put all of it per call, 4 ranks costing
    more than the steps can explain put all of it per step."""
    from paratrain.cost import collectives as coll

    def wire(p: int, n: int) -> float:
        return coll.wire_bytes("all_reduce", "ring", p, n)

    def steps(p: int) -> int:
        return coll.steps("all_reduce", "ring", p)

    per_byte = max(0.0, (c2_large - c2_small) / (wire(2, COLL_LARGE) - wire(2, COLL_SMALL)))
    small = [c - wire(p, COLL_SMALL) * per_byte for p, c in ((2, c2_small), (4, c4_small))]
    per_step = max(0.0, (small[1] - small[0]) / (steps(4) - steps(2)))
    per_call = max(0.0, small[0] - steps(2) * per_step)
    if per_call == 0.0:
        per_step = max(0.0, small[0] / steps(2))
    beta = max(1e-12, (w2_large - w2_small) / (wire(2, COLL_LARGE) - wire(2, COLL_SMALL)))
    alpha = max(0.0, (w2_small - wire(2, COLL_SMALL) * beta) / steps(2))
    return per_call, per_step, per_byte, alpha, 1.0 / beta


def fit_runs(global_batch: int) -> tuple[tuple[int, int], ...]:
    """(batch, micro-batches) of the one-process fit runs: the batch B and B/4 with one
    micro-batch, B with four, B/2 with two. Four runs for the three constants, so the
    least squares averages a noisy run instead of following it."""
    B = global_batch
    return ((B, 1), (max(1, B // 4), 1), (B, 4), (max(1, B // 2), 2))


def one_fit_run(mcfg: ModelConfig, tcfg: TrainConfig, gb: int, m: int) -> float:
    """CPU s per step of the one-process fit run of batch ``gb`` and ``m`` micro-batches."""
    t_cfg = TrainConfig(**{**asdict(tcfg), "global_batch": gb})
    return _one_process(mcfg, t_cfg, ParallelPlan(micro_batches=m))


def _fit_run_child(job: tuple[dict, dict, int, int]) -> float:
    mcfg, tcfg, gb, m = job
    return one_fit_run(ModelConfig(**mcfg), TrainConfig(**tcfg), gb, m)


def busy_core_speed(mcfg: ModelConfig, tcfg: TrainConfig, gb: int, m: int, alone: float,
                    cores: int) -> float:
    """A core's speed on the fit run while every core runs one (``cores`` processes at
    once), over its speed alone (``alone`` CPU s per step): what a training step's own
    mix of matmuls and memory-bound work loses to the cores it shares caches, memory
    bandwidth and (on a VM) physical cores with. The calibration's figure times small
    matmuls only, which lose less (0.88 against 0.8 on one box)."""
    import multiprocessing as mp

    if cores <= 1:
        return 1.0
    job = (asdict(mcfg), asdict(tcfg), gb, m)
    with mp.get_context("spawn").Pool(cores) as pool:
        times = pool.map(_fit_run_child, [job] * cores)
    return min(1.0, alone / statistics.median(times))


def measure_fit(mcfg: ModelConfig, tcfg: TrainConfig, profile: str | None, log=print
                ) -> dict:
    """What the CPU fit is made of: the profile's machine, one thread's matmul peak, the
    one-process runs (:func:`fit_runs`: (batch, micro-batches, CPU s per step)) and the
    CPU and wall a collective costs (:func:`collective_costs`). The peak, each run and
    the collective costs (judged on the CPU per byte, which sets most of a large call)
    are repeated until stable, or refused on a busy machine
    (:func:`paratrain.bench.calibrate.until_stable`)."""
    from paratrain.bench.calibrate import default_rule, until_stable
    from paratrain.predict import load_machine

    machine = load_machine(profile)
    if machine is None:
        raise ValueError("no hardware profile of this machine; run `paratrain bench "
                         "calibrate` first (or pass --profile PATH)")
    again = "paratrain check-model"
    (peak,) = until_stable(lambda: [_thread_peak()], "one thread's matmul peak",
                           default_rule(), command=again)
    runs = []
    for gb, m in fit_runs(tcfg.global_batch):
        (t,) = until_stable(lambda gb=gb, m=m: [one_fit_run(mcfg, tcfg, gb, m)],
                            f"the fit run's CPU s per step (batch {gb}, {m} micro-batches)",
                            default_rule(), command=again)
        runs.append((gb, m, t))
        log(f"fit run: batch {gb}, micro-batches {m}: {t:.4f} CPU s/step")
    moe = plan_model(ParallelPlan(dp=2, ep=2), mcfg)
    (moe_t,) = until_stable(lambda: [one_fit_run(moe, tcfg, tcfg.global_batch, 1)],
                            "the MoE fit run's CPU s per step", default_rule(), command=again)
    log(f"MoE fit run (the EP plans' model, one process): {moe_t:.4f} CPU s/step")
    gb, m, alone = runs[0]
    (speed,) = until_stable(lambda: [busy_core_speed(mcfg, tcfg, gb, m, alone,
                                                     machine.cores)],
                            "a core's speed with every core running the fit run",
                            default_rule(), command=again)
    log(f"a core runs the fit run at {speed:.2f} of its speed alone while every core runs "
        f"one (the calibration's matmuls: {machine.core_speed:.2f})")
    coll = until_stable(lambda: collective_costs(log=lambda *_: None),
                        "gloo's CPU per byte sent", default_rule(), judged=lambda r: r[2:3],
                        command=again)
    call_cpu, step_cpu, byte_cpu, alpha, bw = coll
    log(f"gloo all-reduce: CPU {call_cpu * 1e6:.1f} us per call, {step_cpu * 1e6:.1f} us per "
        f"ring step, {byte_cpu * 1e9:.3f} ns per byte; wall {alpha * 1e6:.1f} us per ring "
        f"step, {bw / 1e9:.3f} GB/s (the profile's: {machine.hw.intra_alpha * 1e6:.1f} us, "
        f"{machine.hw.intra_bw / 1e9:.3f} GB/s)")
    return {"machine": machine, "peak": peak, "runs": runs, "coll": coll,
            "core_speed": speed, "moe": (moe, tcfg, moe_t)}


def fitted_machine(mcfg: ModelConfig, inputs: dict, profile: str | None, save: bool = True,
                   log=print):
    """The machine model from :func:`measure_fit`'s ``inputs``: eta and the fixed costs by
    least squares over every one-process run (:func:`paratrain.predict.fit_from_runs`),
    the collectives' CPU, and their wall latency and bandwidth in place of the profile's
    (the profile's sweep times the median call on one hot buffer; a step pays the mean
    call on buffers its compute has just evicted). Saved beside the profile."""
    from paratrain.predict import fit_from_runs, save_fit

    machine, peak = inputs["machine"], inputs["peak"]
    call_cpu, step_cpu, byte_cpu, alpha, bw = inputs["coll"]
    fitted = fit_from_runs(mcfg, inputs["runs"], machine.hw, peak).replace(
        hw=machine.hw.replace(intra_alpha=alpha, intra_bw=bw), coll_call_cpu_s=call_cpu,
        coll_step_cpu_s=step_cpu, coll_byte_cpu_s=byte_cpu, wake_s=machine.wake_s,
        busy_sync_s=machine.busy_sync_s, core_speed=inputs["core_speed"], sched=machine.sched)
    fitted = fitted.replace(route_s=route_cost(inputs["moe"], fitted))
    shape = f"{mcfg.n_layers}x{mcfg.d_model}, ff {mcfg.d_ff}, T {mcfg.context}"
    if save:
        path = save_fit(fitted, profile, shape)
        fitted = fitted.replace(source=f"fit {path}")
        log(f"saved the CPU fit to {path}")
    log(f"fit over {len(inputs['runs'])} one-process runs: eta {fitted.eta:.3f} of "
        f"{peak / 1e9:.1f} GFLOP/s (one thread), block pass {fitted.pass_s * 1e3:.3f} ms, "
        f"step {fitted.step_s * 1e3:.2f} ms, {fitted.route_s * 1e9:.0f} ns per routed "
        f"assignment")
    return fitted


def route_cost(moe_run: tuple[ModelConfig, TrainConfig, float], machine) -> float:
    """CPU s per routed assignment of an MoE block (forward + backward): what the
    one-process MoE run (``moe_run``: its model, settings and CPU s per step) took beyond
    the price of its FLOPs and fixed costs on ``machine``, over its MoE blocks'
    assignments (tokens x top-k each). The dense fit cannot see it: the router's top-k,
    the sort by expert and the gathers and scatter-adds around the experts are
    memory-bound work that scales with the assignments, not with FLOPs."""
    from paratrain.predict import predict

    mcfg, tcfg, t = moe_run
    priced = predict(mcfg, tcfg, ParallelPlan(), 1, machine.replace(route_s=0.0)).cpu_rank0_s
    moe_layers = sum(mcfg.is_moe_layer(i) for i in range(mcfg.n_layers))
    assignments = moe_layers * tcfg.global_batch * mcfg.context * mcfg.top_k
    return max(0.0, (t - priced) / assignments)


def fit_machine(mcfg: ModelConfig, tcfg: TrainConfig, profile: str | None,
                save: bool = True, log=print):
    """Measure the fit's inputs (:func:`measure_fit`) and fit them
    (:func:`fitted_machine`) at once."""
    return fitted_machine(mcfg, measure_fit(mcfg, tcfg, profile, log), profile, save, log)


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
    inputs = measure_fit(mcfg, tcfg, profile, log) if fit else None
    machine = None if fit else load_machine(profile)
    if not fit and machine is None:
        raise ValueError("no hardware profile of this machine; run `paratrain bench "
                         "calibrate` first (or pass --profile PATH)")
    plans = {name: (GRID[name], plan_model(GRID[name], mcfg)) for name in names}
    for plan, model in plans.values():
        plan.check_run(model, plan.world_size, global_batch)
    runs = []
    order = fit_runs(global_batch)
    for i, (name, (plan, model)) in enumerate(plans.items()):
        if inputs is not None:  # one more fit run before each plan: the fit spans the grid
            gb, m = order[i % len(order)]
            inputs["runs"].append((gb, m, one_fit_run(mcfg, tcfg, gb, m)))
        with tempfile.TemporaryDirectory(prefix="paratrain-check-") as d, _Sampler() as smp:
            s = spawn(_train_worker, plan.world_size, asdict(model), asdict(tcfg),
                      asdict(plan), d, timeout_s=600)[0]
        runs.append((name, plan, model, tuple(smp.samples), s))
        log(f"{name:<18} measured {statistics.median(s['step_times'][1:]):.4f} s "
            f"(rank 0 got {s['cpu_share_rank0']:.2f} of a core)")
    if inputs is not None:
        machine = fitted_machine(mcfg, inputs, profile, log=log)
    records = []
    for name, plan, model, others, s in runs:
        rec = _record(name, plan, model, tcfg, machine.replace(others=others), s)
        records.append(rec)
        log(f"{name:<18} predicted {rec['predicted_s']:.4f} s  measured "
            f"{rec['measured_s']:.4f} s  {100 * rec['error']:+.0f}%  wire "
            f"{_yes(rec['wire_exact'])}  states {_yes(rec['states_exact'])}  (core per rank: "
            f"predicted {rec['share']:.2f}; {rec['other_threads']:.1f} other runnable threads)")
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
