"""The GPU check of issue 22: bf16 on CUDA, layout parity on one GPU, a 1B step vs the model.

One command to run wherever a CUDA GPU is at hand: does paratrain train on CUDA, do its
layouts agree there, and how far is the systems model from one GPU's step?

    python benchmarks/gpu_check.py                     # one CUDA GPU, under 8 minutes
    python benchmarks/gpu_check.py --device cpu --tiny # the same code paths on CPU, tiny

Every run is the project's own entry point, ``paratrain train`` (``--nproc 1`` in the
process it starts, ``--nproc N`` through torchrun), in a subprocess with a timeout; its
``summary.json`` and ``metrics.jsonl`` are read back. Three parts, one table:

1. **bf16 curve**: the default model and run (``--eval-every 0``) on the device in
   bfloat16 against one CPU process in float32. bf16 rounds every activation and
   gradient, so the curves differ; they pass when the final loss is within 2 % and the
   mean absolute gap over the last quarter of the steps is under 0.05 nats.
2. **parity**: DP, ZeRO-3, TP + SP, PP (1F1B), CP (ring and all-to-all), EP and a
   4-process tp 2 x dp 2 ZeRO-3 on the device, float64, each loss trajectory against one
   CPU process at the same settings, max relative difference <= 1e-9 (the project's
   rule: only the order of additions differs). The ranks share the one GPU over gloo:
   NCCL refuses two ranks on one device, and ``process_groups.pick_backend`` picks gloo
   with CUDA tensors when a node runs more ranks than it has GPUs. gloo stages CUDA
   all-reduce, broadcast, all-gather and all-to-all through pinned host memory, but its
   send/recv hand the tensor's pointer to the TCP transport, so CUDA tensors cannot go
   point-to-point. The runtime has no hook to stage them, so the layouts that send
   point-to-point (pipeline, ring attention) run with CPU tensors (``CUDA_VISIBLE_DEVICES``
   empty) and their row says so.
3. **1B step**: OLMo 1B's shape from the model catalogue (16 layers, d_model 2048, 16
   heads, SwiGLU 8192; byte vocabulary), sequence 4096, bf16, one process: the median
   step time after two warm-up steps, MFU = the systems model's model FLOPs / (step x the
   catalogue's BF16 peak of this GPU), beside ``predict_step``'s step time and MFU for
   the same model, plan and GPU. The GPU is found from ``torch.cuda.get_device_name``
   (``--hardware KEY`` to name it); an unknown one gets the measurement only. The engine
   priced is ``torchtitan``: eager PyTorch, unfused element-wise work, flash attention.

Time: ``--budget-s`` (default 450) is split over the parts by weight, each part getting
its share of what is left when it starts (time a part leaves unspent goes to the next).
A run gets the rest of its part's share as its timeout and is killed after it (the whole
process session: torchrun and its workers); a run that cannot get ``min_run_s`` is a
row "skipped: time budget". A failure is one row "FAILED: reason". Exit status: 0 when
every row passed or was skipped, 1 when one failed, 2 for bad input or no CUDA device.
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

WEIGHTS = {"curve": 0.2, "parity": 0.5, "step": 0.3}  # shares of the time budget
CURVE_FINAL_REL, CURVE_MEAN_ABS = 0.02, 0.05
PARITY_REL = 1e-9
ENGINE = "torchtitan"
BIG_MODEL = "olmo-1b"
P2P_NOTE = "cpu (gloo has no CUDA send/recv)"
# (words all in the lower-cased torch.cuda.get_device_name, hardware catalogue key);
# the first match wins, a key the catalogue lacks means "unknown"
GPU_KEYS = ((("gh200",), "gh200"), (("gb200",), "gb200"), (("h200",), "h200"),
            (("h100", "pcie"), "h100-pcie"), (("h100", "nvl"), "h100-nvl"),
            (("h100", "96"), "h100-96gb"), (("h100",), "h100"), (("h800",), "h800"),
            (("a100", "pcie"), "a100-pcie"), (("a100", "40gb"), "a100-40gb"),
            (("a100",), "a100"), (("b200",), "b200"), (("mi300x",), "mi300x"),
            (("v100",), "v100"))


@dataclass(frozen=True)
class Sizes:
    """The shapes and lengths of every run: the real check, or a tiny one for CPU."""

    curve: tuple[str, ...]  # flags of the curve runs (besides --dtype)
    parity: tuple[str, ...]
    big: tuple[str, ...] | None  # None: OLMo 1B's shape at sequence 4096
    min_run_s: float


FULL = Sizes(curve=("--eval-every", "0"),
             parity=("--layers", "4", "--d-model", "64", "--heads", "4", "--d-ff", "128",
                     "--context", "64", "--global-batch", "8", "--steps", "6", "--lr", "1e-2",
                     "--warmup-steps", "2", "--eval-every", "0", "--dtype", "float64"),
             big=None, min_run_s=20.0)
TINY = Sizes(curve=("--layers", "2", "--d-model", "32", "--heads", "4", "--d-ff", "64",
                    "--context", "32", "--global-batch", "8", "--steps", "12",
                    "--warmup-steps", "3", "--eval-every", "0"),
             parity=("--layers", "2", "--d-model", "32", "--heads", "4", "--d-ff", "64",
                     "--context", "32", "--global-batch", "8", "--steps", "4", "--lr", "1e-2",
                     "--warmup-steps", "2", "--eval-every", "0", "--dtype", "float64"),
             big=("--layers", "2", "--d-model", "64", "--heads", "4", "--d-ff", "128",
                  "--context", "64"),
             min_run_s=5.0)
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


@dataclass
class Row:
    part: str
    check: str
    tensors: str
    result: str = "ok"
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

    def left(self, deadline: float) -> float:
        return deadline - self.clock()


@dataclass
class Ctx:
    """What every part needs: where runs go and on what, and the part's deadline."""

    device: str  # "cuda" or "cpu"
    sizes: Sizes
    work: Path
    budget: Budget
    collective_timeout_s: float = 60.0
    deadline: float = 0.0
    runs: int = 0
    refs: dict = field(default_factory=dict)

    def timeout(self) -> float:
        left = self.budget.left(self.deadline)
        if left < self.sizes.min_run_s:
            raise Skipped
        return left


