"""The training loop: one loop for every world size and every plan.

Reads top to bottom: set up -> (resume) -> for each step: batch, forward/backward,
reduce gradients, clip and step, log, evaluate, checkpoint -> summary.
Call :func:`train` in every worker after the process group exists (or with none, for
one process).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.bench.peak import measure_peak, memory_bytes
from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.shapes import as_shape
from paratrain.files import checkpoint
from paratrain.files.atomic import write_atomic
from paratrain.files.batches import Corpus, bits_per_byte
from paratrain.model import Decoder
from paratrain.parallel.api import build_engine
from paratrain.parallel.memory import ActivationMeter
from paratrain.parallel.optim import lr_at
from paratrain.parallel.precision import working_dtype
from paratrain.parallel.process_groups import at
from paratrain.plan import ParallelPlan
from paratrain.run import shutdown
from paratrain.run.moe_stats import moe_record, moe_stats
from paratrain.run.outputs import mfu_of_step, output_lines
from paratrain.run.save import save_checked
from paratrain.run.summary import (
    build_summary,
    comm_counters,
    report_summary,
    run_prediction,
    step_comm,
)


@dataclass(frozen=True)
class RunOptions:
    """Where a run writes and what it shows (not part of the numerics)."""

    run_dir: str | None = None
    checkpoint_dir: str | None = None
    resume: bool | str = False  # True: from --checkpoint-dir; "auto": if it has one
    keep_checkpoints: int = 0  # 0 = keep every step's checkpoint
    simulate_workers: int = 1
    quiet: bool = False
    measure_peak: bool = True
    stop_after: int | None = None  # end (and checkpoint) after this step, as if interrupted
    profile: str | None = None  # hardware profile for the prediction (default: calibrate's)
    tensorboard: str | None = None  # rank 0 also writes TensorBoard event files here
    init_from: str | None = None  # a Hugging Face folder the weights start from


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build_model(cfg: ModelConfig, tcfg: TrainConfig, device: torch.device,
                init_from: str | None = None) -> Decoder:
    """The same weights on every rank and in every mode: seeded construction on CPU, or
    the full weights of the Hugging Face folder ``init_from`` (every engine then takes
    its shards from this whole model, as from a fresh one)."""
    torch.manual_seed(tcfg.seed)
    model = Decoder(cfg)
    if init_from is not None:
        from paratrain.files import hf_import

        hf_import.load_into(model, init_from)
    return model.to(device=device, dtype=working_dtype(tcfg))


class _Log:
    """Rank 0's outputs: the JSONL of steps, the progress bar, the summary."""

    def __init__(self, run_dir: Path | None, active: bool, quiet: bool, total: int,
                 start: int = 0, tensorboard: str | None = None) -> None:
        self.active = active
        self.file = None
        self.tb = None
        if active and tensorboard:
            from paratrain.run.tensorboard import EventLog

            self.tb = EventLog(tensorboard)
        if active and run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            path = run_dir / "metrics.jsonl"
            keep = _records_before(path, start) if start else ""
            write_atomic(path, keep.encode())  # resumed: no duplicates
            self.file = path.open("a")
        self.progress = None
        if active and not quiet:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("step {task.completed}/{task.total}"),
                                     BarColumn(), TextColumn("{task.description}"),
                                     TimeRemainingColumn(), transient=False)
            self.task = self.progress.add_task("", total=total)
            self.progress.start()

    def step(self, rec: dict, advance_to: int, desc: str) -> None:
        if self.file is not None:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        if self.tb is not None:
            self.tb.step(rec)
        if self.progress is not None:
            self.progress.update(self.task, completed=advance_to, description=desc)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _records_before(path: Path, start: int) -> str:
    """The lines of a metrics file whose step is below ``start`` (a resumed run rewrites
    the steps after its checkpoint, so the file's steps stay strictly increasing)."""
    if not path.is_file():
        return ""
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < start:
                keep.append(line + "\n")
        except (ValueError, KeyError, TypeError):  # a torn last line from a killed run
            continue
    return "".join(keep)


