"""`paratrain train`: settings from defaults <- TOML (--config) <- flags, then run.

``--nproc 1`` trains in this process. ``--nproc N`` validates everything here, writes the
resolved settings to ``RUN_DIR/run.json`` and hands over to torchrun's own launcher
(``python -m torch.distributed.run --standalone --nproc-per-node N``), whose workers run
:mod:`paratrain.run.worker`. Running ``torchrun ... -m paratrain.cli train ...`` directly
works too: the command sees torchrun's environment and joins the group itself.

No torch import at module level (the CLI must start instantly for `paratrain plan`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import time
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand

from paratrain.cli.settings import DEFAULT_NPROC, PANELS, resolve, with_settings
from paratrain.config import ModelConfig, TrainConfig
from paratrain.files.prepare import claim_checkpoint_dir, settle_vocab
from paratrain.plan import ParallelPlan
from paratrain.run import launcher, shutdown

Opt = typer.Option


# ---- checks before anything is launched -------------------------------------------------
def check_data(path: str) -> None:
    """``--data`` exists, is a regular file or a folder of them, can be read, holds bytes."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data path {path!r} does not exist; pass an existing file or folder "
                         "to --data, or omit it to use the standard library")
    try:
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        if p.is_dir():
            os.listdir(p)
    except OSError as e:
        raise ValueError(f"data folder {path!r} cannot be read ({e.strerror}); pass a "
                         "readable --data") from None
    size = 0
    for f in files:
        mode = f.stat().st_mode
        if not stat.S_ISREG(mode):  # a FIFO would block the read; a device never ends
            raise ValueError(f"data path {str(f)!r} is not a regular file or folder; pass a "
                             "text file or folder to --data")
        try:
            with f.open("rb") as fh:
                fh.read(1)
        except OSError as e:
            raise ValueError(f"data file {str(f)!r} cannot be read ({e.strerror}); pass a "
                             "readable --data") from None
        size += f.stat().st_size
    if size == 0:
        raise ValueError(f"data path {path!r} holds no text; point --data at a non-empty "
                         "text file or folder")


def check_output_dir(flag: str, path: str) -> None:
    """``path`` is, or can be created as, a writable directory (checked, not created)."""
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path!r} is a file, not a directory; pass a directory path")
    a = p
    while not a.exists():
        a = a.parent
    if not a.is_dir():
        raise ValueError(f"{flag} {path!r} cannot be created: {str(a)!r} is a file, not a "
                         "directory; pass another path")
    if not os.access(a, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r} is not writable ({str(a)!r}); pass a writable path")


def check_resume(checkpoint_dir: str, mcfg: ModelConfig, tcfg: TrainConfig,
                 plan: ParallelPlan) -> None:
    """The newest intact checkpoint exists, is below ``--steps`` and was trained with the
    same trajectory settings and data (the workers check again; any layout may resume)."""
    from paratrain.files import checkpoint
    from paratrain.files.batches import read_corpus

    meta = checkpoint.peek(checkpoint_dir)
    if meta is None and checkpoint.steps(checkpoint_dir):
        raise ValueError(f"no intact checkpoint in {checkpoint_dir!r} (every step failed "
                         "verification); start again without --resume")
    if meta is None:
        raise ValueError(f"no checkpoint found in {checkpoint_dir!r}; run without --resume "
                         "first, or point --checkpoint-dir at a directory that has one")
    if meta.get("step", 0) >= tcfg.steps:
        raise ValueError(f"the checkpoint in {checkpoint_dir!r} is at step {meta.get('step')} "
                         f"but --steps is {tcfg.steps}; pass --steps above {meta.get('step')} "
                         "to train further")
    text = read_corpus(tcfg.data, tcfg.text_field)
    want = checkpoint.run_settings(mcfg, tcfg, plan, checkpoint.data_sha256(text))
    checkpoint.check_settings(meta, want, checkpoint.step_dir(checkpoint_dir, meta["step"]))
    checkpoint.check_residual_layout(meta, plan, checkpoint.step_dir(checkpoint_dir,
                                                                   meta["step"]))


FLOAT_MAX = {"float32": 3.4028234663852886e38, "bfloat16": 3.3895313892515355e38,
             "float64": 1.7976931348623157e308}


