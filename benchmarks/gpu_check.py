"""The GPU check of issue 22: bf16 on CUDA, layout parity on one GPU, a 1B step vs the model.

    python benchmarks/gpu_check.py                     # one CUDA GPU, under 8 minutes
    python benchmarks/gpu_check.py --device cpu --tiny # the same code paths on CPU, tiny

Every run is the project's own ``paratrain train`` in a subprocess with a timeout; its
``summary.json`` and ``metrics.jsonl`` are read back. Three parts, one table:

1. **bf16 curve**: the default model and run (``--eval-every 0``) three times: on the
   device in bf16 and in float32, and in one CPU process in float32. Two questions, two
   references. *Does the device compute the function the CPU does?* Its float32 losses
   match the CPU's to 1e-4 relative over the first 10 steps. *Does bf16 learn like
   float32?* On the same device, the mean loss over the last quarter of the steps is
   within 2 % of float32's and the mean absolute gap there under 0.05 nats. bf16 is not
   judged against the CPU's trajectory: two float32 runs that differ only in the order of
   rounding (CUDA's kernels against the CPU's) agree to 6 digits for 15 steps, then part
   and end 2-3 % apart on this model (measured on an H200, docs/gpu-check.md), so a bound
   on that gap would fail float32 against itself. The CPU-vs-device gap over the last
   quarter is printed beside, as the size of that divergence.
2. **parity**: DP, ZeRO-3, TP + SP, PP (1F1B), CP (ring, all-to-all), EP and 4-process
   tp 2 x dp 2 ZeRO-3 in float64, each loss trajectory against one CPU process at the
   same settings: max relative difference <= 1e-9 (the project's rule). The ranks share
   the GPU over gloo (NCCL refuses two ranks on one device; ``pick_backend`` picks gloo
   with CUDA tensors when a node runs more ranks than it has GPUs). gloo stages CUDA
   all-reduce, broadcast, all-gather and all-to-all through pinned host memory, but its
   send/recv hand the tensor's pointer to the TCP transport, and the runtime has no hook
   to stage point-to-point tensors: the pipeline and ring-attention rows run with CPU
   tensors (``CUDA_VISIBLE_DEVICES`` empty) on a GPU machine, and say so.
3. **1B step**: the catalogue's OLMo 1B shape (16 layers, d_model 2048, 16 heads, SwiGLU
   8192; byte vocabulary), sequence 4096, bf16, one process: the median step time after
   two warm-up steps, MFU = the systems model's model FLOPs / (step x the catalogue's
   BF16 peak), beside ``predict_step``'s step time and MFU for the same model, plan and
   GPU (from ``torch.cuda.get_device_name``, or ``--hardware KEY``; an unknown GPU gets
   the measurement only). Engine priced: ``torchtitan`` (eager PyTorch, unfused
   element-wise work, flash attention).

Time: ``--budget-s`` (default 450) is split over the parts by weight, each taking its
share of what is left when it starts. A run's timeout is the rest of its part's share;
past it the run's session is stopped (torchrun and the workers with it); a run that
cannot get ``min_run_s`` is "skipped: time budget"; a failure is one row "FAILED:
reason". Rows print as they end, then the table. Exit: 0 when no row failed, 1 when one
did, 2 for bad input or no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paratrain.config import ModelConfig, TrainConfig, flag_for
from paratrain.cost.hardware import load_hardware
from paratrain.cost.shapes import as_shape, load_model
from paratrain.plan import ParallelPlan
from paratrain.predict.gpu import ENGINE, gpu_hardware, gpu_prediction

WEIGHTS = {"curve": 0.25, "parity": 0.45, "step": 0.3}  # shares of the time budget
CURVE_MEAN_REL, CURVE_MEAN_ABS, PARITY_REL = 0.02, 0.05, 1e-9
SAME_FN_REL, SAME_FN_STEPS = 1e-4, 10  # device float32 against cpu float32, first steps
BIG_MODEL = "olmo-1b"
STEP_RUN = dict(global_batch=2, steps=8, warmup_steps=2, eval_every=0, dtype="bfloat16")
COLLECTIVE_TIMEOUT_S = 60.0  # paratrain's --timeout: a hung collective names itself
P2P_NOTE = "cpu (gloo has no CUDA send/recv)"


def shape(layers: int, d: int, heads: int, ff: int, context: int) -> tuple[str, ...]:
    return ("--layers", str(layers), "--d-model", str(d), "--heads", str(heads), "--d-ff",
            str(ff), "--context", str(context))


@dataclass(frozen=True)
class Sizes:
    """The shapes and lengths of every run: the real check, or a tiny one for CPU."""

    curve: tuple[str, ...]  # flags of the curve runs (besides --dtype)
    parity: tuple[str, ...]
    big: dict | None  # ModelConfig fields of the step's model; None: OLMo 1B's, seq 4096
    min_run_s: float  # a run that cannot get this long is not started


PARITY_RUN = ("--global-batch", "8", "--lr", "1e-2", "--warmup-steps", "2", "--eval-every",
              "0", "--dtype", "float64")
FULL = Sizes(("--eval-every", "0"), (*shape(4, 64, 4, 128, 64), *PARITY_RUN, "--steps", "6"),
             None, 20.0)
TINY = Sizes((*shape(2, 32, 4, 64, 32), "--global-batch", "8", "--steps", "12",
              "--warmup-steps", "3", "--eval-every", "0"),
             (*shape(2, 32, 4, 64, 32), *PARITY_RUN, "--steps", "4"),
             dict(n_layers=2, d_model=64, n_heads=4, d_ff=128, context=64), 5.0)
MOE = ("--experts", "4", "--top-k", "2")
# (row name, processes, flags, MoE model, sends point-to-point)
LAYOUTS = (("dp2", 2, (), False, False),
           ("zero3 dp2", 2, ("--zero", "3"), False, False),
           ("tp2 + sp", 2, ("--tp", "2", "--sp"), False, False),
           ("pp2 1f1b, 2 micro-batches", 2, ("--pp", "2", "--micro-batches", "2"), False, True),
           ("cp2 ring", 2, ("--cp", "2"), False, True),
           ("cp2 all-to-all", 2, ("--cp", "2", "--cp-algorithm", "all-to-all"), False, False),
           ("ep2, 4 experts", 2, ("--ep", "2"), True, False),
           ("tp2 x dp2 zero3", 4, ("--tp", "2", "--zero", "3"), False, False))


class Failed(Exception):
    """A run or a comparison failed: the message is the row's reason."""


