"""`paratrain train`: settings from defaults <- TOML (--config) <- flags, then run.

``--nproc 1`` trains in this process. ``--nproc N`` validates everything here, writes the
resolved settings to ``RUN_DIR/run.json`` and hands over to torchrun's own launcher
(``python -m torch.distributed.run --standalone --nproc-per-node N``), whose workers run
:mod:`paratrain.worker`. Running ``torchrun ... -m paratrain.cli train ...`` directly
works too: the command sees torchrun's environment and joins the group itself.

No torch import at module level (the CLI must start instantly for `paratrain plan`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from paratrain.config import ModelConfig, TrainConfig, build, load_toml
from paratrain.plan import ParallelPlan

Opt = typer.Option


def _pick(values: dict) -> dict:
    return {k: v for k, v in values.items() if v is not None}


def resolve(config: str | None, model_flags: dict, train_flags: dict,
            plan_flags: dict, nproc: int) -> tuple[ModelConfig, TrainConfig, ParallelPlan]:
    """Defaults <- TOML tables <- explicit flags; validated, with dp inferred."""
    tables = load_toml(config) if config else {}
    mcfg = build(ModelConfig, {**tables.get("model", {}), **_pick(model_flags)}, "model")
    tcfg = build(TrainConfig, {**tables.get("train", {}), **_pick(train_flags)}, "train")
    pvals = {**tables.get("plan", {}), **_pick(plan_flags)}
    if "dp" not in pvals:
        denom = pvals.get("tp", 1) * pvals.get("pp", 1) * pvals.get("cp", 1)
        if nproc % denom:
            raise ValueError(f"--nproc {nproc} is not divisible by tp*pp*cp={denom}; "
                             f"use a multiple of {denom}")
        pvals["dp"] = nproc // denom
    plan = build(ParallelPlan, pvals, "plan")
    return mcfg, tcfg, plan


def register(app: typer.Typer) -> None:
    @app.command()
    def train(
        nproc: Annotated[int, Opt(help="Worker processes (torchrun).")] = 2,
        simulate_workers: Annotated[int, Opt(help="W simulated workers in one process.")] = 1,
        config: Annotated[str | None, Opt(help="TOML with [model] [train] [plan].")] = None,
        # model
        layers: Annotated[int | None, Opt(help="Transformer blocks.")] = None,
        d_model: Annotated[int | None, Opt(help="Model width.")] = None,
        heads: Annotated[int | None, Opt(help="Attention heads.")] = None,
        kv_heads: Annotated[int | None, Opt(help="KV heads (GQA).")] = None,
        d_ff: Annotated[int | None, Opt(help="SwiGLU hidden width.")] = None,
        context: Annotated[int | None, Opt(help="Sequence length.")] = None,
        tie_embeddings: Annotated[bool | None, Opt(help="Tie input/output embeddings.")] = None,
        attention: Annotated[str | None, Opt(help="sdpa (fused) | eager (keeps scores).")] = None,
        experts: Annotated[int | None, Opt(help="Routed experts per MoE MLP (0 = dense).")] = None,
        top_k: Annotated[int | None, Opt(help="Experts each token goes to.")] = None,
        moe_ffn: Annotated[int | None, Opt(help="Expert hidden width (default d_ff).")] = None,
        shared_experts: Annotated[int | None, Opt(help="Always-on shared experts.")] = None,
        moe_every: Annotated[int | None, Opt(help="Every L-th block's MLP is MoE.")] = None,
        aux_loss_coef: Annotated[float | None, Opt(help="Load-balancing loss weight.")] = None,
        capacity_factor: Annotated[float | None, Opt(help="Expert capacity (0 = dropless)."
                                                     )] = None,
        # training
        steps: Annotated[int | None, Opt(help="Optimizer steps.")] = None,
        global_batch: Annotated[int | None, Opt(help="Windows per step, all workers.")] = None,
        lr: Annotated[float | None, Opt(help="Peak learning rate.")] = None,
        warmup_steps: Annotated[int | None, Opt(help="Linear warm-up steps.")] = None,
        seed: Annotated[int | None, Opt(help="Seed of weights and batches.")] = None,
        dtype: Annotated[str | None, Opt(help="float32 | float64 | bfloat16.")] = None,
        reduce_dtype: Annotated[str | None, Opt(help="bf16 grads reduced in bfloat16|float32."
                                                )] = None,
        eval_every: Annotated[int | None, Opt(help="Validate every K steps.")] = None,
        data: Annotated[str | None, Opt(help="Text file or folder (default: stdlib).")] = None,
        run_dir: Annotated[str | None, Opt(help="Metrics dir (default runs/<time>).")] = None,
        checkpoint_dir: Annotated[str | None, Opt(help="Checkpoint directory.")] = None,
        checkpoint_every: Annotated[int | None, Opt(help="Checkpoint every K steps.")] = None,
        resume: Annotated[bool, Opt(help="Resume from --checkpoint-dir.")] = False,
        quiet: Annotated[bool, Opt(help="No progress bar or summary table.")] = False,
        # plan
        dp: Annotated[int | None, Opt(help="Data-parallel size (default nproc/(tp*pp*cp))."
                                      )] = None,
        tp: Annotated[int | None, Opt(help="Tensor-parallel size.")] = None,
        pp: Annotated[int | None, Opt(help="Pipeline stages.")] = None,
        sp: Annotated[bool | None, Opt(help="Sequence parallelism (needs tp>1).")] = None,
        cp: Annotated[int | None, Opt(help="Context-parallel size (sequence split).")] = None,
        cp_algorithm: Annotated[str | None, Opt(help="ring | all-to-all (Ulysses).")] = None,
        ep: Annotated[int | None, Opt(help="Expert-parallel size (divides dp).")] = None,
        zero: Annotated[int | None, Opt(help="ZeRO stage 0-3.")] = None,
        micro_batches: Annotated[int | None, Opt(help="Micro-batches / accumulation.")] = None,
        schedule: Annotated[str | None, Opt(help="gpipe|1f1b|interleaved|zb-h1.")] = None,
        virtual_stages: Annotated[int | None, Opt(help="Chunks per rank (interleaved).")] = None,
        recompute: Annotated[str | None, Opt(help="none|selective|full.")] = None,
        bucket_mb: Annotated[float | None, Opt(help="Gradient bucket size, MB.")] = None,
        overlap: Annotated[bool | None, Opt(help="Overlap grad sync with backward.")] = None,
        compress: Annotated[str | None, Opt(help="Gradient compression, e.g. topk:16.")] = None,
        collectives: Annotated[str | None, Opt(help="native | ours.")] = None,
    ) -> None:
        """Train the decoder LM (default: 2 workers, data parallel, stdlib corpus)."""
        in_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
        if in_torchrun:
            nproc = int(os.environ["WORLD_SIZE"])
        if nproc < 1:
            raise ValueError(f"--nproc {nproc} must be >= 1")
        if simulate_workers < 1:
            raise ValueError(f"--simulate-workers {simulate_workers} must be >= 1")
        mcfg, tcfg, plan = resolve(
            config,
            dict(n_layers=layers, d_model=d_model, n_heads=heads, n_kv_heads=kv_heads,
                 d_ff=d_ff, context=context, tie_embeddings=tie_embeddings,
                 attention=attention, experts=experts, top_k=top_k, moe_ffn=moe_ffn,
                 shared_experts=shared_experts, moe_every=moe_every,
                 aux_loss_coef=aux_loss_coef, capacity_factor=capacity_factor),
            dict(steps=steps, global_batch=global_batch, lr=lr, warmup_steps=warmup_steps,
                 seed=seed, dtype=dtype, reduce_dtype=reduce_dtype, eval_every=eval_every,
                 data=data,
                 checkpoint_every=checkpoint_every),
            dict(dp=dp, tp=tp, pp=pp, sp=sp, cp=cp, cp_algorithm=cp_algorithm, ep=ep, zero=zero,
                 micro_batches=micro_batches,
                 schedule=schedule, virtual_stages=virtual_stages, recompute=recompute,
                 bucket_mb=bucket_mb, overlap=overlap, compress=compress,
                 collectives=collectives),
            nproc)
        plan.check(mcfg, nproc, tcfg.global_batch)
        plan.check_runtime(mcfg)
        if simulate_workers > 1 and nproc > 1:
            raise ValueError("--simulate-workers runs in one process; add --nproc 1")
        if tcfg.data is not None and not Path(tcfg.data).exists():
            raise ValueError(f"data path {tcfg.data!r} does not exist; pass an existing file "
                             "or folder to --data, or omit it to use the standard library")
        if resume and not checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir DIR to resume from")
        run_dir = run_dir or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        spec = {"model": dataclasses.asdict(mcfg), "train": dataclasses.asdict(tcfg),
                "plan": dataclasses.asdict(plan),
                "opts": dict(run_dir=run_dir, checkpoint_dir=checkpoint_dir, resume=resume,
                             simulate_workers=simulate_workers, quiet=quiet)}
        if in_torchrun:
            from paratrain.worker import run_worker

            run_worker(spec)  # ends the process
        if nproc == 1:
            from paratrain.worker import run_local

            run_local(spec)
            return
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        spec_path = Path(run_dir) / "run.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "paratrain.worker", str(spec_path)]
        if not quiet:
            print(f"launching {nproc} workers: {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            raise typer.Exit(rc)
