"""`paratrain check-model`: run a grid of plans on this machine and print the systems
model's prediction beside each measurement (issue 7, "closing the loop").

No torch at import time: the command imports :mod:`paratrain.run.check_model`'s workers
inside its body, like every other command (`paratrain plan` must start instantly).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated

import typer

from paratrain.cli.settings import with_settings
from paratrain.config import ModelConfig, build

Opt = typer.Option


def check_model(
    plans: Annotated[str | None, Opt(help="Comma-separated grid plans (default: all; "
                                          "'mini' = dp2,dp2 zero1).")] = None,
    steps: Annotated[int, Opt(help="Steps per run; the first is warm-up.")] = 6,
    launches: Annotated[int, Opt(help="Times each plan is launched, in separate passes "
                                      "over the grid; its record is the median launch.")] = 3,
    profile: Annotated[str | None, Opt(help="Hardware profile (default: "
                                            "~/.cache/paratrain/hardware.toml).")] = None,
    fit: Annotated[bool, Opt(help="Fit eta and fixed costs first (saved beside the "
                                  "profile); --no-fit uses the saved fit.")] = True,
    as_json: Annotated[bool, Opt("--json", help="Print the records as JSON.")] = False,
    flags: dict | None = None,
) -> None:
    """Predicted vs measured step time, wire bytes and model-state memory per plan.

    The grid model is run/check_model.py's GRID_MODEL with the model flags given (the same
    flags as `paratrain train`'s).
    """
    from paratrain.run import check_model as cm

    flags = flags or {"model": {}, "train": {}}
    names = None
    if plans == "mini":
        names = list(cm.MINI)
    elif plans:
        names = [p.strip() for p in plans.split(",") if p.strip()]
    mcfg = build(ModelConfig, {**dataclasses.asdict(cm.GRID_MODEL), **flags["model"]}, "model")
    log = (lambda *a, **k: None) if as_json else print
    result = cm.run_grid(names, profile=profile, steps=steps, fit=fit, mcfg=mcfg,
                         launches=launches,
                         global_batch=flags["train"].get("global_batch", cm.GRID_BATCH),
                         data=flags["train"].get("data"), log=log)
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        print(cm.format_table(result))


def register(app: typer.Typer) -> None:
    """`paratrain check-model`: its own options, the model's flags and two of [train]'s,
    generated from the settings' fields (paratrain/cli/settings.py)."""
    app.command("check-model")(with_settings(
        check_model, {"model": None, "train": ("global_batch", "data")}))