def check_lr(tcfg: TrainConfig) -> None:
    """A learning rate the parameters' dtype can hold (1e300 is finite as a Python float
    but infinite in float32: the first step would turn every weight into inf or NaN)."""
    top = FLOAT_MAX.get(tcfg.dtype, FLOAT_MAX["float64"])
    if not math.isfinite(tcfg.lr) or tcfg.lr > top:
        raise ValueError(f"--lr {tcfg.lr:g} does not fit in {tcfg.dtype} (largest "
                         f"{top:.3g}); pass a learning rate such as --lr 3e-3")


def _has_checkpoint(checkpoint_dir: str) -> bool:
    from paratrain.files import checkpoint

    return checkpoint.peek(checkpoint_dir) is not None


def new_run_dir() -> str:
    """runs/<time>-<pid>[-k]: created here, so two runs never share one."""
    base = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for k in range(1000):
        p = base if k == 0 else base.with_name(f"{base.name}-{k}")
        try:
            p.mkdir(parents=True)
            return str(p)
        except FileExistsError:
            continue
        except OSError as e:
            raise ValueError(f"cannot create the run directory {str(p)!r} ({e.strerror}); "
                             "pass a writable --run-dir") from None
    raise ValueError(f"cannot create a fresh run directory beside {str(base)!r}; pass --run-dir")


def _world(nproc: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None,
           simulate_workers: int, in_torchrun: bool) -> tuple[int, int]:
    """(processes on this node, world size); under torchrun, torchrun's."""
    if in_torchrun:
        nproc = int(os.environ["WORLD_SIZE"])
    if nproc < 1:
        raise ValueError(f"--nproc {nproc} must be >= 1")
    launcher.check_endpoint(rdzv_endpoint, nnodes, node_rank)
    if simulate_workers < 1:
        raise ValueError(f"--simulate-workers {simulate_workers} must be >= 1")
    return nproc, (nproc if in_torchrun else nproc * nnodes)


def _check_run_options(resume: bool, resume_mode: str | None, keep_checkpoints: int,
                       max_restarts: int, timeout: float, grace: float,
                       checkpoint_dir: str | None) -> str | None:
    """The launch options that are no settings; returns the resume mode (None, "yes" or
    "auto")."""
    if resume_mode is not None and (resume_mode != "auto" or not resume):
        raise ValueError(f"unexpected argument {resume_mode!r}; pass --resume (the "
                         "checkpoint must exist) or --resume auto (if it exists)")
    for flag, v in (("--keep-checkpoints", keep_checkpoints), ("--max-restarts", max_restarts)):
        if v < 0:
            raise ValueError(f"{flag} {v} must be >= 0")
    for flag, v in (("--timeout", timeout), ("--grace", grace)):
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{flag} {v} must be a positive number of seconds")
    if resume and not checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir DIR to resume from")
    return ("auto" if resume_mode else "yes") if resume else None


def _check_dirs(run_dir: str | None, checkpoint_dir: str | None, resume: str | None,
                lead: bool) -> None:
    if run_dir is not None:
        check_output_dir("--run-dir", run_dir)
        if lead and not resume and Path(run_dir).is_dir() and any(Path(run_dir).iterdir()):
            raise ValueError(f"--run-dir {run_dir!r} already holds files (an earlier run?); "
                             "pass a new or empty directory, omit --run-dir for a fresh "
                             "one, or add --resume to continue into it")
    if checkpoint_dir is not None:
        check_output_dir("--checkpoint-dir", checkpoint_dir)


def _run_dir(run_dir: str | None, in_torchrun: bool) -> str:
    if run_dir is not None:
        return run_dir
    if in_torchrun:  # every rank must name the same directory: torchrun's run id
        rid = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        rid = rid if rid != "none" else os.environ.get("MASTER_PORT", "0")
        return str(Path("runs") / f"torchrun-{rid}")
    return new_run_dir()