class Skipped(Exception):
    """Not enough of the part's time left to start another run."""


@dataclass
class Row:
    part: str
    check: str
    tensors: str  # where the checked run's tensors live
    result: str = "ok"  # or "FAILED: reason", "skipped: time budget"
    detail: str = ""
    seconds: float = 0.0


class Budget:
    """The time budget: what is left is split over the parts still to run by their
    weights when each starts. ``clock`` is injectable (the tests drive it)."""

    def __init__(self, total_s: float, weights: dict[str, float], clock=time.monotonic):
        self.clock, self.end, self.weights = clock, clock() + total_s, dict(weights)

    def shares(self) -> dict[str, float]:
        left, w = max(0.0, self.end - self.clock()), sum(self.weights.values()) or 1.0
        return {p: left * x / w for p, x in self.weights.items()}

    def start(self, part: str) -> float:
        """The deadline (on ``clock``) of ``part``, which leaves the parts to run."""
        deadline = self.clock() + self.shares()[part]
        del self.weights[part]
        return deadline


@dataclass
class Ctx:
    """What every check needs; ``deadline``: the part's, on the budget's clock."""

    device: str  # "cuda" or "cpu"
    sizes: Sizes
    work: Path
    budget: Budget
    deadline: float = 0.0
    runs: int = 0
    refs: dict = field(default_factory=dict)


