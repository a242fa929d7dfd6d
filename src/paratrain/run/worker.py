"""A training worker: joins the group torchrun describes, trains, reports, exits cleanly.

``python -m paratrain.run.worker RUN_DIR/run.json`` is what ``paratrain train --nproc N``
hands to torchrun. The spec is the fully resolved settings written by the CLI.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

from paratrain.config import ModelConfig, TrainConfig
from paratrain.plan import ParallelPlan
from paratrain.run import shutdown


def _parse(spec: dict):
    from paratrain.run.loop import RunOptions

    return (ModelConfig(**spec["model"]), TrainConfig(**spec["train"]),
            ParallelPlan(**spec["plan"]), RunOptions(**spec["opts"]))


def print_summary(s: dict, run_dir: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from paratrain.run.summary import format_comm, mean_label

    t = Table(title="paratrain run", show_header=False)
    mean = mean_label(s)
    plan = s["plan"]
    layout = ", ".join(f"{k}={plan[k]}" for k in ("dp", "tp", "pp", "zero") if k in plan)
    if plan.get("cp", 1) > 1:
        layout += f", cp={plan['cp']} ({plan.get('cp_algorithm', 'ring')})"
    if plan.get("ep", 1) > 1:
        layout += f", ep={plan['ep']}"
    if plan.get("dp_replicate", 1) > 1:
        layout += f", dp_replicate={plan['dp_replicate']} (HSDP)"
    rows = [
        ("processes / plan", f"{s['world_size']} / {layout}"),
        ("parameters", f"{s['params']:,}"),
        ("tokens per step", f"{s['tokens_per_step']:,}"),
        ("final train loss", f"{s['final_loss']:.6f}"),
        ("validation loss", f"{s['val_loss']:.6f}  ({s.get('val_bpb', float('nan')):.4f} "
                            f"bits/byte, tokenizer {s.get('tokenizer', 'bytes')})"),
        ("unigram baseline", f"{s['unigram_entropy']:.6f}  (context-free model, nats/token)"),
        ("tokens/s", f"{s['tokens_per_s']:,.0f}  ({mean})"),
        ("MFU", f"{100 * s['mfu']:.1f}%  ({mean}) of {s['peak_flops_per_rank'] / 1e9:.1f} "
                "GFLOP/s per rank, the matmul peak measured before training"),
        ("s/step (compute + dp wait)",
         f"{s['step_s']:.4f}  ({s['compute_s_per_step']:.4f} + {s['comm_s_per_step']:.4f}; "
         f"{mean})"),
        ("dp payload per rank/step", f"{s['payload_bytes_per_step'] / 1e6:.4f} MB of "
                                     "gradients reduced (last step)"),
        *format_comm(s),  # every axis: bytes and time, beside the prediction
    ]
    from paratrain.predict import summary_row

    rows.append(summary_row(s.get("prediction")))  # the systems model beside the measurement
    for k, v in rows:
        t.add_row(k, v)
    Console().print(t)
    if run_dir:
        print(f"metrics: {run_dir}/metrics.jsonl  summary: {run_dir}/summary.json  "
              f"plots: paratrain report {run_dir}")


def run_local(spec: dict) -> dict:
    """One process, no process group (``--nproc 1``). SIGTERM / SIGINT stop it after the
    current step (with a checkpoint); :class:`paratrain.run.shutdown.Stopped` is raised."""
    from paratrain.run.loop import train

    mcfg, tcfg, plan, opts = _parse(spec)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    old = shutdown.install(escalate=True)
    try:
        summary = train(mcfg, tcfg, plan, opts, device)
    finally:
        shutdown.uninstall(old)
    if not opts.quiet:
        print_summary(summary, opts.run_dir)
    return summary


def _restarts_left() -> int:
    """How many more times torchrun's elastic agent will restart the workers."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - \
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _no_restart_left() -> str:
    """The advice when a peer is lost and torchrun restarts no more: fitted to the
    restarts this run was given (which were all spent when there were any)."""
    given = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if given == 0:
        return "pass --max-restarts 1 --resume auto to survive a lost worker"
    return (f"a worker died again after all {given} restart(s) of --max-restarts {given}; "
            f"pass --max-restarts {given + 1} or more if the failures are transient, or "
            "find why the worker dies")