class Skipped(Exception):
    """Not enough of the part's time left to start another run."""


def _error_line(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    errs = [x for x in lines if x.startswith("error:")]
    return (errs or lines or ["no output"])[-1][:200]


def _stop(p: subprocess.Popen) -> None:
    """End a run's whole session: SIGTERM (the launcher forwards it to torchrun and the
    workers, which stop after their step), then SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(p.pid, sig)
            p.communicate(timeout=wait_s)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def train(ctx: Ctx, flags: tuple[str, ...] | list[str], on_cpu: bool) -> tuple[dict, list]:
    """``paratrain train FLAGS`` in a fresh process session, on CPU when ``on_cpu``
    (no visible GPU); (summary, per-step records), or Failed / Skipped."""
    timeout = ctx.timeout()
    ctx.runs += 1
    run_dir = ctx.work / f"run{ctx.runs:02d}"
    cmd = [sys.executable, "-m", "paratrain.cli", "train", *flags, "--run-dir", str(run_dir),
           "--quiet", "--timeout", f"{min(ctx.collective_timeout_s, timeout):.0f}"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="") if on_cpu else None
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(p)
        raise Failed(f"timed out after {timeout:.0f} s (the part's time budget)") from None
    if p.returncode != 0:
        raise Failed(f"exit {p.returncode}: {_error_line(err + out)}")
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError) as e:
        raise Failed(f"unreadable outputs in {run_dir}: {e}") from None
    return summary, steps


def max_rel(a: list[float], ref: list[float]) -> float:
    """Largest relative difference of two loss trajectories (the parity tests' metric)."""
    if len(a) != len(ref):
        raise Failed(f"{len(a)} losses against the reference's {len(ref)}")
    return max(abs(x - y) / abs(y) for x, y in zip(a, ref, strict=True))


def curve_gap(dev: list[float], ref: list[float]) -> tuple[float, float]:
    """(final loss relative gap, mean absolute gap over the last quarter of the steps)."""
    if len(dev) != len(ref):
        raise Failed(f"{len(dev)} losses against the reference's {len(ref)}")
    tail = max(1, len(ref) // 4)
    gaps = [abs(a - b) for a, b in zip(dev[-tail:], ref[-tail:], strict=True)]
    return abs(dev[-1] - ref[-1]) / abs(ref[-1]), sum(gaps) / len(gaps)


def check_curve(ctx: Ctx, row: Row) -> Row:
    dev_run, _ = train(ctx, [*ctx.sizes.curve, "--nproc", "1", "--dtype", "bfloat16"],
                       on_cpu=ctx.device == "cpu")
    ref_run, _ = train(ctx, [*ctx.sizes.curve, "--nproc", "1", "--dtype", "float32"],
                       on_cpu=True)
    final, mean = curve_gap(dev_run["losses"], ref_run["losses"])
    row.detail = (f"{len(ref_run['losses'])} steps: final {dev_run['losses'][-1]:.4f} vs "
                  f"{ref_run['losses'][-1]:.4f} ({100 * final:.2f}%, tol "
                  f"{100 * CURVE_FINAL_REL:g}%), last-quarter mean |gap| {mean:.4f} "
                  f"(tol {CURVE_MEAN_ABS:g})")
    if final > CURVE_FINAL_REL or mean > CURVE_MEAN_ABS:
        row.result = "FAILED: the bf16 curve leaves the float32 one"
    return row


def _reference(ctx: Ctx, moe: bool) -> list[float]:
    """One CPU process at the parity settings (run once per model, on first need)."""
    if moe not in ctx.refs:
        try:
            s, _ = train(ctx, [*ctx.sizes.parity, *(MOE if moe else ()), "--nproc", "1"],
                         on_cpu=True)
            ctx.refs[moe] = s["losses"]
        except Failed as e:
            ctx.refs[moe] = Failed(f"the 1-process cpu reference: {e}")
    if isinstance(ctx.refs[moe], Failed):
        raise ctx.refs[moe]
    return ctx.refs[moe]


def layout_tensors(device: str, nproc: int, p2p: bool) -> str:
    if device == "cpu":
        return "cpu"
    return P2P_NOTE if p2p else f"cuda (gloo, {nproc} ranks on 1 GPU)"


def check_layout(ctx: Ctx, row: Row, nproc: int, flags: tuple, moe: bool, p2p: bool
                 ) -> Row:
    ref = _reference(ctx, moe)
    s, _ = train(ctx, [*ctx.sizes.parity, *(MOE if moe else ()), "--nproc", str(nproc),
                       *flags], on_cpu=ctx.device == "cpu" or p2p)
    d = max_rel(s["losses"], ref)
    row.detail = f"{len(ref)} steps float64: max rel diff {d:.2e} (tol {PARITY_REL:g})"
    if not d <= PARITY_REL:
        row.result = f"FAILED: max rel diff {d:.2e} > {PARITY_REL:g}"
    return row


def gpu_key(device_name: str, known: list[str]) -> str | None:
    """The hardware catalogue key of a CUDA device name, or None when it has none."""
    low = device_name.lower()
    for words, key in GPU_KEYS:
        if all(w in low for w in words):
            return key if key in known else None
    return None


def pick_hardware(device: str, override: str | None):
    """(Hardware or None, what the row says about it)."""
    from paratrain.cost.hardware import hardware_names, load_hardware

    if override:
        hw = load_hardware(override)
        return hw, f"priced as {hw.name} (--hardware)"
    if device == "cpu":
        return None, "no catalogue peak for a CPU; pass --hardware KEY to price a GPU"
    import torch

    name = torch.cuda.get_device_name(0)
    key = gpu_key(name, hardware_names())
    if key is None:
        return None, (f"GPU {name!r} is not in the hardware catalogue; pass --hardware KEY "
                      f"(one of {', '.join(hardware_names())})")
    hw = load_hardware(key)
    return hw, f"{name} -> {hw.name}"


def big_flags(sizes: Sizes) -> list[str]:
    """The 1B run's model flags: the catalogue's OLMo 1B shape at sequence 4096."""
    if sizes.big is not None:
        return list(sizes.big)
    from paratrain.config import flag_for
    from paratrain.cost.shapes import load_model

    m = load_model(BIG_MODEL)
    shape = [a for n in ("n_layers", "d_model", "n_heads", "d_ff")
             for a in (flag_for(n), str(getattr(m, n)))]
    return [*shape, "--context", "4096"]


def big_label(sizes: Sizes) -> str:
    return "~1B step, seq 4096, bf16" if sizes.big is None else "tiny step, bf16"


def check_step(ctx: Ctx, row: Row, hardware: str | None) -> Row:
    from paratrain.config import ModelConfig
    from paratrain.plan import ParallelPlan
    from paratrain.systems.step_model import predict_step

    hw, said = pick_hardware(ctx.device, hardware)
    flags = [*big_flags(ctx.sizes), "--global-batch", "2", "--steps", "8", "--warmup-steps",
             "2", "--eval-every", "0", "--dtype", "bfloat16", "--nproc", "1"]
    s, steps = train(ctx, flags, on_cpu=ctx.device == "cpu")
    step_s = statistics.median(r["step_s"] for r in steps[2:])
    seq = int(flags[flags.index("--context") + 1])
    row.detail = (f"{s['params'] / 1e9:.3f} B params, {s['tokens_per_step']} tokens/step: "
                  f"{step_s:.4f} s/step")
    if hw is None:
        row.detail += f"; {said}"
        return row
    cfg = _model_config(ModelConfig, flags, s)
    pred = predict_step(cfg, ParallelPlan(), hw, s["tokens_per_step"], seq, engine_name=ENGINE)
    mfu = pred.model_flops / (step_s * hw.peak_flops)
    row.detail += (f", MFU {100 * mfu:.1f}% of {hw.peak_flops / 1e12:.0f} TF; predicted "
                   f"{pred.step_s:.4f} s ({100 * (pred.step_s / step_s - 1):+.1f}%), MFU "
                   f"{100 * pred.mfu:.1f}% ({ENGINE}; {said})")
    return row


def _model_config(cls, flags: list[str], summary: dict):
    """The ModelConfig the run trained, from its flags (the vocabulary: bytes)."""
    from paratrain.config import flag_for

    names = ("n_layers", "d_model", "n_heads", "d_ff", "context")
    cfg = cls(**{n: int(flags[flags.index(flag_for(n)) + 1]) for n in names})
    if summary["params"] != _params(cfg):
        raise Failed(f"priced {_params(cfg)} parameters, the run trained {summary['params']}")
    return cfg


def _params(cfg) -> int:
    from paratrain.cost.shapes import as_shape

    return as_shape(cfg).num_params()


def run_part(ctx: Ctx, part: str, jobs: list, rows: list[Row]) -> None:
    """One part: its deadline, then each job ``fn(ctx, row)`` fills its row; a run that
    fails or finds no time left is the row's result."""
    ctx.deadline = ctx.budget.start(part)
    for row, fn in jobs:
        t0 = time.monotonic()
        try:
            fn(ctx, row)
        except Failed as e:
            row.result = f"FAILED: {e}"
        except Skipped:
            row.result = "skipped: time budget"
        row.seconds = time.monotonic() - t0
        rows.append(row)


def jobs(a: argparse.Namespace, sizes: Sizes) -> dict[str, list]:
    """Each part's (row, job) pairs: the rows exist before the runs, so a failure or a
    skip still says what was checked and on what."""
    dev = a.device
    curve = Row("curve", "bf16 loss curve, default model", f"{dev} bf16 vs cpu float32")
    parity = [(Row("parity", f"parity {name}", layout_tensors(dev, n, p2p)),
               lambda ctx, row, n=n, f=f, moe=moe, p2p=p2p: check_layout(ctx, row, n, f, moe,
                                                                         p2p))
              for name, n, f, moe, p2p in LAYOUTS]
    step = Row("step", big_label(sizes), dev)
    return {"curve": [(curve, check_curve)], "parity": parity,
            "step": [(step, lambda ctx, row: check_step(ctx, row, a.hardware))]}


def format_table(rows: list[Row]) -> str:
    head = ("part", "check", "tensors", "result", "s", "detail")
    cells = [head] + [(r.part, r.check, r.tensors, r.result, f"{r.seconds:.0f}", r.detail)
                      for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head) - 1)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(widths))) + "  " + c[-1]
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
    ap.add_argument("--keep", default=None, help="keep the run directories here")
    return ap.parse_args(argv)


