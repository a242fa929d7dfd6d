"""Close the loop on this machine: run a grid of plans, set the prediction beside each.

Why: a model that is never checked is an opinion (issue 7). ``paratrain check-model``
measures this machine's CPU constants from single-process runs of the grid's model and
bare collectives (:mod:`paratrain.run.cpu_fit`), then trains every
plan of the grid for a few steps in fresh gloo processes (one more fit run before each
and one after the last, so the fit, made at the end and saved beside the profile, spans
the grid) and compares, per plan:

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

Each plan is launched three times (``--launches``), in three passes over the grid, and
its record is the launch with the median error (every launch's error is printed beside
it). A launch is one draw of where the scheduler puts the ranks and their gloo threads:
on a quiet 2-core box one dp2 launch ran every step at 0.148 s where the launches before
and after ran at 0.116 and 0.124 s, with the same CPU per step (0.116 s), so one launch
per plan put a plan's error anywhere within a spread of +/-15% (docs/train-prediction.md,
"Launches").

A VM's speed drifts: the same one-process step took 0.21, 0.23 and 0.28 s within an hour
on the 2-core box, while the grid takes 5 minutes. So each plan is priced at the pace of
the two fit runs just before and just after it (their price on the fitted machine over
what they measured, :func:`paratrain.run.cpu_fit.run_paces`, each over its kind's median:
:func:`~paratrain.run.cpu_fit.relative_paces`): the same workload on one process seconds
away, never the plan's own measurement. The record keeps the prediction
at the fit's average pace beside it (``error_at_fit_pace``), and the table gives both
medians. Each of those fit runs is then run again on every core at once (in a pool of
workers kept for the grid), and the plan is priced at the core speed with every core busy
that the two measured (``busy``): a host whose other tenants take the physical cores'
siblings slows a multi-process plan more than the one-process run shows.

The grid covers DP, ZeRO-1/2/3, TP, PP (1F1B, interleaved), CP (ring and all-to-all) and
EP, alone and composed, on 2-8 ranks; the EP plan trains the grid's model with a small
MoE MLP (:func:`plan_model`). Every plan passes :meth:`ParallelPlan.check_run` before any
run starts. The whole grid takes about 12 minutes on 2 quiet cores (6 with
``--launches 1``).

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
from paratrain.predict.machine import RING_FIELDS
from paratrain.run import cpu_fit
from paratrain.run.coll_fit import (  # noqa: F401 - the fit's names, re-exported
    COLL_LARGE,
    COLL_SMALL,
    solve_collective_costs,
)
from paratrain.run.cpu_fit import (  # noqa: F401 - the fit's names, re-exported
    MOE,
    BusyPool,
    fit_machine,
    fit_runs,
    fitted_machine,
    measure_fit,
    one_fit_run,
    plan_model,
    profile_machine,
    relative_paces,
    route_cost,
    run_paces,
)

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
# Times each plan is launched, in separate passes over the grid: the median launch is its
# record (:func:`_median_launch`)
LAUNCHES = 3
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
             data: str | None = None, launches: int = LAUNCHES, log=print) -> dict:
    """Run the grid (or ``names`` of it) ``launches`` times over, in passes; return
    {"records": [...] (one per plan: its median launch, :func:`_median_launch`),
    "median_abs_error", "machine": {...}}."""
    names = list(GRID) if names is None else names
    unknown = [n for n in names if n not in GRID]
    if unknown:
        raise ValueError(f"unknown plan(s) {unknown}; choose from {', '.join(GRID)}")
    if steps < 3:
        raise ValueError(f"--steps {steps}: need at least 3 (the first is warm-up)")
    if launches < 1:
        raise ValueError(f"--launches {launches}: need at least 1")
    tcfg = TrainConfig(steps=steps, global_batch=global_batch, lr=1e-3, warmup_steps=1,
                       eval_every=0, eval_batches=1, data=data)
    inputs = measure_fit(mcfg, tcfg, profile, log) if fit else None
    machine = None if fit else profile_machine(profile)
    plans = {name: (GRID[name], plan_model(GRID[name], mcfg)) for name in names}
    for plan, model in plans.values():
        plan.check_run(model, plan.world_size, global_batch)
    order = fit_runs(global_batch)
    first = len(inputs["runs"]) if inputs is not None else 0

    def fit_run(i: int, pool: BusyPool) -> None:  # before each plan and after the last:
        gb, m = order[i % len(order)]  # alone, then on every core at once
        alone = cpu_fit.one_fit_run(mcfg, tcfg, gb, m)
        inputs["runs"].append((gb, m, alone))
        inputs["busy"].append(cpu_fit.busy_core_speed(mcfg, tcfg, gb, m, alone, pool.cores,
                                                      pool))

    with BusyPool(inputs["machine"].cores if inputs is not None else 1) as pool:
        runs = _launch(plans, tcfg, launches, (lambda i: fit_run(i, pool)) if fit else None,
                       log)
        if inputs is not None:
            fit_run(len(runs), pool)
    if inputs is not None:
        machine = fitted_machine(mcfg, inputs, profile, log=log)
        paces = relative_paces(inputs["runs"], run_paces(mcfg, tcfg, inputs["runs"],
                                                          machine))[first:]
        busy = inputs["busy"]
    else:  # the saved fit's, for every plan
        paces, busy = [1.0] * (len(runs) + 1), [machine.core_speed] * (len(runs) + 1)
    by_plan: dict[str, list[dict]] = {name: [] for name in plans}
    for i, (name, plan, model, others, s) in enumerate(runs):
        # the fit runs just before and just after: their pace, and alone / on every core
        pace, speed = (paces[i] + paces[i + 1]) / 2, min(1.0, (busy[i] + busy[i + 1]) / 2)
        rec = _record(name, plan, model, tcfg, machine.replace(others=others), s, pace,
                      speed)
        by_plan[name].append(rec)
        log(f"{name:<18} predicted {rec['predicted_s']:.4f} s  measured "
            f"{rec['measured_s']:.4f} s  {100 * rec['error']:+.0f}%  wire "
            f"{_yes(rec['wire_exact'])}  states {_yes(rec['states_exact'])}  (core per rank: "
            f"predicted {rec['share']:.2f}; {rec['other_threads']:.1f} other runnable threads)")
    records = [_median_launch(recs) for recs in by_plan.values()]
    errs = [abs(r["error"]) for r in records]
    cpu_errs = [abs(r["cpu_rank0_s"]["error"]) for r in records]
    flat = [abs(r["error_at_fit_pace"]) for r in records]
    return {"records": records, "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs, default=None),
            "median_abs_error_at_fit_pace": statistics.median(flat) if flat else None,
            "max_abs_error_at_fit_pace": max(flat, default=None),
            "median_abs_cpu_error": statistics.median(cpu_errs) if cpu_errs else None,
            "machine": {"eta": machine.eta, "pass_s": machine.pass_s,
                        "step_s": machine.step_s, "cores": machine.cores,
                        "core_speed": machine.core_speed,
                        "thread_peak_flops": machine.thread_peak, "alpha_s": machine.hw.intra_alpha,
                        "bw_bytes_per_s": machine.hw.intra_bw, "wake_s": machine.wake_s,
                        "sync_cpu_s": machine.sync_cpu_s,
                        "busy_sync_s": machine.busy_sync_s, "route_s": machine.route_s,
                        "scalar_cpu_s": machine.scalar_cpu_s,
                        **{k: getattr(machine, k) for k in RING_FIELDS},
                        "sched": machine.sched, "source": machine.source},
            "model": asdict(mcfg), "global_batch": global_batch, "steps": steps,
            "launches": launches}


def _launch(plans: dict, tcfg: TrainConfig, launches: int, fit_run, log) -> list[tuple]:
    """Train every plan ``launches`` times over, in passes, ``fit_run(i)`` (if any)
    before the i-th launch: [(name, plan, model, the load sampled, rank 0's summary)]."""
    from paratrain.parallel.process_groups import spawn

    runs = []
    for i, (name, (plan, model)) in enumerate([*plans.items()] * launches):
        if fit_run is not None:
            fit_run(i)
        with tempfile.TemporaryDirectory(prefix="paratrain-check-") as d, _Sampler() as smp:
            s = spawn(_train_worker, plan.world_size, asdict(model), asdict(tcfg),
                      asdict(plan), d, timeout_s=600)[0]
        runs.append((name, plan, model, tuple(smp.samples), s))
        log(f"{name:<18} measured {statistics.median(s['step_times'][1:]):.4f} s "
            f"(rank 0 got {s['cpu_share_rank0']:.2f} of a core)")
    return runs


def _median_launch(recs: list[dict]) -> dict:
    """One plan's record from its launches' (:data:`LAUNCHES`): the launch whose error is
    the median of theirs (the lower of the middle two for an even count; why: the module
    docstring), with every launch's figures beside it and wire bytes and model states
    exact only if they were in every launch."""
    mid = sorted(recs, key=lambda r: r["error"])[(len(recs) - 1) // 2]
    return {**mid, "wire_exact": all(r["wire_exact"] for r in recs),
            "states_exact": all(r["states_exact"] for r in recs),
            "launches": [{k: r[k] for k in ("measured_s", "predicted_s", "error", "pace",
                                              "core_speed", "other_threads",
                                              "cpu_share_rank0")}
                         for r in recs]}


def _record(name: str, plan: ParallelPlan, model: ModelConfig, tcfg: TrainConfig,
            machine, s: dict, pace: float, core_speed: float) -> dict:
    """One plan's record: the prediction (with the load sampled while it ran, at the
    ``pace`` and the ``core_speed`` with every core busy that the fit runs around it
    measured, and for EP at the run's own routing, as its bytes are judged) beside rank
    0's summary ``s``; the prediction at the fit's average pace and core speed is kept
    beside it."""
    from paratrain.predict import compare, predict
    from paratrain.predict.report import routing_load

    load = routing_load(s, plan, model)
    flat = predict(model, tcfg, plan, plan.world_size, machine, load)
    pred = predict(model, tcfg, plan, plan.world_size,
                   machine.at_pace(pace).replace(core_speed=core_speed), load)
    cmp = compare(pred, s, plan, 0, model, tcfg)
    measured = statistics.median(s["step_times"][1:])
    cpu = statistics.median(s["cpu_times"][1:])
    return {"plan": name, "nproc": plan.world_size, "moe": bool(model.experts),
            "other_sessions": machine.other_sessions, "other_threads": machine.other_threads,
            "others_samples": [list(o) for o in machine.others],
            "share": pred.share, "predicted_s": pred.step_s, "measured_s": measured,
            "error": pred.step_s / measured - 1, "measured_mean_s": s["step_s"],
            "pace": pace, "core_speed": core_speed, "predicted_at_fit_pace_s": flat.step_s,
            "error_at_fit_pace": flat.step_s / measured - 1,
            "cpu_share_rank0": s["cpu_share_rank0"],
            "cpu_rank0_s": {"predicted": pred.cpu_rank0_s, "measured": cpu,
                            "error": pred.cpu_rank0_s / cpu - 1},
            "critical_path_s": pred.critical_path_s,
            "session_bound_s": pred.session_work_s / pred.session_cores,
            "syncs": pred.syncs, "sync_s": pred.sync_s,
            "expert_load": {"priced": pred.expert_load, "given_routing": load is not None},
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
        f"{m['bw_bytes_per_s'] / 1e9:.2f} GB/s, sync wake {m.get('wake_s', 0) * 1e6:.0f} us "
        f"and {m.get('sync_cpu_s', 0) * 1e6:.0f} us CPU, "
        f"oversubscribed sync {m.get('busy_sync_s', 0) * 1e6:.0f} us, scalar all-reduce "
        f"{m.get('scalar_cpu_s', 0) * 1e6:.0f} us CPU, CP ring "
        f"{m.get('ring_hop_s', 0) * 1e6:.0f} + {m.get('ring_hop_cpu_s', 0) * 1e6:.0f} us per "
        f"hop and {m.get('ring_byte_s', 0) * 1e9:.2f} + {m.get('ring_byte_cpu_s', 0) * 1e9:.2f} "
        "ns per byte (own thread + gloo's)",
        f"{'plan':<27} {'procs':>5} {'others':>6} {'core':>5} {'pace':>5} {'busy':>5} "
        f"{'predicted s':>11} {'measured s':>10} {'error':>7} {'CPU s r0':>14} {'error':>7} "
        f"{'wire B/rank':>12} {'wire':>9} {'states':>9}  launches' errors",
    ]
    for r in result["records"]:
        cpu = r["cpu_rank0_s"]
        lines.append(f"{r['plan']:<27} {r['nproc']:>5} {r['other_threads']:>6.1f} "
                     f"{r['share']:>5.2f} {r['pace']:>5.2f} {r.get('core_speed', 1.0):>5.2f} "
                     f"{r['predicted_s']:>11.4f} "
                     f"{r['measured_s']:>10.4f} "
                     f"{100 * r['error']:>+6.0f}% {cpu['predicted']:>6.3f}/{cpu['measured']:<7.3f}"
                     f"{100 * cpu['error']:>+6.0f}% {_wire_measured(r['compare']):>12,.0f} "
                     f"{_yes(r['wire_exact']):>9} {_yes(r['states_exact']):>9}  "
                     + " ".join(f"{100 * x['error']:+.0f}%" for x in r.get("launches", ())))
    recs = result["records"]
    n_w = sum(r["wire_exact"] for r in recs)
    n_s = sum(r["states_exact"] for r in recs)
    k = len(recs)
    load = statistics.fmean(r["other_threads"] for r in recs) if recs else 0.0
    lines.append(f"median absolute error of step time: {100 * result['median_abs_error']:.1f}% "
                 f"over {k} plans (each its median of {result.get('launches', 1)} "
                 f"launches), worst {100 * result['max_abs_error']:.1f}%; wire bytes exact "
                 f"{n_w}/{k}; model states exact on every rank {n_s}/{k}")
    if result["median_abs_error_at_fit_pace"] is not None:
        lines.append(f"at the fit's average pace and busy core speed instead of each plan's "
                     f"('pace' and 'busy': the fit runs just before and after it, alone and "
                     f"on every core at once): median "
                     f"{100 * result['median_abs_error_at_fit_pace']:.1f}%, worst "
                     f"{100 * result['max_abs_error_at_fit_pace']:.1f}%")
    lines.append(f"median absolute error of rank 0's CPU s per step (the work, whatever the "
                 f"other sessions take): {100 * result['median_abs_cpu_error']:.1f}%; 'core' is "
                 f"the predicted core share per rank; 'others' the other sessions' runnable "
                 f"threads sampled while the plan ran (mean {load:.1f})")
    return "\n".join(lines)
