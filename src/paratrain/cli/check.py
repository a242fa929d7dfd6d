"""`paratrain check-model`: run a grid of plans on this machine and print the systems
model's prediction beside each measurement (issue 7, "closing the loop").

No torch at import time: the command imports :mod:`paratrain.run.check_model`'s workers
inside its body, like every other command (`paratrain plan` must start instantly).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

Opt = typer.Option


def register(app: typer.Typer) -> None:
    @app.command("check-model")
    def check_model(
        plans: Annotated[str | None, Opt(help="Comma-separated grid plans (default: all; "
                                              "'mini' = dp2,dp2 zero1).")] = None,
        steps: Annotated[int, Opt(help="Steps per run; the first is warm-up.")] = 6,
        profile: Annotated[str | None, Opt(help="Hardware profile (default: "
                                                "~/.cache/paratrain/hardware.toml).")] = None,
        fit: Annotated[bool, Opt(help="Fit eta and fixed costs first (saved beside the "
                                      "profile); --no-fit uses the saved fit.")] = True,
        layers: Annotated[int | None, Opt(help="Grid model blocks.")] = None,
        d_model: Annotated[int | None, Opt(help="Grid model width.")] = None,
        d_ff: Annotated[int | None, Opt(help="Grid model SwiGLU width.")] = None,
        context: Annotated[int | None, Opt(help="Grid model sequence length.")] = None,
        global_batch: Annotated[int | None, Opt(help="Windows per step.")] = None,
        data: Annotated[str | None, Opt(help="Text file or folder (default: stdlib).")] = None,
        as_json: Annotated[bool, Opt("--json", help="Print the records as JSON.")] = False,
    ) -> None:
        """Predicted vs measured step time, wire bytes and model-state memory per plan."""
        from paratrain.run import check_model as cm

        names = None
        if plans == "mini":
            names = list(cm.MINI)
        elif plans:
            names = [p.strip() for p in plans.split(",") if p.strip()]
        base = cm.GRID_MODEL
        mcfg = base.replace(**{k: v for k, v in dict(n_layers=layers, d_model=d_model,
                                                      d_ff=d_ff, context=context).items()
                               if v is not None})
        log = (lambda *a, **k: None) if as_json else print
        result = cm.run_grid(names, profile=profile, steps=steps, fit=fit, mcfg=mcfg,
                             global_batch=global_batch or cm.GRID_BATCH, data=data, log=log)
        if as_json:
            print(json.dumps(result, indent=1))
        else:
            print(cm.format_table(result))