def check_args(a: argparse.Namespace) -> list[str]:
    """The parts to run; ValueError (one line) for bad input."""
    if not a.budget_s > 0:
        raise ValueError(f"--budget-s {a.budget_s:g}: must be a positive number of seconds")
    chosen = [p.strip() for p in a.parts.split(",") if p.strip()]
    bad = [p for p in chosen if p not in WEIGHTS]
    if bad or not chosen:
        raise ValueError(f"--parts {a.parts!r}: choose from {', '.join(WEIGHTS)}")
    if a.hardware:
        from paratrain.cost.hardware import load_hardware

        try:
            load_hardware(a.hardware)
        except ValueError as e:  # the catalogue's own line names the keys
            raise ValueError(f"--hardware {a.hardware!r}: {e}") from None
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("no CUDA device is visible (torch.cuda.is_available() is False);"
                             " run this on a machine with a GPU, or pass --device cpu --tiny "
                             "to run the same code paths on CPU")
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
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as tmp:
        work = Path(a.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        sizes = TINY if a.tiny else FULL
        ctx = Ctx(a.device, sizes, work, budget)
        todo = jobs(a, sizes)
        for p in chosen:
            run_part(ctx, p, todo[p], rows)
            print(f"{p}: done", flush=True)
    print(format_table(rows))
    return 1 if any(r.result.startswith("FAILED") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
