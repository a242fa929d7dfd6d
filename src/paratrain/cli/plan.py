"""`paratrain plan`.

Importing this module must not import torch or the systems model's heavier parts: the
commands import what they need inside their bodies. Bad names or layouts raise
``ValueError``; ``paratrain.cli.app.main`` prints it as one line and exits with code 2.

The systems model draws nothing itself (the dependency runs viz -> systems only): `plan`
returns a :class:`PlanOutput`, and :func:`register` wraps the command with a ``plotter``
that the top-level CLI passes in (:func:`paratrain.viz.plan_plots.write_plan_output`),
which writes the charts when ``--plot DIR`` is given.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NamedTuple

import typer

from paratrain.cli import plan_model
from paratrain.cli.plan_fp8 import fp8_options
from paratrain.cli.settings import DEFAULT_NPROC, read_tables, resolve, with_settings
from paratrain.config import ModelConfig, TrainConfig, build
from paratrain.plan import ParallelPlan, infer_dp

DEFAULT_TOKENS = 1_048_576


class PlanOutput(NamedTuple):
    """What `paratrain plan` priced, for a plotter: ``kind`` "report" (``data`` is
    :func:`paratrain.systems.report.build_report`'s dict) or "search" (``data`` is a
    :class:`paratrain.systems.search.SearchResult`), with a chart title."""

    kind: str
    data: Any
    title: str


Plotter = Callable[[PlanOutput, str], list[Path]]


CATALOGUE_CONTEXT = 4096  # a catalogue model's sequence length unless --context
# Old spellings of `paratrain plan`, kept for a release: each prints one warning line.
DEPRECATED_FLAGS = {"--seq-len": "--context"}
DEPRECATED_VALUES = {("attention", "flash"): "sdpa"}


def _warn(old: str, new: str) -> None:
    print(f"warning: {old} is deprecated; use {new}", file=sys.stderr)


# `paratrain plan`'s own options (the settings' flags are generated: cli/settings.py)
HELP = {
    "model": "Catalogue model name, a .toml/.json file or a Hugging Face folder (its "
             "config.json; default llama2-7b; not with --config, whose \\[model] is the "
             "model).",
    "config": "A run's TOML (\\[model] \\[train] \\[plan]): price the run `paratrain "
              "train --config` trains.",
    "hardware": "Catalogue accelerator or a .toml/.json file.",
    "gpus": "Number of GPUs (default 64; with --config the \\[plan]'s dp*tp*pp*cp, else "
            f"train's --nproc default {DEFAULT_NPROC}).",
    "tokens": "Global batch in tokens per optimizer step (with --config: global_batch * "
              "context).",
    "eta": "Matmul efficiency (default: the hardware's, 0.473 for H100).",
    "precision": "bf16-adam (16 B/param), fp32-adam or fp8-adam (bf16-adam's states, "
                 "linear inputs kept in FP8; --fp8's default) (default bf16-adam; with "
                 "--config from \\[train] dtype).",
    "json": "Print the numbers as JSON.",
    "plot": "Write memory and step-time PNGs to DIR (with --search: the Pareto front).",
    "search": "Search every layout that fits; rank by predicted step time.",
    "top": "With --search: how many layouts to show.",
    "engine": "Engine whose overlap and collectives the step model prices: megatron, nemo, "
              "megascale, deepspeed, fsdp, torchtitan or xla (default: megatron; nemo for "
              "--search); options as a runs table says them: 'torchtitan, torch.compile'.",
    "explain": "Show the step model's breakdown: compute per GEMM class, memory-bound "
               "work, each axis' exposed communication, bubble.",
    "reference": "Price with docs/design.md's reference model only (one eta, flat ring); "
                 "--search too.",
    "params": "Step-model parameters (default: the shipped data/fitted.toml).",
    "fp8": "Price the linear layers' GEMMs in FP8 (Transformer Engine's recipe: FP8 peak, "
           "operand casts; memory as bf16-adam). Needs hardware with an FP8 peak.",
    "fp8_scaling": "With --fp8: the scaling recipe, tensorwise (per-tensor scales, as "
                   "Transformer Engine and MXFP8; default), rowwise or rowwise_with_gw_hp "
                   "(torchao's row-scaled recipes: more casts, their own GEMM kernels).",
    "nproc": "With --search: rank the layouts of the run `paratrain train --nproc N` "
             "trains (same model, batch, --config) on THIS machine's calibrated profile.",
    "verify": "With --search --nproc N: train the top K layouts and K random ones for a "
              "few steps; print measured vs predicted and Kendall's tau.",
    "verify_steps": "Steps per verified layout (the first is warm-up).",
    "emit_config": "With --search: write the winner as a TOML for `paratrain train "
                   "--config FILE`.",
    "max_memory_gb": "With --search --nproc N: leave out layouts over this memory per rank.",
}
Opt = typer.Option


def plan(
    model: Annotated[str | None, Opt(help=HELP["model"])] = None,
    config: Annotated[str | None, Opt(help=HELP["config"])] = None,
    hardware: Annotated[str, Opt(help=HELP["hardware"])] = "h100",
    gpus: Annotated[int | None, Opt(help=HELP["gpus"])] = None,
    tokens: Annotated[int, Opt("--tokens", "--tokens-per-step",
                               help=HELP["tokens"])] = DEFAULT_TOKENS,
    seq_len: Annotated[int | None, Opt(hidden=True, help="Deprecated: --context.")] = None,
    eta: Annotated[float | None, Opt(help=HELP["eta"])] = None,
    precision: Annotated[str | None, Opt(help=HELP["precision"])] = None,
    json_out: Annotated[bool, Opt("--json", help=HELP["json"])] = False,
    plot: Annotated[str | None, Opt(help=HELP["plot"])] = None,
    search: Annotated[bool, Opt("--search", help=HELP["search"])] = False,
    top: Annotated[int, Opt(help=HELP["top"])] = 10,
    engine: Annotated[str | None, Opt(help=HELP["engine"])] = None,
    explain: Annotated[bool, Opt("--explain", help=HELP["explain"])] = False,
    reference: Annotated[bool, Opt("--reference", help=HELP["reference"])] = False,
    params: Annotated[str | None, Opt(help=HELP["params"])] = None,
    fp8: Annotated[bool, Opt("--fp8", help=HELP["fp8"])] = False,
    fp8_scaling: Annotated[str | None, Opt(help=HELP["fp8_scaling"])] = None,
    nproc: Annotated[int | None, Opt(help=HELP["nproc"])] = None,
    verify: Annotated[int, Opt(help=HELP["verify"])] = 0,
    verify_steps: Annotated[int, Opt(help=HELP["verify_steps"])] = 6,
    emit_config: Annotated[str | None, Opt(help=HELP["emit_config"])] = None,
    max_memory_gb: Annotated[float | None, Opt(help=HELP["max_memory_gb"])] = None,
    flags: dict | None = None,
) -> PlanOutput | None:
    """Price a parallel plan: memory per GPU, wire bytes, step time, MFU (no GPU needed).

    With no flags: docs/design.md's reference example, LLaMA 2 7B on 64 H100, with its
    figures from the reference model, and beside them the step model's prediction. With
    ``--config run.toml``: the run `paratrain train --config run.toml` trains, with the
    same flags (its per-rank bytes under "run" in ``--json``).
    """
    from paratrain.cost.activations import kernel
    from paratrain.cost.hardware import load_hardware

    flags = _undeprecate(flags or {"model": {}, "train": {}, "plan": {}}, seq_len)
    if nproc is not None or verify:
        return _search_this_machine(search, model, config, flags, nproc, top, verify,
                                    verify_steps, emit_config, max_memory_gb, json_out)
    if (emit_config or max_memory_gb is not None) and not search:
        raise ValueError("--emit-config and --max-memory-gb go with --search; add --search")
    if emit_config:
        from paratrain.files.run_toml import check_writable

        check_writable(emit_config)
    example = (model, config, gpus, hardware, eta, precision, tokens) == (
        None, None, None, "h100", None, None, DEFAULT_TOKENS) and not any(flags.values())
    m, p, gpus, tokens, seq, precision, run = _what(model, config, flags, gpus, tokens,
                                                    search, precision)
    attention = kernel(m.attention)
    hw = load_hardware(hardware)
    eng, step_params = _step_model(engine, search, reference, params)
    precision, fp8 = fp8_options(fp8, fp8_scaling, hw, reference, precision)
    if search and emit_config:
        from paratrain.cli.plan_machine import runtime_model

        runtime_model(m)  # refused before the search
    if search:
        out = _search(m, hw, gpus, tokens, seq, top, eta, json_out, plot, attention,
                      step_params, eng, fp8)
        if emit_config:
            from paratrain.cli.plan_machine import emit_cluster_winner

            emit_cluster_winner(emit_config, m, out.data.top[0].plan, tokens, seq, gpus,
                                hw.name, plan_model.hf_folder(model))
        return out
    rep = _report(m, hw, p, gpus, tokens, seq, eta, precision, attention, step_params, eng,
                  explain, fp8)
    if run is not None:
        rep["run"] = run_bytes(*run)
    from paratrain.cli.plan_render import print_report

    print_report(rep, json_out, example)
    return PlanOutput("report", rep, f"{m.name} on {gpus} x {hw.name}")


def _search_this_machine(search: bool, model: str | None, config: str | None, flags: dict,
                         nproc: int | None, top: int, verify: int, verify_steps: int,
                         emit_config: str | None, max_memory_gb: float | None,
                         json_out: bool) -> None:
    """`plan --search --nproc N [--verify K]`: paratrain/cli/plan_machine.py."""
    from paratrain.cli.plan_machine import search_machine

    if not search:
        raise ValueError("--nproc and --verify go with --search (they rank this machine's "
                         "layouts); add --search")
    if model is not None:
        raise ValueError(f"--model {model} names a catalogue model to price on GPUs; with "
                         "--nproc the model is the run's (its flags or --config); drop --model")
    if verify < 0:
        raise ValueError(f"--verify {verify}: give how many top layouts to run, e.g. 4")
    search_machine(config, flags, DEFAULT_NPROC if nproc is None else nproc, top, verify,
                   verify_steps, emit_config, max_memory_gb, json_out)
    return None


def _what(model: str | None, config: str | None, flags: dict, gpus: int | None,
          tokens: int, search: bool, precision: str | None):
    """(shape, plan, gpus, tokens, sequence, precision, run settings) to price: the run
    of ``--config`` (run settings: its (ModelConfig, TrainConfig, ParallelPlan)), or a
    catalogue model (run settings None; no plan with ``--search``)."""
    if config is not None and model is not None:
        raise ValueError(f"--model {model} and --config {config} both name a model; pass "
                         "one (the TOML's [model] table is the run's model)")
    if config is not None:
        run = _run_settings(config, flags, gpus)
        mcfg, tcfg, p = run
        precision = precision or ("bf16-adam" if tcfg.dtype == "bfloat16" else "fp32-adam")
        from paratrain.cost.shapes import as_shape  # the run's model as the model's shape

        return (as_shape(mcfg), p, p.world_size, tcfg.global_batch * mcfg.context,
                mcfg.context, precision, run)
    m, gpus = plan_model.model_shape(model, flags["model"]), 64 if gpus is None else gpus
    seq = flags["model"].get("context", CATALOGUE_CONTEXT)
    if "global_batch" in flags["train"]:
        tokens = flags["train"]["global_batch"] * seq
    if gpus < 1:
        raise ValueError(f"gpus={gpus} must be >= 1; pass e.g. --gpus 64")
    p = None if search else build(ParallelPlan, infer_dp(flags["plan"], gpus, "gpus"), "plan")
    return m, p, gpus, tokens, seq, precision or "bf16-adam", None


def _step_model(engine: str | None, search: bool, reference: bool, params: str | None):
    """(the engine the step model prices, read as a runs table's engine cell is; its
    fitted parameters, None: the reference model only)."""
    from paratrain.systems.overlap import DEFAULT_ENGINE, SEARCH_ENGINE
    from paratrain.systems.row_engine import engine_as_said

    eng = engine_as_said(engine or (SEARCH_ENGINE if search else DEFAULT_ENGINE))
    if reference:
        return eng, None
    from paratrain.systems.fitting import load_params

    return eng, load_params(params)


def _undeprecate(flags: dict, seq_len: int | None) -> dict:
    """``flags`` in today's names: --seq-len is --context, --attention flash is sdpa
    (one warning line each)."""
    flags = {t: dict(v) for t, v in flags.items()}
    if seq_len is not None:
        _warn("--seq-len", DEPRECATED_FLAGS["--seq-len"])
        flags["model"].setdefault("context", seq_len)
    for (name, old), new in DEPRECATED_VALUES.items():
        if flags["model"].get(name) == old:
            _warn(f"--{name} {old}", f"--{name} {new}")
            flags["model"][name] = new
    return flags


def _run_settings(config: str, flags: dict, gpus: int | None):
    """(ModelConfig, TrainConfig, ParallelPlan) of `paratrain train --config` with these
    flags: its resolution and validation (paratrain/cli/settings.py)."""
    if gpus is None:  # the world train would start: the [plan]'s product, else --nproc's
        pv = {**read_tables(config).get("plan", {}), **flags["plan"]}
        gpus = math.prod(pv.get(k, 1) for k in ("dp", "tp", "pp", "cp")) if "dp" in pv \
            else DEFAULT_NPROC
    mcfg, tcfg, p = resolve(config, flags["model"], flags["train"], flags["plan"], gpus,
                            "gpus")
    p.check(mcfg, gpus, tcfg.global_batch)
    return mcfg, tcfg, p


def run_bytes(mcfg: ModelConfig, tcfg: TrainConfig, p: ParallelPlan) -> dict:
    """What a run's summary measures, per rank, from the cost functions the run's
    prediction uses (:mod:`paratrain.cost.layout`): parameters, model-state bytes
    (params, grads, optimizer) and data-parallel wire bytes per step."""
    from paratrain.cost.layout import dp_wire_bytes, dp_wire_bytes_by_axis, state_bytes
    from paratrain.cost.shapes import as_shape

    ranks, shape = range(p.world_size), as_shape(mcfg)
    out = {"params": shape.num_params(), "active_params": shape.active_params(),
           "model_state_bytes_per_rank": [state_bytes(mcfg, p, tcfg.dtype, r,
                                                      tcfg.reduce_dtype) for r in ranks],
           "dp_wire_bytes_per_rank": [dp_wire_bytes(mcfg, p, tcfg.dtype, r,
                                                    tcfg.reduce_dtype) for r in ranks]}
    if p.dp_replicate > 1:  # HSDP: per sub-axis, as the run's dp report counts them
        out["dp_wire_bytes_by_axis_per_rank"] = [
            dp_wire_bytes_by_axis(mcfg, p, tcfg.dtype, r, tcfg.reduce_dtype) for r in ranks]
    return out


def _report(m, hw, p, gpus, tokens, seq, eta, precision, attention, step_params, eng,
            explain, fp8: bool | str = False) -> dict:
    """The reference model's report of plan ``p``, and the step model's prediction."""
    from paratrain.systems.report import build_report

    p.check(m, world_size=gpus)
    if p.ep > 1 and (not m.is_moe or m.experts % p.ep):
        raise ValueError(f"ep={p.ep} needs an MoE model whose experts it divides (model has "
                         f"{m.experts}); pass --experts 8 or a catalogue MoE model")
    rep = build_report(m, hw, p, tokens, seq, eta=eta, precision=precision,
                       attention=attention)
    if step_params is not None:
        from paratrain.systems.explain import explain_lines
        from paratrain.systems.step_model import predict_step

        bd = predict_step(m, p, hw, tokens, seq, step_params, eng, fp8=fp8)
        rep["predicted"] = {**bd.as_dict(), "fp8": fp8}
        if explain:
            rep["predicted"]["explain"] = explain_lines(bd)
    return rep


def _progress_line():
    """search()'s progress as one line on a terminal's stderr, rewritten in place."""
    def show(scored: int, fitting: int, best: float | None) -> None:
        lead = f", fastest so far {best:.3g} s" if best is not None else ""
        print(f"\rsearching: {scored:,} layouts scored, {fitting:,} fit{lead}", end="",
              file=sys.stderr, flush=True)
    return show


def _search(m, hw, gpus, tokens, seq_len, top, eta, json_out, plot, attention,
            step_params, engine, fp8: bool | str = False) -> PlanOutput:
    from paratrain.systems.search import candidate_record, explain, render_search, search

    if top < 1:
        raise ValueError(f"top={top} must be >= 1; pass e.g. --top 10")
    tty = sys.stderr.isatty()
    res = search(m, hw, gpus, tokens, seq_len, top=top, eta=eta, keep_points=bool(plot),
                 attention=attention, reference=step_params is None, params=step_params,
                 engine=engine, fp8=fp8, progress=_progress_line() if tty else None)
    if tty:  # clear the progress line
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    hw = hw if eta is None else hw.replace(eta=eta)
    lines = explain(res, m, hw)
    if json_out:
        import json

        print(json.dumps({"model": m.name, "hardware": hw.name, "gpus": gpus,
                          "tokens_per_step": tokens, "seq_len": seq_len, "fp8": fp8,
                          "scored": res.scored, "fitting": res.fitting,
                          "elapsed_s": res.elapsed_s, "layouts_per_s": res.layouts_per_s,
                          "top": [candidate_record(c) for c in res.top], "why": lines},
                         indent=2))
    else:
        fmt = ", FP8" if fp8 else ""
        render_search(res, lines, f"{m.name} on {gpus} x {hw.name}{fmt}, {tokens:,} "
                                  f"tokens/step, sequence {seq_len}: fastest layouts that fit")
    return PlanOutput("search", res, f"{m.name} on {gpus} x {hw.name}")


def with_plots(command: Callable[..., PlanOutput], plotter: Plotter) -> Callable[..., None]:
    """``command`` (same options, for typer) that then hands its result to ``plotter``
    when ``--plot DIR`` is given, printing each file written unless ``--json``."""
    @functools.wraps(command)
    def run(*args, **kwargs) -> None:
        plot = kwargs.get("plot")
        if plot and kwargs.get("nproc") is not None:
            raise ValueError("--plot draws cluster plans; drop it with --nproc")
        out = command(*args, **kwargs)
        if plot:
            for path in plotter(out, plot):
                if not kwargs.get("json_out"):
                    print(f"wrote {path}")

    return run


def _no_plotter(out: PlanOutput, out_dir: str) -> list[Path]:
    raise ValueError("--plot needs the plotting package; run through `paratrain plan`")


def register(app: typer.Typer, plotter: Plotter | None = None) -> None:
    """Add `paratrain plan` to the top-level app; ``plotter`` draws `plan --plot`
    (without one, ``--plot`` is refused)."""
    every = {"model": None, "train": None, "plan": None}
    app.command("plan")(with_plots(with_settings(plan, every), plotter or _no_plotter))
