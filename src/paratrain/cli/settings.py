"""One settings schema for `paratrain train`, `plan` and `check-model`.

Every flag of a setting is generated from its dataclass field (:func:`paratrain.config.setting`:
name, type, default, help, flag, allowed values) of :class:`~paratrain.config.ModelConfig`,
:class:`~paratrain.config.TrainConfig` or :class:`~paratrain.plan.ParallelPlan`; the three
commands share one resolution (defaults <- ``--config`` TOML <- flags, :func:`resolve`) and
one validation (the dataclasses' own), so `paratrain plan --config run.toml` prices the run
`paratrain train --config run.toml` trains (docs/design.md, "Settings: one schema").

No torch here (the CLI must start instantly).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Optional

import typer

from paratrain.config import ModelConfig, TrainConfig, build, check_types, flag_of, load_toml
from paratrain.plan import ParallelPlan, infer_dp

DEFAULT_NPROC = 2  # `paratrain train --nproc`'s default, the world `plan --config` prices
TABLES = {"model": ModelConfig, "train": TrainConfig, "plan": ParallelPlan}
# rich markup: a bracket is escaped (\\[) to be printed
PANELS = {"model": "Model \\[model]", "train": "Training \\[train]", "plan": "Plan \\[plan]"}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One flag of the schema: the field ``name`` of TOML table ``table``."""

    table: str
    name: str
    flag: str
    type: type
    help: str
    default: object


def schema(tables: dict[str, tuple[str, ...] | None]) -> list[Setting]:
    """The flags of ``tables`` (table -> the field names to offer, None: every field
    that has a flag), in field order."""
    out = []
    for table, names in tables.items():
        cls = TABLES[table]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = flag_of(f)
            if flag is None or (names is not None and f.name not in names):
                continue
            want = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],)
                        if t is not type(None))
            choices = f.metadata.get("choices", ())
            text = f.metadata.get("help", "") + (f" \\[{'|'.join(choices)}]" if choices else "")
            out.append(Setting(table, f.name, flag, want, text, f.default))
    return out


def _parameter(s: Setting) -> inspect.Parameter:
    # a bool gets its off switch: --sp/--no-sp
    decls = (f"{s.flag}/{s.flag[:2]}no-{s.flag[2:]}",) if s.type is bool else (s.flag,)
    # the field's default, which a --config TOML may change
    shown = "" if s.default is None else f" \\[default: {str(s.default).lower()}]" \
        if s.type is bool else f" \\[default: {s.default}]"
    opt = typer.Option(*decls, help=s.help + shown, rich_help_panel=PANELS[s.table],
                       show_default=False)
    return inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[Optional[s.type], opt])  # noqa: UP045


def with_settings(func: Callable, tables: dict[str, tuple[str, ...] | None]) -> Callable:
    """``func(..., flags)`` as a command typer reads: ``func``'s own options plus one
    generated option per setting of ``tables``; the command calls ``func`` with
    ``flags`` = {table: {field: value given on the command line}} (unset flags left out)."""
    own = [p for p in inspect.signature(func, eval_str=True).parameters.values()
           if p.name != "flags"]
    settings = schema(tables)
    clash = {p.name for p in own} & {s.name for s in settings}
    if clash:  # a programming error, caught when the CLI is built
        raise TypeError(f"{func.__name__}'s own options {sorted(clash)} shadow settings")

    def command(**kwargs):
        flags = {t: {} for t in tables}
        for s in settings:
            v = kwargs.pop(s.name)
            if v is not None:
                flags[s.table][s.name] = v
        return func(**kwargs, flags=flags)

    command.__signature__ = inspect.Signature(own + [_parameter(s) for s in settings])
    command.__name__, command.__doc__ = func.__name__, func.__doc__
    return command


def read_tables(config: str | None) -> dict[str, dict]:
    """The ``--config`` TOML's tables, each value type-checked (even one a flag
    overrides), or no tables."""
    tables = load_toml(config) if config else {}
    for where, cls in TABLES.items():
        check_types(cls, tables.get(where, {}), where)
    return tables


def resolve(config: str | None, model_flags: dict, train_flags: dict,
            plan_flags: dict, world: int, world_name: str = "nproc"
            ) -> tuple[ModelConfig, TrainConfig, ParallelPlan]:
    """Defaults <- TOML tables <- explicit flags (None: not given); validated, with dp
    inferred from the world size."""
    tables = read_tables(config)
    pick = lambda d: {k: v for k, v in d.items() if v is not None}  # noqa: E731
    mcfg = build(ModelConfig, {**tables.get("model", {}), **pick(model_flags)}, "model")
    tcfg = build(TrainConfig, {**tables.get("train", {}), **pick(train_flags)}, "train")
    pvals = infer_dp({**tables.get("plan", {}), **pick(plan_flags)}, world, world_name)
    return mcfg, tcfg, build(ParallelPlan, pvals, "plan")
