"""What a run tells its user before and while it trains (rank 0, once each): where its
outputs go and where it resumed from, and the one warning when a step beats the peak.

Why one line per output: a newcomer's first question after ``paratrain train`` is
where things went; each line names the directory and how to look at it, and the resume
line names the checkpoint and the step, so a run that picked up an old checkpoint is
seen at once (docs/report.md).
"""

from __future__ import annotations

import sys

from paratrain.bench.peak import Peak
from paratrain.config import TrainConfig
from paratrain.files import checkpoint


def output_lines(opts, tcfg: TrainConfig, start: int) -> list[str]:
    """Where this run writes and where it resumed from, one line each (rank 0 prints
    them once, before the first step); ``opts``: the run's paratrain.run.loop.RunOptions,
    ``start``: the step it resumed at (0: a fresh start)."""
    lines = []
    if opts.run_dir:
        lines.append(f"run dir: {opts.run_dir} (metrics.jsonl, summary.json; plots: "
                     f"paratrain report {opts.run_dir})")
    if opts.checkpoint_dir:
        every = tcfg.checkpoint_every
        when = f"every {every} steps and at the end" if every else "at the end"
        keep = f"keep the newest {opts.keep_checkpoints}" if opts.keep_checkpoints \
            else "keep all"
        lines.append(f"checkpoints: {opts.checkpoint_dir} ({when}, {keep})")
    if opts.tensorboard:
        lines.append(f"tensorboard: {opts.tensorboard} (tensorboard --logdir "
                     f"{opts.tensorboard})")
    if start:
        lines.append(f"resumed from {checkpoint.step_dir(opts.checkpoint_dir, start)} "
                     f"(step {start} of {tcfg.steps})")
    elif opts.resume:
        lines.append(f"no checkpoint in {opts.checkpoint_dir} yet (--resume auto): "
                     "starting at step 0")
    return lines


def mfu_of_step(peak: Peak, achieved: float, step: int, rank: int, tally) -> float:
    """The step's MFU against the run's one peak; the first time a step beats the peak
    (measured under load), rank 0 says so once: the peak stays, MFU goes above 1."""
    mfu = peak.mfu(achieved)
    if mfu > 1 and not tally.above_peak:
        tally.above_peak = True
        if rank == 0:
            print(f"warning: step {step + 1} ran at {achieved / 1e9:.1f} GFLOP/s per rank, "
                  f"above the peak measured before training ({peak.flops / 1e9:.1f}); the "
                  "machine was busier then: MFU above 100% from here on", file=sys.stderr,
                  flush=True)
    return mfu
