"""The CPU fit of this machine that `paratrain check-model` (and the planner's loop,
:mod:`paratrain.run.auto_plan`) prices its plans with: eta and the fixed costs from
one-process runs, a core's speed with every core busy, the MoE routing cost, and what a
gloo collective costs a step in CPU and wall time (docs/train-prediction.md, "The CPU
fit"; the collectives' part: :mod:`paratrain.run.coll_fit`). Measured from single
processes and bare collectives only, never from the plans it will price. Importing this
module does not import torch."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from paratrain.config import ModelConfig, TrainConfig
from paratrain.plan import ParallelPlan
from paratrain.run.coll_fit import collective_costs, large_call_cpu, scalar_cost

# The EP plan needs experts: the grid's model with a small MoE MLP in every block (4
# experts of half the width, top-2), so its FLOPs stay near the dense model's.
MOE = {"experts": 4, "top_k": 2}


def plan_model(plan: ParallelPlan, mcfg: ModelConfig) -> ModelConfig:
    """The model a grid plan trains: ``mcfg``, made MoE (:data:`MOE`, experts of half
    the FFN width) for an expert-parallel plan when it is dense."""
    if plan.ep > 1 and not mcfg.experts:
        return mcfg.replace(**MOE, moe_ffn=max(1, mcfg.d_ff // 2))
    return mcfg


def _one_process(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan
                 ) -> tuple[float, float]:
    """Seconds per step of a one-process, one-thread run on a whole core: the median CPU
    time of a step (after the first), so the other sessions' load does not leak in, and
    the median CPU of the step outside its forward and backward passes (the batch, the
    loss sum and the optimizer step: what the fit's per-step cost is)."""
    import torch

    from paratrain.run.loop import RunOptions, train

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as d:
            train(mcfg, tcfg, plan, RunOptions(run_dir=d, quiet=True, measure_peak=False))
            with open(Path(d) / "metrics.jsonl") as f:
                recs = [json.loads(line) for line in f]
    finally:
        torch.set_num_threads(old)
    recs = recs[1:] or recs
    return (statistics.median(r["cpu_s"] for r in recs),
            statistics.median(r["outside_passes_cpu_s"] for r in recs))


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


def fit_runs(global_batch: int) -> tuple[tuple[int, int], ...]:
    """(batch, micro-batches) of the one-process fit runs: the batch B and B/4 with one
    micro-batch, B with four, B/2 with two. Four runs for the three constants, so the
    least squares averages a noisy run instead of following it."""
    B = global_batch
    return ((B, 1), (max(1, B // 4), 1), (B, 4), (max(1, B // 2), 2))


def _at_batch(tcfg: TrainConfig, gb: int) -> TrainConfig:
    """``tcfg`` with the global batch of a fit run."""
    return TrainConfig(**{**asdict(tcfg), "global_batch": gb})


def fit_run_parts(mcfg: ModelConfig, tcfg: TrainConfig, gb: int, m: int
                  ) -> tuple[float, float]:
    """(CPU s per step, of which outside the passes) of the one-process fit run of batch
    ``gb`` and ``m`` micro-batches."""
    return _one_process(mcfg, _at_batch(tcfg, gb), ParallelPlan(micro_batches=m))


def one_fit_run(mcfg: ModelConfig, tcfg: TrainConfig, gb: int, m: int) -> float:
    """CPU s per step of the one-process fit run of batch ``gb`` and ``m`` micro-batches."""
    return fit_run_parts(mcfg, tcfg, gb, m)[0]


def _fit_run_child(job: tuple[dict, dict, int, int]) -> float:
    mcfg, tcfg, gb, m = job
    return one_fit_run(ModelConfig(**mcfg), TrainConfig(**tcfg), gb, m)


class BusyPool:
    """``cores`` worker processes for the busy runs of :func:`busy_core_speed`, spawned
    on first use and kept (a grid measures one beside every plan: spawning and importing
    torch each time would cost more than the run)."""

    def __init__(self, cores: int) -> None:
        self.cores, self._pool = cores, None

    def map(self, fn, jobs: list) -> list:
        if self._pool is None:
            import multiprocessing as mp

            self._pool = mp.get_context("spawn").Pool(self.cores)
        return self._pool.map(fn, jobs)

    def __enter__(self) -> BusyPool:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()


def busy_core_speed(mcfg: ModelConfig, tcfg: TrainConfig, gb: int, m: int, alone: float,
                    cores: int, pool: BusyPool | None = None) -> float:
    """A core's speed on the fit run while every core runs one (``cores`` processes at
    once, in ``pool`` or a fresh one), over its speed alone (``alone`` CPU s per step):
    what a training step's own mix of matmuls and memory-bound work loses to the cores it
    shares caches, memory bandwidth and (on a VM) physical cores with. The calibration's
    figure times small matmuls only (0.88 on one box, where the fit run gave 0.86-1.0).
    Not capped: one measurement can come out above 1 (the callers cap what they price)."""
    if cores <= 1:
        return 1.0
    if pool is None:
        with BusyPool(cores) as fresh:
            return busy_core_speed(mcfg, tcfg, gb, m, alone, cores, fresh)
    times = pool.map(_fit_run_child, [(asdict(mcfg), asdict(tcfg), gb, m)] * cores)
    return alone / statistics.median(times)


def profile_machine(profile: str | None):
    """The machine as the profile (and any saved fit) describes it; refused with the
    command to run when this machine has not been calibrated."""
    from paratrain.predict import load_machine

    machine = load_machine(profile)
    if machine is None:
        raise ValueError("no hardware profile of this machine; run `paratrain bench "
                         "calibrate` first (or pass --profile PATH)")
    return machine


def measure_fit(mcfg: ModelConfig, tcfg: TrainConfig, profile: str | None, log=print
                ) -> dict:
    """What the CPU fit is made of: the profile's machine, one thread's matmul peak, the
    one-process runs (:func:`fit_runs`: (batch, micro-batches, CPU s per step)) and the
    CPU and wall a collective costs (:func:`collective_costs`). The peak, each run and
    the collective costs (judged on the CPU of a large call, :func:`large_call_cpu`)
    are repeated until stable, or refused on a busy machine
    (:func:`paratrain.bench.calibrate.until_stable`)."""
    from paratrain.bench.calibrate import default_rule, until_stable
    from paratrain.run.ring_fit import ring_core_times, ring_costs

    machine = profile_machine(profile)
    again = "paratrain check-model"
    (peak,) = until_stable(lambda: [_thread_peak()], "one thread's matmul peak",
                           default_rule(), command=again)
    runs, fixed = [], []
    for gb, m in fit_runs(tcfg.global_batch):
        t, fx = until_stable(lambda gb=gb, m=m: list(fit_run_parts(mcfg, tcfg, gb, m)),
                             f"the fit run's CPU s per step (batch {gb}, {m} micro-batches)",
                             default_rule(), judged=lambda r: r[:1], command=again)
        runs.append((gb, m, t))
        fixed.append(fx)
        log(f"fit run: batch {gb}, micro-batches {m}: {t:.4f} CPU s/step, {fx * 1e3:.2f} ms "
            "of it outside the passes")
    moe = plan_model(ParallelPlan(dp=2, ep=2), mcfg)
    (moe_t,) = until_stable(lambda: [one_fit_run(moe, tcfg, tcfg.global_batch, 1)],
                            "the MoE fit run's CPU s per step", default_rule(), command=again)
    log(f"MoE fit run (the EP plans' model, one process): {moe_t:.4f} CPU s/step")
    ring = until_stable(lambda: ring_core_times(mcfg, tcfg),
                        "the CPU of a ring-attention call on 2 ranks", default_rule(),
                        judged=lambda r: [x for i, x in enumerate(r) if i % 4 in (0, 2)],
                        command=again)
    own_hop, own_byte, gloo_hop, gloo_byte = ring_costs(ring)
    log(f"ring attention on 2 ranks, batch {tcfg.global_batch}: {ring[0] * 1e3:.2f} ms CPU "
        f"per call ({ring[1] * 1e3:.2f} on its thread), the plain core on the whole sequence "
        f"{ring[2] * 1e3:.2f} ms; beyond its FLOPs {own_hop * 1e6:.0f} us per hop and "
        f"{own_byte * 1e9:.2f} ns per byte sent on the rank's thread, {gloo_hop * 1e6:.0f} "
        f"us and {gloo_byte * 1e9:.2f} ns on gloo's")
    gb, m, alone = runs[0]
    (speed,) = until_stable(lambda: [min(1.0, busy_core_speed(mcfg, tcfg, gb, m, alone,
                                                              machine.cores))],
                            "a core's speed with every core running the fit run",
                            default_rule(), command=again)
    log(f"a core runs the fit run at {speed:.2f} of its speed alone while every core runs "
        f"one (the calibration's matmuls: {machine.core_speed:.2f})")
    (scalar,) = until_stable(lambda: [scalar_cost()], "the CPU of an 8-byte gloo all-reduce",
                             default_rule(), command=again)
    log(f"gloo all-reduce of the loss or the gradient norm on 4 ranks: {scalar * 1e6:.0f} us "
        "CPU")
    coll = until_stable(collective_costs, "the CPU of a 1 MiB gloo all-reduce",
                        default_rule(), judged=lambda r: [large_call_cpu(r)], command=again)
    call_cpu, step_cpu, byte_cpu, alpha, bw = coll
    log(f"gloo all-reduce: CPU {call_cpu * 1e6:.1f} us per call, {step_cpu * 1e6:.1f} us per "
        f"ring step, {byte_cpu * 1e9:.3f} ns per byte; wall {alpha * 1e6:.1f} us per ring "
        f"step, {bw / 1e9:.3f} GB/s (the profile's: {machine.hw.intra_alpha * 1e6:.1f} us, "
        f"{machine.hw.intra_bw / 1e9:.3f} GB/s)")
    return {"machine": machine, "peak": peak, "runs": runs, "coll": coll,
            "core_speed": speed, "busy": [], "moe": (moe, tcfg, moe_t), "fixed": fixed,
            "ring": ring,
            "scalar": scalar}


def fit_core_speed(inputs: dict) -> float:
    """The fit's core speed with every core busy: the median of the one measured before
    the grid and those beside each plan (``inputs["busy"]``, check-model's), at most 1."""
    return min(1.0, statistics.median([inputs["core_speed"], *inputs["busy"]]))


def fitted_machine(mcfg: ModelConfig, inputs: dict, profile: str | None, save: bool = True,
                   log=print):
    """The machine model from :func:`measure_fit`'s ``inputs``: the per-step cost as the
    fit runs measured it (the median of their CPU outside the passes), eta and the
    per-pass cost by least squares over every one-process run
    (:func:`paratrain.predict.fit_from_runs`),
    the collectives' CPU, and their wall latency and bandwidth in place of the profile's
    (the profile's sweep times the median call on one hot buffer; a step pays the mean
    call on buffers its compute has just evicted). Saved beside the profile."""
    from paratrain.predict import fit_from_runs, save_fit
    from paratrain.predict.machine import RING_FIELDS
    from paratrain.run.ring_fit import ring_costs

    machine, peak = inputs["machine"], inputs["peak"]
    call_cpu, step_cpu, byte_cpu, alpha, bw = inputs["coll"]
    step_s = statistics.median(inputs["fixed"]) if inputs.get("fixed") else None
    fitted = fit_from_runs(mcfg, inputs["runs"], machine.hw, peak, step_s).replace(
        hw=machine.hw.replace(intra_alpha=alpha, intra_bw=bw), coll_call_cpu_s=call_cpu,
        coll_step_cpu_s=step_cpu, coll_byte_cpu_s=byte_cpu, wake_s=machine.wake_s,
        sync_cpu_s=machine.sync_cpu_s,
        busy_sync_s=machine.busy_sync_s, core_speed=fit_core_speed(inputs),
        sched=machine.sched,
        scalar_cpu_s=inputs.get("scalar", 0.0))
    ring = ring_costs(inputs["ring"]) if inputs.get("ring") else (0.0,) * len(RING_FIELDS)
    fitted = fitted.replace(route_s=route_cost(inputs["moe"], fitted),
                            **dict(zip(RING_FIELDS, ring, strict=True)))
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


def run_paces(mcfg: ModelConfig, tcfg: TrainConfig, runs: list[tuple[int, int, float]],
              machine) -> list[float]:
    """Each one-process fit run's pace: its price on the fitted ``machine`` over the CPU
    s per step it measured (1: the fit's average; 0.8: the machine ran 25% slower than
    the fit's average while that run trained). `paratrain check-model` runs one before
    and one after every plan and prices the plan at the two's mean
    (:meth:`paratrain.predict.MachineModel.at_pace`): the same workload on one process
    a few seconds away, never the plan's own measurement."""
    from paratrain.predict import predict

    return [predict(mcfg, _at_batch(tcfg, gb), ParallelPlan(micro_batches=m), 1,
                    machine).cpu_rank0_s / t for gb, m, t in runs]


def relative_paces(runs: list[tuple[int, int, float]], paces: list[float]) -> list[float]:
    """Each run's pace over the median pace of the fit runs of its kind (batch and
    micro-batches): the drift alone. The fit's line misses each kind by a few percent of
    its own (on the 2-core box the B/4 run 4% above the B run, every time), and a plan
    bracketed by two kinds would otherwise carry their misfit as if it were the machine's
    speed: over a whole grid the raw paces averaged 1.016 and 1.018."""
    kinds: dict[tuple[int, int], list[float]] = {}
    for (gb, m, _), pace in zip(runs, paces, strict=True):
        kinds.setdefault((gb, m), []).append(pace)
    mid = {k: statistics.median(v) for k, v in kinds.items()}
    return [pace / mid[(gb, m)] for (gb, m, _), pace in zip(runs, paces, strict=True)]


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
    assignments = mcfg.moe_layers * tcfg.global_batch * mcfg.context * mcfg.top_k
    return max(0.0, (t - priced) / assignments)


def fit_machine(mcfg: ModelConfig, tcfg: TrainConfig, profile: str | None,
                save: bool = True, log=print):
    """Measure the fit's inputs (:func:`measure_fit`) and fit them
    (:func:`fitted_machine`) at once."""
    return fitted_machine(mcfg, measure_fit(mcfg, tcfg, profile, log), profile, save, log)