def _error_line(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return ([x for x in lines if x.startswith("error:")] or lines or ["no output"])[-1][:200]


def _stop(p: subprocess.Popen) -> None:
    """End a run's whole session: SIGTERM (the launcher forwards it to torchrun and the
    workers, which stop after their step), then SIGKILL if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
            p.communicate(timeout=15)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def train(ctx: Ctx, flags: tuple[str, ...] | list[str], on_cpu: bool) -> tuple[dict, list]:
    """``paratrain train FLAGS`` in a fresh process session, on CPU when ``on_cpu``
    (no visible GPU): (summary, per-step records); Failed, or Skipped without time."""
    timeout = ctx.deadline - ctx.budget.clock()
    if timeout < ctx.sizes.min_run_s:
        raise Skipped
    ctx.runs += 1
    run_dir = ctx.work / f"run{ctx.runs:02d}"
    cmd = [sys.executable, "-m", "paratrain.cli", "train", *flags, "--run-dir", str(run_dir),
           "--quiet", "--timeout", f"{min(COLLECTIVE_TIMEOUT_S, timeout):.0f}"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, CUDA_VISIBLE_DEVICES="") if on_cpu else None,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(p)
        raise Failed(f"timed out after {timeout:.0f} s (the part's time budget)") from None
    run_dir.mkdir(parents=True, exist_ok=True)  # the whole output, for --keep's reader
    (run_dir / "output.txt").write_text(f"$ {' '.join(cmd)}\n{out}\n--- stderr ---\n{err}")
    if p.returncode != 0:
        raise Failed(f"exit {p.returncode}: {_error_line(err + out)}")
    try:
        steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return json.loads((run_dir / "summary.json").read_text()), steps
    except (OSError, ValueError) as e:
        raise Failed(f"unreadable outputs in {run_dir}: {e}") from None


def _tail_mean(x: list[float]) -> float:
    """The mean of the last quarter of a trajectory (at least its last loss)."""
    q = max(1, len(x) // 4)
    return sum(x[-q:]) / q


def gaps(a: list[float], ref: list[float]) -> tuple[float, float, float]:
    """(max relative difference: the parity tests' metric, relative difference of the
    last quarter's mean losses, mean absolute difference over that quarter) of two
    trajectories."""
    if len(a) != len(ref) or not ref:
        raise Failed(f"{len(a)} losses against the reference's {len(ref)}")
    pairs = list(zip(a, ref, strict=True))
    return (max(abs(x - y) / abs(y) for x, y in pairs),
            (_tail_mean(a) - _tail_mean(ref)) / abs(_tail_mean(ref)),
            _tail_mean([abs(x - y) for x, y in pairs]))


def judge_curve(bf16: list[float], f32: list[float], cpu: list[float] | None
                ) -> tuple[list[str], str]:
    """(reasons it failed, detail) for the device's bf16 and float32 trajectories and the
    CPU's float32 one (None when the device is the CPU)."""
    _, rel, mean = gaps(bf16, f32)
    reasons = []
    if abs(rel) > CURVE_MEAN_REL or mean > CURVE_MEAN_ABS:
        reasons.append("bf16 leaves float32")
    detail = (f"{len(f32)} steps, last quarter: bf16 mean {_tail_mean(bf16):.4f} vs float32 "
              f"{_tail_mean(f32):.4f} ({100 * rel:+.2f}%, tol {100 * CURVE_MEAN_REL:g}%), mean"
              f" |gap| {mean:.4f} (tol {CURVE_MEAN_ABS:g})")
    if cpu is None:
        return reasons, detail + "; float32 on the device is the cpu reference"
    n = min(SAME_FN_STEPS, len(cpu))
    first = gaps(f32[:n], cpu[:n])[0]
    if not first <= SAME_FN_REL:
        reasons.append(f"float32 departs from the cpu's in the first {n} steps")
    return reasons, detail + (f"; device float32 vs cpu float32: first {n} steps max rel diff "
                              f"{first:.1e} (tol {SAME_FN_REL:g}), last quarter "
                              f"{100 * gaps(f32, cpu)[1]:+.2f}% (rounding order alone)")


def check_curve(ctx: Ctx, row: Row) -> None:
    on_cpu = ctx.device == "cpu"
    bf16, f32 = (train(ctx, [*ctx.sizes.curve, "--nproc", "1", "--dtype", dt], on_cpu)[0]
                 ["losses"] for dt in ("bfloat16", "float32"))
    cpu = None if on_cpu else train(ctx, [*ctx.sizes.curve, "--nproc", "1", "--dtype",
                                          "float32"], on_cpu=True)[0]["losses"]
    reasons, row.detail = judge_curve(bf16, f32, cpu)
    if reasons:
        row.result = "FAILED: " + "; ".join(reasons)


def _reference(ctx: Ctx, moe: bool) -> list[float]:
    """One CPU process at the parity settings (run once per model, on first need; a
    failure is every dependent row's reason)."""
    if moe not in ctx.refs:
        try:
            ctx.refs[moe] = train(ctx, [*ctx.sizes.parity, *(MOE if moe else ()), "--nproc",
                                        "1"], on_cpu=True)[0]["losses"]
        except Failed as e:
            ctx.refs[moe] = f"the 1-process cpu reference: {e}"
    if isinstance(ctx.refs[moe], str):
        raise Failed(ctx.refs[moe])
    return ctx.refs[moe]


def check_layout(ctx: Ctx, row: Row, nproc: int, flags: tuple, moe: bool, p2p: bool) -> None:
    ref = _reference(ctx, moe)
    s, _ = train(ctx, [*ctx.sizes.parity, *(MOE if moe else ()), "--nproc", str(nproc),
                       *flags], on_cpu=ctx.device == "cpu" or p2p)
    d = gaps(s["losses"], ref)[0]
    row.detail = f"{len(ref)} steps float64: max rel diff {d:.2e} (tol {PARITY_REL:g})"
    if not d <= PARITY_REL:
        row.result = f"FAILED: max rel diff {d:.2e} > {PARITY_REL:g}"


def pick_hardware(device: str, override: str | None):
    """(Hardware or None, what the row says about it)."""
    if override:
        return load_hardware(override), f"priced as {load_hardware(override).name} (--hardware)"
    if device == "cpu":
        return None, "no catalogue peak for a CPU; pass --hardware KEY to price a GPU"
    name = torch.cuda.get_device_name(0)
    try:
        hw = gpu_hardware(name)
    except ValueError as e:
        return None, f"{e}; pass --hardware KEY"
    return hw, f"{name} -> {hw.name}"


def big_model(sizes: Sizes):
    """The step's model (a ModelConfig: byte vocabulary) and its `paratrain train` flags:
    the catalogue's OLMo 1B shape at sequence 4096, or the tiny sizes'."""
    names = ("n_layers", "d_model", "n_heads", "d_ff")
    fields = sizes.big or {**{n: getattr(load_model(BIG_MODEL), n) for n in names},
                           "context": 4096}
    return ModelConfig(**fields), flags_of(fields)


def flags_of(fields: dict) -> list[str]:
    """The `paratrain train` flags that set these ModelConfig / TrainConfig fields."""
    return [a for n, v in fields.items() for a in (flag_for(n), str(v))]


def check_step(ctx: Ctx, row: Row, hardware: str | None) -> None:
    """The step's median after warm-up, priced by the function the run's own prediction
    uses (:func:`paratrain.predict.gpu.gpu_prediction`); on CUDA the run must have
    printed that prediction itself."""
    hw, said = pick_hardware(ctx.device, hardware)
    cfg, flags = big_model(ctx.sizes)
    s, steps = train(ctx, [*flags, *flags_of(STEP_RUN), "--nproc", "1"],
                     on_cpu=ctx.device == "cpu")
    step_s = statistics.median(r["step_s"] for r in steps[2:])
    if as_shape(cfg).num_params() != s["params"]:  # the model priced is the model measured
        raise Failed(f"priced {as_shape(cfg).num_params()} parameters, trained {s['params']}")
    if ctx.device == "cuda" and "gpu" not in (s.get("prediction") or {}):
        raise Failed(f"the run printed no GPU prediction: {s.get('prediction')}")
    row.detail = f"{s['params']:,} params, {s['tokens_per_step']} tokens/step: {step_s:.4f} s/step"
    if hw is None:
        row.detail += f"; {said}"
        return
    rep = gpu_prediction(cfg, TrainConfig(**STEP_RUN), ParallelPlan(), 1,
                         {**s, "step_s": step_s}, hw)
    c = rep["vs_measured"]
    row.detail += (f", MFU {100 * c['mfu']['measured']:.1f}% of {hw.peak_flops / 1e12:.0f} TF;"
                   f" predicted {c['step_s']['predicted']:.4f} s "
                   f"({100 * c['step_s']['error']:+.1f}%), MFU {100 * c['mfu']['predicted']:.1f}%"
                   f" ({ENGINE}; {said})")


def jobs(a: argparse.Namespace, sizes: Sizes) -> dict[str, list]:
    """Each part's (row, job) pairs: the rows exist before the runs, so a failure or a
    skip still says what was checked and on what."""
    dev = a.device
    parity = [(Row("parity", f"parity {name}", "cpu" if dev == "cpu" else P2P_NOTE if p2p
                   else f"cuda (gloo, {n} ranks on 1 GPU)"),
               lambda ctx, row, n=n, f=f, moe=moe, p2p=p2p: check_layout(ctx, row, n, f, moe,
                                                                         p2p))
              for name, n, f, moe, p2p in LAYOUTS]
    label = "~1B step, seq 4096, bf16" if sizes.big is None else "tiny step, bf16"
    refs = f"{dev} float32" + ("" if dev == "cpu" else " vs cpu float32")
    return {"curve": [(Row("curve", "bf16 loss curve, default model", f"{dev} bf16 vs {refs}"),
                       check_curve)],
            "parity": parity,
            "step": [(Row("step", label, dev),
                      lambda ctx, row: check_step(ctx, row, a.hardware))]}


def run_part(ctx: Ctx, part: str, todo: list, rows: list[Row]) -> None:
    """One part: its deadline, then each job ``fn(ctx, row)`` fills its row; a run that
    fails or finds no time left is the row's result. Each row prints as it ends."""
    ctx.deadline = ctx.budget.start(part)
    for row, fn in todo:
        t0 = time.monotonic()
        try:
            fn(ctx, row)
        except Failed as e:
            row.result = f"FAILED: {e}"
        except Skipped:
            row.result = "skipped: time budget"
        row.seconds = time.monotonic() - t0
        rows.append(row)
        print(f"{part} | {row.check} | {row.result} | {row.seconds:.0f} s | {row.detail}",
              flush=True)


def format_table(rows: list[Row]) -> str:
    cells = [("part", "check", "tensors", "result", "s", "detail")] + [
        (r.part, r.check, r.tensors, r.result, f"{r.seconds:.0f}", r.detail) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    return "\n".join("  ".join([*(c[i].ljust(widths[i]) for i in range(5)), c[5]])
                     for c in cells)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="the module docstring explains every check")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="where the checked runs train (cpu: hide any GPU)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (for CPU and the tests)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="time for all parts, s")
    ap.add_argument("--parts", default="curve,parity,step", help="comma-separated subset")
    ap.add_argument("--hardware", default=None, help="hardware catalogue key to price "
                    "against (default: from the GPU's name)")
    ap.add_argument("--keep", default=None, help="keep the run directories here (each with "
                    "its command and whole output in output.txt)")
    return ap.parse_args(argv)


def check_args(a: argparse.Namespace) -> list[str]:
    """The parts to run; ValueError (one line) for bad input or no CUDA device."""
    if not a.budget_s > 0:
        raise ValueError(f"--budget-s {a.budget_s:g}: must be a positive number of seconds")
    chosen = [p.strip() for p in a.parts.split(",") if p.strip()]
    if not chosen or any(p not in WEIGHTS for p in chosen):
        raise ValueError(f"--parts {a.parts!r}: choose from {', '.join(WEIGHTS)}")
    if a.hardware:
        try:
            load_hardware(a.hardware)
        except ValueError as e:  # the catalogue's own line names the keys
            raise ValueError(f"--hardware {a.hardware!r}: {e}") from None
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("no CUDA device is visible (torch.cuda.is_available() is False); run"
                         " this on a machine with a GPU, or pass --device cpu --tiny to run "
                         "the same code paths on CPU")
    return chosen


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:
        chosen = check_args(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    budget = Budget(a.budget_s, {p: WEIGHTS[p] for p in chosen})
    print("time budget: " + ", ".join(f"{p} {s:.0f} s" for p, s in budget.shares().items())
          + f" (of {a.budget_s:.0f} s)", flush=True)
    sizes, rows = TINY if a.tiny else FULL, []
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as tmp:
        ctx = Ctx(a.device, sizes, Path(a.keep or tmp), budget)
        ctx.work.mkdir(parents=True, exist_ok=True)
        todo = jobs(a, sizes)
        for p in chosen:
            run_part(ctx, p, todo[p], rows)
    print(format_table(rows))
    return 1 if any(r.result.startswith("FAILED") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