def _say_restart(opts) -> None:
    """After an elastic restart, one line naming the step the run resumes from (the
    newest intact checkpoint, as :func:`paratrain.files.checkpoint.load` will choose it)."""
    n = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if n == 0:
        return
    from paratrain.files import checkpoint

    meta = checkpoint.peek(opts.checkpoint_dir) if opts.resume and opts.checkpoint_dir \
        else None
    where = f"step {meta['step']}" if meta else "step 0 (no intact checkpoint)"
    print(f"warning: a worker died; restart {n} of "
          f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} resumes from {where}",
          file=sys.stderr, flush=True)


def run_worker(spec: dict) -> None:
    """Inside torchrun: init from env, train, print on rank 0, end via ``finish``."""
    from paratrain.parallel.process_groups import (
        DEFAULT_TIMEOUT_S,
        CollectiveTimeout,
        finish,
        init_from_env,
        is_peer_lost,
        is_timeout,
        peer_lost_message,
        timeout_error,
    )
    from paratrain.run.loop import train

    torch.set_num_threads(1)
    shutdown.install()
    if spec.get("failure_file"):  # under our launcher: never outlive torchrun
        shutdown.set_pdeathsig()
        if spec["opts"].get("run_dir"):  # the launcher's progress deadline reads it
            shutdown.start_heartbeat(spec["opts"]["run_dir"], int(os.environ["RANK"]))
    code, rank = 0, -1
    try:
        mcfg, tcfg, plan, opts = _parse(spec)
        rank, _, device = init_from_env(spec.get("timeout_s", DEFAULT_TIMEOUT_S))
        if rank == 0:
            _say_restart(opts)
        summary = train(mcfg, tcfg, plan, opts, device)
        if rank == 0 and not opts.quiet:
            print_summary(summary, opts.run_dir)
    except shutdown.Stopped as e:
        if rank == 0:
            print(e, flush=True)
        code = e.exit_code
    except (ValueError, FloatingPointError) as e:
        # Under `paratrain train --nproc N` the launcher prints the first rank's message
        # once; under torchrun directly every failing rank says it.
        if spec.get("failure_file") and spec["opts"].get("run_dir"):
            shutdown.write_failure(spec["opts"]["run_dir"], str(e))
        else:
            print(f"error: {e}", file=sys.stderr)
        code = 2
    except RuntimeError as e:
        # a restart may cure a hang or a dead peer (torchrun's agent restarts every
        # worker): a warning while restarts are left, the run's error when none is
        left = _restarts_left()
        if is_peer_lost(e):  # the survivor of a killed worker: one line, no traceback
            if left > 0:
                print(f"warning: rank {rank}: {peer_lost_message(e)}; exiting for torchrun "
                      "to restart the workers", file=sys.stderr)
            else:
                print(f"error: rank {rank}: {peer_lost_message(e)}; {_no_restart_left()}",
                      file=sys.stderr)
            finish(1)  # non-zero: the elastic agent counts it as a failure and restarts
        if not is_timeout(e):
            traceback.print_exc()
            finish(1)
        e = e if isinstance(e, CollectiveTimeout) else timeout_error(e)
        if left > 0:
            print(f"warning: {e}; torchrun restarts the workers", file=sys.stderr)
        elif spec.get("failure_file") and spec["opts"].get("run_dir"):
            shutdown.write_failure(spec["opts"]["run_dir"], str(e))
        else:
            print(f"error: {e}", file=sys.stderr)
        code = 2
    except Exception:
        traceback.print_exc()
        code = 1
    finish(code)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m paratrain.run.worker RUN_DIR/run.json "
                 "(written by paratrain train)")
    with open(sys.argv[1]) as f:
        run_worker(json.load(f))


if __name__ == "__main__":
    main()