def _stop_agreed(world: int, device: torch.device) -> int:
    """The stop signal every rank agrees on (max over ranks; 0 = go on). Only when the
    worker installed the handlers (library callers pay no extra collective)."""
    if not shutdown.installed():
        return 0
    sig = shutdown.requested()
    if world > 1:
        t = torch.tensor([sig], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        sig = int(t.item())
    return sig


def evaluate(engine, corpus: Corpus, tcfg: TrainConfig, ctx: int) -> float:
    """Mean validation loss per token over the fixed validation windows."""
    total = 0.0
    for x, y in corpus.val_batches(tcfg.eval_batches, tcfg.global_batch, ctx,
                                   engine.dp_rank, engine.dp_size):
        total += engine.eval_loss_sum(x, y)
    (total,) = engine.all_sum([total])
    return total / (tcfg.eval_batches * tcfg.global_batch * ctx)


def _setup(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan, opts: RunOptions,
           world: int, device: torch.device):
    """Checks, then the corpus, the model and the engine that runs ``plan``."""
    plan.check_run(mcfg, world, tcfg.global_batch)
    if opts.simulate_workers > 1:
        if world > 1:
            raise ValueError("--simulate-workers runs in one process; use it with --nproc 1")
        if tcfg.global_batch % opts.simulate_workers:
            raise ValueError(f"global batch {tcfg.global_batch} is not divisible by "
                             f"--simulate-workers {opts.simulate_workers}; use a multiple")
    corpus = Corpus.load(tcfg.data, tcfg.val_fraction, mcfg.context, tcfg.tokenizer,
                         tcfg.text_field)
    # the embedding must cover every id the data holds (an ASCII corpus under the bytes
    # tokenizer fits a vocabulary of 128; the tests' uneven 131-way splits rely on it)
    if corpus.max_id() >= mcfg.vocab_size:
        raise ValueError(f"vocab_size={mcfg.vocab_size} is smaller than the {corpus.vocab_size} "
                         f"tokens of --tokenizer {tcfg.tokenizer}; set vocab_size to "
                         f"{corpus.vocab_size} (paratrain train does)")
    model = build_model(mcfg, tcfg, device, opts.init_from)
    engine = build_engine(model, tcfg, plan, device, opts.simulate_workers)
    if _rank_world()[0] == 0 and not opts.quiet and hasattr(engine, "describe_layout"):
        print(engine.describe_layout(), flush=True)  # mesh / stages / buckets chosen
    return corpus, engine


def _resume(engine, corpus: Corpus, mcfg: ModelConfig, tcfg: TrainConfig,
            plan: ParallelPlan, opts: RunOptions, device: torch.device) -> tuple[int, dict]:
    """(first step, the checkpoint's settings record): 0 unless resuming."""
    start = 0
    meta = {"tokenizer": asdict(corpus.tokenizer.info),  # checked first on resume
            **checkpoint.run_settings(mcfg, tcfg, plan, corpus.text_sha256)} \
        if opts.checkpoint_dir else {}
    if opts.resume:
        if not opts.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir DIR to resume from")
        if opts.resume != "auto" or checkpoint.peek(opts.checkpoint_dir) is not None:
            start = checkpoint.load(opts.checkpoint_dir, engine, mcfg, plan, expect=meta,
                                    device=device)
        if start >= tcfg.steps:
            raise ValueError(f"the checkpoint in {opts.checkpoint_dir!r} is at step {start} "
                             f"but --steps is {tcfg.steps}; pass --steps above {start} to "
                             "train further")
    if opts.checkpoint_dir and _rank_world()[0] == 0:  # what generate and export decode with
        write_atomic(Path(opts.checkpoint_dir) / "tokenizer.json",
                                       corpus.tokenizer.json.encode())  # umask, not 0600
        if opts.init_from:  # and where they end a text: the folder's end of sequence
            from paratrain.files.inference import keep_eos

            keep_eos(opts.init_from, opts.checkpoint_dir)
    shutdown.beat(start)  # set up (and resumed): the launcher's progress deadline runs
    return start, meta


@dataclass
class _Tally:
    """What the steps leave for the summary."""

    losses: list = field(default_factory=list)
    times: list = field(default_factory=list)
    comms: list = field(default_factory=list)
    moe_steps: list = field(default_factory=list)
    payload: float = 0.0
    wire: float = 0.0
    ep_mark: int = 0
    val_loss: float = float("nan")
    first_step: int = 0  # this session's first step (0-based; > 0 when resumed)
    comm_steps: list = field(default_factory=list)  # per step: axis -> [bytes, seconds]
    above_peak: bool = False  # warned that a step beat the measured peak


def _train_step(engine, corpus: Corpus, mcfg: ModelConfig, tcfg: TrainConfig,
                plan: ParallelPlan, step: int, first_last: tuple[bool, bool],
                meter: ActivationMeter, tally: _Tally) -> dict:
    """One optimizer step: forward/backward over the micro-batches, gradient reduction,
    clip and update; returns the step's metrics record. Activations are watched on the
    first step's first micro-batch; model states are measured after the last step."""
    t0, c0 = time.perf_counter(), time.process_time()  # wall; this process's CPU
    counted = comm_counters(engine)
    tokens = tcfg.global_batch * mcfg.context
    micro = plan.micro_batches if plan.pp == 1 else 1  # the pipeline splits its own
    x, y = corpus.batch(tcfg.seed, step, tcfg.global_batch, mcfg.context,
                        engine.dp_rank, engine.dp_size)
    loss_sum = 0.0
    at("forward/backward (tp, pp, cp, ep exchanges)", "mesh", step)
    c_passes = time.process_time()
    for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro), strict=True)):
        with meter.watch(first_last[0] and i == 0):
            loss_sum += engine.forward_backward(xs, ys, tokens)
    c_passes = time.process_time() - c_passes
    at("gradient reduction", "dp")
    comm = engine.reduce_gradients()
    if first_last[1]:
        meter.snapshot(engine)  # grads, optimizer state and buffers all exist now
    at("loss all-reduce", "world")
    (loss_sum,) = engine.all_sum([loss_sum])
    moe = moe_stats(engine, mcfg.experts, plan) if mcfg.experts else None
    lr = lr_at(step, tcfg)
    at("gradient-norm all-reduce and optimizer step", "world, then dp")
    gnorm = engine.clip_and_step(lr)
    dt = time.perf_counter() - t0
    loss = loss_sum / tokens
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss became {loss} at step {step}; lower --lr")
    tally.losses.append(loss)
    tally.times.append(dt)
    tally.comms.append(comm.seconds)
    tally.payload, tally.wire = comm.payload_bytes, comm.wire_bytes
    tally.comm_steps.append(step_comm(engine, counted, comm))
    cpu = time.process_time() - c0
    rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": gnorm,
           "tokens_per_s": tokens / dt, "step_s": dt, "compute_s": dt - comm.seconds,
           "comm_s": comm.seconds, "cpu_s": cpu,
           # the batch, gradient reduction, loss sum and optimizer step: the CPU fit's
           # per-step cost, measured (paratrain.run.cpu_fit)
           "outside_passes_cpu_s": cpu - c_passes,
           "comm_by_axis": {k: {"wire_bytes": b, "s": t}
                            for k, (b, t) in tally.comm_steps[-1].items()}}
    if moe is not None:
        tally.moe_steps.append(moe_record(moe, mcfg, tcfg.global_batch, plan))
        ex = getattr(engine, "ep", None)
        if ex is not None:  # rank 0's token all-to-all bytes (fwd + bwd, with splits)
            tally.moe_steps[-1]["ep_wire_bytes"] = ex.wire_bytes - tally.ep_mark
            tally.ep_mark = ex.wire_bytes
        rec.update(tally.moe_steps[-1])
    return rec


