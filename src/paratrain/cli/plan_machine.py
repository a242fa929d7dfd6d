"""`paratrain plan --search --nproc N [--verify K] [--emit-config FILE]`: search THIS machine.

With ``--nproc`` (or ``--verify``) `plan --search` ranks the layouts of the run `paratrain
train` would train — the same model, data-batch and ``--config`` settings, on N processes
— by the prediction for this machine's calibrated profile
(:func:`paratrain.run.auto_plan.search_here`, which calibrates first when there is no
profile), instead of a catalogue model on a GPU cluster. ``--verify K`` then runs the
top K and K random layouts and prints the verdict (:mod:`paratrain.run.verify`).
``--emit-config FILE`` writes the winner as a TOML `paratrain train --config FILE` runs
(:mod:`paratrain.files.run_toml`), in either mode.

Importing this module does not import torch.
"""

from __future__ import annotations

import json
from dataclasses import fields

from paratrain.cli.settings import resolve
from paratrain.plan import ParallelPlan

# ModelShape fields the runtime's model cannot express, with the value it builds
RUNTIME_SHAPE = {"mlp": "swiglu", "bias": False, "learned_positions": False,
                 "norms_per_layer": 2, "first_dense_layers": 0,
                 "kv_lora_rank": 0, "q_lora_rank": 0, "local_window": 0, "mtp_layers": 0,
                 "pad_to_capacity": False}


def fixed_plan_fields(config: str | None, plan_flags: dict) -> dict:
    """The plan fields the user set (``--config``'s [plan] table, then flags): the search
    keeps them and chooses the rest."""
    from paratrain.cli.settings import read_tables

    return {**read_tables(config).get("plan", {}), **plan_flags}


def search_machine(config: str | None, flags: dict, nproc: int, top: int, verify: int,
                   verify_steps: int, emit_config: str | None, max_memory_gb: float | None,
                   json_out: bool) -> None:
    """Rank this machine's layouts for the run; verify and emit as asked."""
    from paratrain.files.run_toml import check_writable, write_run_toml
    from paratrain.predict.layouts import bullets, format_top, why_the_winner_wins
    from paratrain.run.auto_plan import search_here

    if emit_config:
        check_writable(emit_config)
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: need at least 1 process")
    fixed = fixed_plan_fields(config, flags["plan"])
    plan_flags = {k: v for k, v in flags["plan"].items() if k != "dp"}
    mcfg, tcfg, _ = resolve(config, flags["model"], flags["train"], plan_flags, nproc)
    log = (lambda *a, **k: None) if json_out else print  # noqa: E731
    ranked = search_here(mcfg, tcfg, nproc, fixed, max_memory_gb, log=log)
    record = {"nproc": nproc, "valid_layouts": len(ranked),
              "top": [{"plan": _plan_dict(r.plan), "step_s": r.step_s,
                       "memory_bytes": r.memory_bytes} for r in ranked[:top]],
              "why": why_the_winner_wins(ranked)}
    if not json_out:
        print(f"{len(ranked)} valid layouts of {nproc} processes, ranked for this machine:")
        print(format_top(ranked, top))
        print("why the winner wins:")
        print(bullets(record["why"]))
    if verify:
        from paratrain.predict.machine import load_machine
        from paratrain.run.verify import format_verdict
        from paratrain.run.verify import verify as run_verify

        result = run_verify(mcfg, tcfg, ranked, nproc, verify, load_machine(), verify_steps,
                            log=log)
        record["verify"] = result
        if not json_out:
            print(format_verdict(result))
    if emit_config:
        path = write_run_toml(emit_config, mcfg, tcfg, ranked[0].plan,
                              f"paratrain plan --search --nproc {nproc}: the predicted "
                              f"winner on this machine\nrun: paratrain train --nproc "
                              f"{nproc} --config {emit_config}")
        record["emitted"] = str(path)
        log(f"wrote {path}: paratrain train --nproc {nproc} --config {path}")
    if json_out:
        print(json.dumps(record, indent=1))


def _plan_dict(plan: ParallelPlan) -> dict:
    return {f.name: getattr(plan, f.name) for f in fields(plan)}


def runtime_model(shape):
    """The ModelConfig paratrain's runtime builds for a catalogue ``shape`` (refused by
    name when the shape has a part the runtime's model does not build)."""
    from paratrain.config import ModelConfig

    odd = {k: getattr(shape, k) for k, v in RUNTIME_SHAPE.items()
           if getattr(shape, k, v) != v}
    if odd:
        raise ValueError(
            f"--emit-config: {shape.name} has "
            + ", ".join(f"{k} = {v!r}" for k, v in odd.items())
            + ", which paratrain's runtime model does not build; emit a LLaMA-style "
            "model (e.g. --model llama2-7b) or write the TOML by hand")
    return ModelConfig(**{f.name: getattr(shape, f.name) for f in fields(ModelConfig)})


def emit_cluster_winner(path: str, shape, plan: ParallelPlan, tokens: int, seq: int,
                        gpus: int, hw_name: str, init_from: str | None = None) -> None:
    """Write a cluster search's winner as a run TOML (``[train] global_batch`` = the
    step's sequences, ``[model] context`` = the sequence length); for a model read from
    a Hugging Face folder (``init_from``) the command it prints starts from its weights."""
    from paratrain.config import TrainConfig
    from paratrain.files.run_toml import write_run_toml

    mcfg = runtime_model(shape).replace(context=seq)
    start = f" --init-from {init_from}" if init_from else ""
    cmd = f"paratrain train --nproc {gpus}{start} --config {path}"
    write_run_toml(path, mcfg, TrainConfig(global_batch=tokens // seq), plan,
                   f"paratrain plan --search: the predicted winner for {shape.name} on "
                   f"{gpus} x {hw_name}\nrun: {cmd}")
    print(f"wrote {path}: {cmd}")
