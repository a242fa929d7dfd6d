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

import copy
import dataclasses
import inspect
import re
import typing
from collections.abc import Callable
from typing import Annotated, Optional

import typer

from paratrain.config import ModelConfig, TrainConfig, build, check_types, flag_of, load_toml
from paratrain.plan import ParallelPlan, infer_dp

DEFAULT_NPROC = 2  # `paratrain train --nproc`'s default, the world `plan --config` prices
TABLES = {"model": ModelConfig, "train": TrainConfig, "plan": ParallelPlan}
# The help panels of `paratrain train --help` (and plan's, check-model's), in the order
# they are printed: a newcomer finds a flag by what it is about, not by its TOML table.
# A title names the TOML table when every setting in the panel comes from it (rich
# markup: a bracket is escaped, \\[, to be printed); the launch options of `train` that
# are no settings (cli/train.py) use the same panels.
PANELS = {
    "launch": "Launch",
    "model": "Model \\[model]",
    "moe": "Mixture of experts \\[model]",
    "data": "Data \\[train]",
    "training": "Training \\[train]",
    "layout": "Parallel layout \\[plan]",
    "sync": "Gradient sync \\[plan]",
    "checkpoints": "Checkpoints and faults",
    "output": "Output",
}
# Each setting's panel, by field name (tests/test_help_and_tables.py: every setting has one)
FIELD_PANELS = {
    **dict.fromkeys(("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "context",
                     "tie_embeddings", "attention"), "model"),
    **dict.fromkeys(("experts", "top_k", "moe_ffn", "shared_experts", "moe_every",
                     "aux_loss_coef", "z_loss_coef", "capacity_factor"), "moe"),
    **dict.fromkeys(("data", "tokenizer", "text_field"), "data"),
    **dict.fromkeys(("steps", "global_batch", "lr", "warmup_steps", "seed", "dtype",
                     "reduce_dtype", "eval_every"), "training"),
    **dict.fromkeys(("dp", "tp", "pp", "cp", "ep", "etp", "zero", "dp_replicate", "sp",
                     "micro_batches",
                     "schedule", "virtual_stages", "recompute", "cp_algorithm"), "layout"),
    **dict.fromkeys(("bucket_mb", "overlap", "compress", "collectives"), "sync"),
    "checkpoint_every": "checkpoints",
}
# A help sentence that names its own default ("(default: heads)", "(GQA; default: heads)",
# "(default d_ff)"): that default is shown as [default: ...], in place of the field's
# stored one (None, or dp's 1 that is inferred from the world size).
_SAYS_DEFAULT = re.compile(r"(?:\s*\(|;\s*)default:?\s+(.*)\)(?=\.?\s*$)")


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
            # ' | ' so a long choice list wraps at 80 columns instead of being cut
            text = f.metadata.get("help", "") + (f" \\[{' | '.join(choices)}]" if choices
                                                  else "")
            out.append(Setting(table, f.name, flag, want, text, f.default))
    return out


def panel_of(s: Setting) -> str:
    """The title of the help panel that shows setting ``s``."""
    return PANELS[FIELD_PANELS[s.name]]


def with_default(help: str, default: object) -> str:
    """``help`` ending in ``[default: ...]``: the default its sentence names (and the
    sentence without it), else ``default`` (a bool as true/false, None as none)."""
    said = _SAYS_DEFAULT.search(help)
    if said:
        help = _SAYS_DEFAULT.sub(lambda m: ")" if m.group(0)[0] == ";" else "", help, count=1)
        shown = said.group(1)
    else:
        shown = "none" if default is None else str(default).lower() \
            if isinstance(default, bool) else str(default)
    return f"{help} \\[default: {shown}]"


def shown_help(s: Setting) -> str:
    """``s``'s help with its default shown, and its TOML key when the panel's title
    names no table."""
    text = s.help
    if f"\\[{s.table}]" not in panel_of(s):
        text += f" TOML: {s.name} in \\[{s.table}]."
    return with_default(text, s.default)


def _own(p: inspect.Parameter) -> inspect.Parameter:
    """A command's own option, keyword-only (typer passes each by name); one in a panel
    of :data:`PANELS` shows its default as the settings do."""
    p = p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
    meta = getattr(p.annotation, "__metadata__", ())
    if not meta or getattr(meta[0], "rich_help_panel", None) not in PANELS.values():
        return p
    info = copy.copy(meta[0])
    info.help, info.show_default = with_default(info.help or "", p.default), False
    return p.replace(annotation=Annotated[(p.annotation.__origin__, info)])


def _parameter(s: Setting) -> inspect.Parameter:
    # a bool gets its off switch: --sp/--no-sp
    decls = (f"{s.flag}/{s.flag[:2]}no-{s.flag[2:]}",) if s.type is bool else (s.flag,)
    # the field's default (which a --config TOML may change) is written into the help
    opt = typer.Option(*decls, help=shown_help(s), rich_help_panel=panel_of(s),
                       show_default=False)
    return inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                             annotation=Annotated[Optional[s.type], opt])  # noqa: UP045


def _panel_order(p: inspect.Parameter) -> int:
    """Where ``p``'s panel comes in :data:`PANELS` (-1: the command's plain options,
    printed first)."""
    for meta in getattr(p.annotation, "__metadata__", ()):
        title = getattr(meta, "rich_help_panel", None)
        if title in PANELS.values():
            return list(PANELS.values()).index(title)
    return -1


def with_settings(func: Callable, tables: dict[str, tuple[str, ...] | None]) -> Callable:
    """``func(..., flags)`` as a command typer reads: ``func``'s own options plus one
    generated option per setting of ``tables``; the command calls ``func`` with
    ``flags`` = {table: {field: value given on the command line}} (unset flags left out)."""
    own = [_own(p) for p in inspect.signature(func, eval_str=True).parameters.values()
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

    params = sorted(own + [_parameter(s) for s in settings], key=_panel_order)  # stable
    command.__signature__ = inspect.Signature(params)
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