def _start(spec: dict, in_torchrun: bool, world: int, nproc: int, launch: dict) -> None:
    """Run ``spec`` here (torchrun's worker, or one process), or hand it to torchrun."""
    run_dir = spec["opts"]["run_dir"]
    if in_torchrun:
        from paratrain.run.worker import run_worker

        run_worker(spec)  # ends the process
    if world == 1 and not launch["max_restarts"]:
        from paratrain.run.worker import run_local

        try:
            run_local(spec)
        except shutdown.Stopped as e:
            print(e, flush=True)
            raise typer.Exit(e.exit_code) from None
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    spec_path = Path(run_dir) / "run.json"
    spec_path.write_text(json.dumps({**spec, "failure_file": True}, indent=1))
    cmd = launcher.torchrun_command(nproc, str(spec_path), launch["nnodes"],
                                    launch["node_rank"], launch["rdzv_endpoint"],
                                    launch["max_restarts"])
    if not spec["opts"]["quiet"]:
        print(f"launching {nproc} of {world} workers: {' '.join(cmd[1:])}", flush=True)
    rc = launcher.launch(cmd, run_dir, launch["grace"])
    if rc != 0:
        raise typer.Exit(rc)


def _auto_plan(mode: str | None, max_memory_gb: float | None, mcfg, tcfg, world: int,
               config: str | None, flags: dict, in_torchrun: bool, nnodes: int,
               simulate_workers: int):
    """`--plan auto`: the search's winner on this machine (paratrain/run/auto_plan.py)."""
    if mode != "auto":
        raise ValueError(f"--plan {mode}: the one planner is 'auto' (--plan auto); "
                         "or give the layout with --dp/--tp/--pp/... instead"
                         if mode else "--max-memory-gb goes with --plan auto; add it")
    if in_torchrun or nnodes > 1 or simulate_workers > 1:
        raise ValueError("--plan auto plans the processes of one `paratrain train --nproc "
                         "N` launch; run it without torchrun, --nnodes or --simulate-workers")
    from paratrain.cli.plan_machine import fixed_plan_fields
    from paratrain.run.auto_plan import choose

    return choose(mcfg, tcfg, world, fixed_plan_fields(config, flags.get("plan", {})),
                  max_memory_gb)


def _opt(panel: str, help: str, *decls: str):
    """An option of ``panel`` (cli/settings.py PANELS; its help then ends in its default,
    the one its sentence names or the parameter's)."""
    return Opt(*decls, help=help, rich_help_panel=PANELS[panel])


RESUME_HELP = ("Continue from the newest checkpoint in --checkpoint-dir, which must hold "
               "one. Written '--resume auto': continue if it holds one, else start fresh "
               "(what a restart loop wants).")