def train(mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan | None = None,
          opts: RunOptions | None = None, device: torch.device | None = None) -> dict:
    """Train and return the summary (same on every rank; rank 0 also writes files)."""
    opts = opts or RunOptions()
    rank, world = _rank_world()
    plan = plan or ParallelPlan(dp=world)
    device = device or torch.device("cpu")
    corpus, engine = _setup(mcfg, tcfg, plan, opts, world, device)
    start, meta = _resume(engine, corpus, mcfg, tcfg, plan, opts, device)
    val_bytes = corpus.val_bytes(tcfg.eval_batches, tcfg.global_batch, mcfg.context)
    val_tokens = tcfg.eval_batches * tcfg.global_batch * mcfg.context
    run_dir = Path(opts.run_dir) if opts.run_dir else None
    at("peak measurement before training", "world")
    peak = measure_peak(working_dtype(tcfg), device, opts.measure_peak)  # collective
    if rank == 0 and not opts.quiet:
        print("\n".join(output_lines(opts, tcfg, start) + [peak.describe()]), flush=True)
    log = _Log(run_dir, rank == 0, opts.quiet, tcfg.steps, start, opts.tensorboard)
    tokens = tcfg.global_batch * mcfg.context
    model_flops = as_shape(mcfg).flops_per_token(mcfg.context) * tokens
    meter = ActivationMeter()  # bytes saved for backward, watched on the first micro-batch
    tally = _Tally(first_step=start)
    if log.progress is not None:
        log.progress.update(log.task, completed=start)
    end = tcfg.steps if opts.stop_after is None else min(tcfg.steps, opts.stop_after)
    for step in range(start, end):
        last = step == end - 1
        rec = _train_step(engine, corpus, mcfg, tcfg, plan, step, (step == start, last),
                          meter, tally)
        rec.update(mfu=mfu_of_step(peak, model_flops / rec["step_s"] / world, step, rank, tally),
                   peak_flops=peak.flops, mem_bytes=memory_bytes(device))
        if (tcfg.eval_every and (step + 1) % tcfg.eval_every == 0) or last:
            at("evaluation", "mesh")
            tally.val_loss = rec["val_loss"] = evaluate(engine, corpus, tcfg, mcfg.context)
            rec["val_bpb"] = bits_per_byte(tally.val_loss, val_tokens, val_bytes)
        log.step(rec, step + 1, f"last step: loss {rec['loss']:.4f} | "
                 f"{rec['tokens_per_s']:,.0f} tok/s | MFU {100 * rec['mfu']:.1f}%")
        _checkpoint_or_stop(engine, mcfg, tcfg, plan, opts, meta, step, last, world, device,
                            log)
    tb, log.tb = log.tb, None  # kept open for the summary's scalars
    log.close()
    summary = build_summary(engine, corpus, mcfg, tcfg, plan, world, tally, peak, meter,
                            val_tokens, val_bytes)
    summary["prediction"] = run_prediction(mcfg, tcfg, plan, world, summary, opts.profile,
                                           device)
    if tb is not None:
        tb.summary(summary, end)
        tb.close()
    report_summary(summary, rank, opts.quiet, run_dir)
    return summary



def _checkpoint_or_stop(engine, mcfg: ModelConfig, tcfg: TrainConfig, plan: ParallelPlan,
                        opts: RunOptions, meta: dict, step: int, last: bool,
                        world: int, device: torch.device, log: _Log) -> None:
    """Checkpoint every K steps, at the end, or when the ranks agree on a stop signal;
    then stop (:class:`paratrain.run.shutdown.Stopped`) unless this was the last step."""
    every = tcfg.checkpoint_every
    shutdown.beat(step + 1)  # step done: the launcher's progress deadline starts again
    at("stop-signal all-reduce", "world")
    sig = _stop_agreed(world, device)
    if opts.checkpoint_dir and ((every and (step + 1) % every == 0) or last or sig):
        at("checkpoint save", "world")
        save_checked(engine, mcfg, tcfg, plan, opts, meta, step + 1)
        shutdown.beat(step + 1)
    if sig and not last:
        log.close()
        raise shutdown.Stopped(sig, step + 1, str(checkpoint.step_dir(
            opts.checkpoint_dir, step + 1)) if opts.checkpoint_dir else None)