def train(
    config: Annotated[str | None, Opt(help="TOML with \\[model] \\[train] \\[plan] "
                                           "tables. A panel's title below names its "
                                           "table; a flag overrides the file.")] = None,
    nproc: Annotated[int, _opt("launch", "Worker processes (torchrun).")] = DEFAULT_NPROC,
    simulate_workers: Annotated[int, _opt("launch", "W simulated workers in one "
                                                    "process.")] = 1,
    nnodes: Annotated[int, _opt("launch", "Nodes (one launcher per node).")] = 1,
    node_rank: Annotated[int, _opt("launch", "This node's index, 0..nnodes-1.")] = 0,
    rdzv_endpoint: Annotated[str | None, _opt("launch", "HOST:PORT of the c10d rendezvous "
                                                        "(multi-node).")] = None,
    checkpoint_dir: Annotated[str | None, _opt("checkpoints", "Checkpoint directory "
                                                              "(default: none, no "
                                                              "checkpoints).")
                              ] = None,
    resume: Annotated[bool, _opt("checkpoints", RESUME_HELP, "--resume")] = False,
    resume_mode: Annotated[str | None, typer.Argument(
        hidden=True, help="'auto' after --resume.")] = None,
    keep_checkpoints: Annotated[int, _opt("checkpoints", "Keep the newest K checkpoints "
                                                         "(0 = all).")] = 0,
    max_restarts: Annotated[int, _opt("checkpoints", "Elastic restarts of failed workers "
                                                     "(torchrun).")] = 0,
    timeout: Annotated[float, _opt("checkpoints", "Seconds a collective may wait for its "
                                                  "peers.")] = 120.0,
    grace: Annotated[float, _opt("checkpoints", "Seconds a signalled run has to "
                                                "checkpoint before SIGKILL.")] = 7.0,
    run_dir: Annotated[str | None, _opt("output", "Metrics directory, new or empty unless "
                                                  "--resume (default: a fresh "
                                                  "runs/<time>-<pid>).")] = None,
    quiet: Annotated[bool, _opt("output", "No progress bar or summary table.",
                                "--quiet")] = False,
    tensorboard: Annotated[str | None, _opt("output", "Also write TensorBoard event files "
                                                      "here (rank 0).")] = None,
    plan_mode: Annotated[str | None, _opt("layout", "'auto': rank every layout on this "
                                          "machine's profile (calibrated first if "
                                          "missing), print the top 5, train the winner; "
                                          "layout flags given fix their axes.",
                                          "--plan")] = None,
    max_memory_gb: Annotated[float | None, _opt("layout", "With --plan auto: leave out "
                                                "layouts over this memory per rank "
                                                "(GB).")] = None,
    init_from: Annotated[str | None, _opt("model", "Start from this Hugging Face "
                                          "folder (Llama, Mistral, Qwen2/3, Mixtral, "
                                          "Qwen2/3-MoE, Phi-3/4): its config.json sets "
                                          "the model (docs/export.md, Import).")] = None,
    flags: dict | None = None,
) -> None:
    """Train the decoder LM (default: 2 workers, data parallel, stdlib corpus)."""
    in_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    nproc, world = _world(nproc, nnodes, node_rank, rdzv_endpoint, simulate_workers,
                          in_torchrun)
    flags = flags or {}
    mcfg, tcfg, plan = resolve(config, {} if init_from else flags.get("model", {}),
                               flags.get("train", {}), flags.get("plan", {}), world)
    if init_from is not None:  # config.json sets the model (paratrain/files/hf_import.py)
        from paratrain.files import hf_import

        mcfg, tcfg = hf_import.settle(init_from, mcfg, tcfg, config, flags)
    if plan_mode is not None or max_memory_gb is not None:
        plan = _auto_plan(plan_mode, max_memory_gb, mcfg, tcfg, world, config, flags,
                          in_torchrun, nnodes, simulate_workers)
    plan.check_run(mcfg, world, tcfg.global_batch)
    if simulate_workers > 1 and world > 1:
        raise ValueError("--simulate-workers runs in one process; add --nproc 1")
    if tcfg.data is not None:
        check_data(tcfg.data)
    resume_as = _check_run_options(resume, resume_mode, keep_checkpoints, max_restarts,
                                   timeout, grace, checkpoint_dir)
    check_lr(tcfg)
    launcher.check_memory(mcfg, tcfg, plan, 1 if in_torchrun else nproc)
    lead = not in_torchrun or os.environ.get("RANK") == "0"  # checks once
    _check_dirs(run_dir, checkpoint_dir, resume_as, lead)
    with claim_checkpoint_dir(checkpoint_dir, resume_as, tcfg.checkpoint_every,
                              lead and node_rank == 0):  # held for the run's life
        fixed = None if init_from is None else str(Path(init_from) / "config.json")  # vocab
        mcfg = settle_vocab(mcfg, tcfg, config, fixed)  # slow, so late: BPE trained, ids cached
        plan.check(mcfg, world, tcfg.global_batch)  # again: the vocabulary may have changed
        if lead and (resume_as == "yes"
                     or (resume_as == "auto" and _has_checkpoint(checkpoint_dir))):
            check_resume(checkpoint_dir, mcfg, tcfg, plan)
        spec = {"model": dataclasses.asdict(mcfg), "train": dataclasses.asdict(tcfg),
                "plan": dataclasses.asdict(plan),
                "opts": dict(run_dir=_run_dir(run_dir, in_torchrun), checkpoint_dir=checkpoint_dir,
                             resume={"yes": True, "auto": "auto"}.get(resume_as, False),
                             keep_checkpoints=keep_checkpoints,
                             simulate_workers=simulate_workers, quiet=quiet,
                             tensorboard=tensorboard, init_from=init_from),
                "timeout_s": timeout}
        _start(spec, in_torchrun, world, nproc,
               dict(nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                    max_restarts=max_restarts, grace=grace))


class TrainCommand(TyperCommand):
    """`train`'s usage line without its hidden argument (the ``auto`` of ``--resume
    auto``, which --resume's help explains)."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        return [self.options_metavar] + [x for p in self.get_params(ctx)
                                         if not getattr(p, "hidden", False)
                                         for x in p.get_usage_pieces(ctx)]


def register(app: typer.Typer) -> None:
    """`paratrain train`: its launch options above, and one generated flag per setting of
    [model], [train] and [plan] (paratrain/cli/settings.py)."""
    app.command("train", cls=TrainCommand)(
        with_settings(train, {"model": None, "train": None, "plan": None}))
