"""The published-runs table (``data/calibration.csv``): reading it and turning rows into
priceable cases.

Each row gives a model (its shape columns, or the name of a catalogue model: empty shape
columns are filled from ``data/models.toml`` and non-empty ones override it, so a
benchmark that ran a truncated model names the model and its layer count), an
accelerator and count, the layout (TP/PP/DP/CP/EP, virtual stages, micro-batch size,
sharding, recomputation), the batch, the engine that ran it, and what was reported.
:func:`row_to_case` builds the model shape, hardware, :class:`~paratrain.plan.ParallelPlan`
and batch of one row, or raises :class:`Skip` with the reason the model cannot price it
(kept as a skipped :class:`Record`). The figure compared is the row's ``metric`` column
if set, else the first reported of tokens/s per accelerator (or a step time), mfu, hfu,
tflops (throughput needs neither the source's FLOP count nor its peak); tokens/s
is priced as model TFLOP/s (tokens/s x the model's FLOPs per token, the count the step
model uses, so this compares throughput). Rows marked ``confirmed=no`` are skipped with
that reason. Nothing is read from the free-text ``notes``: what changes a price has its
own column (``schedule``, ``vpp``, ``head_dim``, ``engine``). Every blank filled in is
listed in ``Case.defaults`` as (column, value, why), the engine is chosen with its reason
(:mod:`paratrain.systems.row_engine`), a blank recompute is inferred from memory and a
layout that cannot fit is refused (:mod:`paratrain.systems.row_memory`). Columns,
sources policy and the held-out rule: docs/runs.md.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from paratrain.cost.groups import split_batch
from paratrain.cost.hardware import Hardware, load_hardware, resolve_hardware
from paratrain.cost.moe_layout import default_etp
from paratrain.cost.shapes import FLOP_COUNTS, ModelShape
from paratrain.plan import ParallelPlan
from paratrain.systems.overlap import ENGINES
from paratrain.systems.partial_recompute import recompute_words, share_from_utilisation, share_words
from paratrain.systems.recompute_modules import modules_said
from paratrain.systems.row_engine import (
    case_engine,
    case_kernel,
    eight_bit,
    engine_options,
    row_engine,
)
from paratrain.systems.row_fields import Default, Skip
from paratrain.systems.row_fields import num as _num
from paratrain.systems.row_layout import axes, batch, schedule, seq_len
from paratrain.systems.row_memory import (
    BLOCK_ORDER,
    RECOMPUTE_ORDER,
    admitted_why,
    fitting_recompute,
    least_bytes,
    offloaded,
    refusal,
)
from paratrain.systems.row_shape import (  # noqa: F401 - the table's readers, re-exported
    MOE_COLUMNS,
    SHAPE_COLUMNS,
    _catalogue_model,
    row_shape,
)
from paratrain.systems.row_words import (
    eight_bit_said,
    four_bit_said,
    hardware_flops_said,
    metric_said,
    recompute_mode,
    recompute_share_said,
    recompute_stated,
    zero_stage,
    zero_stated,
)

DATA_DIR = Path(__file__).parent / "data"  # the published runs and the fitted values
DEFAULT_RUNS = DATA_DIR / "calibration.csv"
SPLITS = ("fit", "heldout")


@dataclass(frozen=True)
class Case:
    """One priceable row."""

    id: str
    source: str
    hw_key: str
    hw: Hardware
    model: ModelShape
    plan: ParallelPlan
    tokens: int
    seq_len: int
    metric: str  # mfu, hfu or tflops
    tflops_kind: str  # model or hardware (for tflops)
    reported: float  # fraction for mfu/hfu, TFLOP/s for tflops
    engine: str = ""  # the engine it is priced as (overlap.ENGINES; systems.row_engine)
    engine_why: str = ""  # which column and word chose it
    engine_options: tuple = ()  # Engine fields the engine cell's words set (row_engine)
    split: str = "fit"  # fit or heldout (docs/runs.md)
    precision: str = ""
    step_time_s: float | None = None  # as published, when published
    tokens_per_s: float | None = None  # per accelerator, as published or derived
    shard_group: int | None = None  # ZeRO/FSDP group when smaller than DP (hybrid sharding)
    # how the source counts model FLOPs (models.FLOP_COUNTS); empty = its engine's way
    flops_count: str = ""
    defaults: tuple[Default, ...] = ()  # every blank filled in, in the order applied
    # with recompute full: the share of the blocks recomputed (systems.partial_recompute)
    recompute_share: float = 1.0
    # the modules a selective recompute names, each rerunning what it holds
    # (systems.recompute_modules); empty: the plan's recompute says what reruns
    rerun: tuple[str, ...] = ()


def _defaults_dicts(defaults: tuple) -> list[dict]:
    return [{"field": f, "value": v, "why": w} for f, v, w in defaults]


@dataclass(frozen=True)
class Record:
    id: str
    source: str
    metric: str | None
    reported: float | None
    predicted: float | None
    skipped_reason: str | None = None
    engine: str | None = None
    engine_why: str | None = None
    defaults: tuple[Default, ...] = ()

    def with_case(self, case: Case) -> Record:
        """This record with what its case assumed: the engine, why, the defaults."""
        return dataclasses.replace(self, engine=case.engine, engine_why=case.engine_why,
                                   defaults=case.defaults)

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else self.predicted - self.reported

    @property
    def abs_pct_error(self) -> float | None:
        return None if self.predicted is None else abs(self.error) / abs(self.reported) * 100

    def as_dict(self) -> dict:
        return {"id": self.id, "source": self.source, "metric": self.metric,
                "reported": self.reported, "predicted": self.predicted, "error": self.error,
                "abs_pct_error": self.abs_pct_error, "skipped_reason": self.skipped_reason,
                "engine": self.engine, "engine_why": self.engine_why,
                "defaults": _defaults_dicts(self.defaults)}


def read_runs(path: str | Path | None = None) -> list[dict]:
    p = Path(path) if path else DEFAULT_RUNS
    if not p.is_file():
        raise ValueError(f"runs table {str(p)!r} does not exist; pass an existing CSV")
    try:
        with p.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows, header = list(reader), reader.fieldnames or []
    except UnicodeDecodeError as e:
        raise ValueError(f"runs table {str(p)!r} is not UTF-8 text (byte "
                         f"{e.object[e.start]:#04x} at offset {e.start}); save it as UTF-8"
                         ) from None
    if "id" not in header:
        raise ValueError(f"runs table {str(p)!r} has no 'id' column; use the columns of "
                         "calibration.csv")
    if not rows:
        raise ValueError(f"runs table {str(p)!r} has a header but no rows; add a row per run")
    return rows


def source_key(row: dict) -> str:
    s = (row.get("source") or "unknown").strip()
    return s.split(",")[0].split(" (")[0].strip()[:40] or "unknown"


def _hardware(name: str) -> tuple[str, Hardware]:
    """The catalogue entry an accelerator cell names (:func:`paratrain.cost.hardware.
    resolve_hardware`), or Skip."""
    try:
        key = resolve_hardware(name)
    except ValueError as e:
        raise Skip(str(e)) from None
    return key, load_hardware(key)


def row_to_case(row: dict, ep_in_domain: bool = True) -> Case:
    """One CSV row as a priceable case, or Skip with the reason; every blank filled in is
    in ``Case.defaults``, a blank recompute inferred from memory (:mod:`paratrain.systems.
    row_memory`), a blank EP in the fast domain unless only all data ranks fit."""
    given = row
    if (row.get("confirmed") or "").strip().lower() == "no":
        raise Skip("confirmed=no: unverified, kept for reference")
    out: list = []
    gpus = _num(row, "num_accel", int)
    if not gpus:  # the layout's product, when it names every axis
        tp, pp, dp = (_num(row, k, int) for k in ("TP", "PP", "DP"))
        if not (tp and pp and dp):
            raise Skip("no num_accel (nor TP, PP and DP to multiply)")
        gpus = tp * pp * dp * (_num(row, "CP", int) or 1)
        row = {**row, "num_accel": str(gpus)}  # what the reported figure is per
        out.append(("num_accel", gpus, "blank: TP x PP x DP x CP"))
    seq = seq_len(row, gpus, out)
    if four_bit_said(row.get("precision") or ""):
        raise Skip(f"precision {row['precision'].strip()!r}: 4-bit training GEMMs are not "
                   "priced (FP8 and 16-bit are); the row is not scored")
    model = row_shape(row, seq, out)
    L = model.n_layers
    hw_key, hw = _hardware(row.get("accelerator") or "")
    if eight_bit_said(row.get("precision") or "") and not hw.peak_flops_fp8:
        raise Skip(f"precision {row['precision'].strip()!r} on {hw.name}: the chip has no "
                   "8-bit matmul peak in the catalogue (no FP8 tensor cores); the row is "
                   "not scored")
    domain = _num(row, "accel_per_domain", int)
    if domain:  # the job's fast-interconnect domain (a TPU slice) differs from the catalogue's
        hw = dataclasses.replace(hw, gpus_per_node=domain)
    net = _num(row, "inter_gbps")
    if net:  # the cluster's network as the source states it, Gb/s per accelerator
        hw = dataclasses.replace(hw, inter_bw=net * 1e9 / 8)
    domain = hw.gpus_per_node if ep_in_domain else 0  # a blank EP's reach (row_layout.axes)
    tp, pp, cp, ep, dp = axes(row, gpus, out, model.experts, domain)
    tokens, m = batch(row, seq, dp, pp, out, gpus)
    sched, v = schedule(row, pp, m, L, out)
    sharding = (row.get("zero_or_fsdp") or "").strip()
    eng, why = row_engine(row)
    zero = zero_stage(sharding)
    zero_said = zero_stated(sharding)
    if not zero_said:
        zero = ENGINES[eng].zero
        said = f"{sharding!r} names no ZeRO stage" if sharding else "blank"
        out.append(("zero_or_fsdp", f"ZeRO-{zero}", f"{said}: {eng}'s default "
                                                      "(overlap.Engine.zero)"))
    etp = _num(row, "ETP", int)
    if etp is None and ep > 1:
        etp = default_etp(dp, cp, tp, ep)
        out.append(("ETP", etp, "blank: Megatron-Core's default, etp = tp where ep*tp "
                                "divides dp*cp*tp (cost.moe_layout)"))
    try:
        # expert parallelism as given, folded over dp*cp*tp (plan.py)
        plan = ParallelPlan(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp or 1,
                            zero=zero, sp=tp > 1,
                            micro_batches=m, schedule=sched, virtual_stages=v,
                            recompute=recompute_mode(row.get("recompute") or ""))
        split_batch(tokens, seq, plan)
    except ValueError as e:
        raise Skip(f"layout invalid: {e}", out) from None
    if pp > L:
        raise Skip(f"PP {pp} exceeds layers {L}", out)
    metric, kind, rep, count = _reported(row, model, seq)
    split = (row.get("split") or "fit").strip() or "fit"
    if split not in SPLITS:
        raise Skip(f"split {split!r} is unknown; use one of {', '.join(SPLITS)}", out)
    if why.startswith("no column"):
        out.append(("engine", eng, why))
    options, said = engine_options(row)
    case = Case(row.get("id", "?"), source_key(row), hw_key, hw, model, plan, tokens, seq,
                metric, kind, rep, engine=eng, engine_why=why + said,
                engine_options=options, split=split,
                precision=(row.get("precision") or "").strip(),
                step_time_s=_num(row, "step_time_s"),
                tokens_per_s=_num(row, "tokens_per_s_per_accel"),
                shard_group=_num(row, "shard_group", int), flops_count=count,
                rerun=modules_said(row.get("recompute") or ""), recompute_share=
                recompute_share_said(row.get("recompute") or ""))
    words, said = row.get("recompute") or "", (_pct(row, "mfu_pct"), _pct(row, "hfu_pct"))
    stated = recompute_stated(words), offloaded(words), said
    try:
        return _fit_memory(case, *stated, list(out))
    except Skip:
        fitted = None if zero_said else _least_zero(case, stated, out)
        if fitted is None and model.is_moe and not _num(given, "EP", int) and \
                ep < math.gcd(model.experts, dp * cp):  # the domain held it back
            return row_to_case(given, ep_in_domain=False)
        if fitted is None:
            raise  # a stated sharding, or no stage fits: the default's refusal stands
        return fitted


def _least_zero(case: Case, stated: tuple, out: list) -> Case | None:
    """A row that states no sharding and does not fit at its engine's default stage: the
    run ran, so its states fit; the least ZeRO stage above the default that fits (with the
    row's recompute, stated or inferred), said so among the defaults; None if none does."""
    kept = [d for d in out if d[0] != "zero_or_fsdp"]
    why = (f"not stated, and ZeRO-{case.plan.zero} ({case.engine}'s default) does not fit: "
           "the least stage that does")
    for z in range(case.plan.zero + 1, 4):
        plan = dataclasses.replace(case.plan, zero=z)
        try:
            return _fit_memory(dataclasses.replace(case, plan=plan), *stated,
                               kept + [("zero_or_fsdp", f"ZeRO-{z}", why)])
        except Skip:
            continue
    return None


def _fit_memory(case: Case, stated: bool, offload: bool, said: tuple, out: list) -> Case:
    """The case with its recompute inferred (blank: the least that fits; a row that gives
    its MFU and HFU: the share of blocks their ratio says, :func:`paratrain.systems.
    partial_recompute.share_from_utilisation`), or Skip when the layout does not fit even
    with full recomputation (:mod:`paratrain.systems.row_memory`: the least an engine runs
    it in)."""
    eng = case_engine(case)
    att = case_kernel(case)
    # the engine's "selective" is a share of whole blocks (overlap.Engine.selective_blocks)
    blocks = stated and case.plan.recompute == "selective" and eng.selective_blocks
    mode, mem, share = fitting_recompute(case.model, case.plan, case.hw, case.tokens,
                                         case.seq_len, att, case.shard_group,
                                         eight_bit(case),
                                         BLOCK_ORDER if blocks else RECOMPUTE_ORDER)
    if mode is None:
        if least_bytes(mem, offload) > mem.hbm_bytes:
            raise Skip(refusal(mem, case.hw, offload), out)
        case = dataclasses.replace(case, plan=dataclasses.replace(case.plan,
                                                                  recompute="full"))
        out.append(("recompute", "full", admitted_why(mem, offload)))
        return dataclasses.replace(case, defaults=tuple(out))
    ratio = share_from_utilisation(*said)
    if (not stated or blocks) and ratio is not None:
        mode, share = ("full", ratio) if ratio > 0 else ("none", 1.0)
        case = dataclasses.replace(case, plan=dataclasses.replace(case.plan, recompute=mode),
                                   recompute_share=share)
        out.append(("recompute", recompute_words(case),
                    f"the source's HFU / MFU, {said[1]:g} / {said[0]:g} = 1 + share / 3: "
                    f"{share_words(ratio)}"))
    elif not stated or blocks:
        era = not stated and att == "eager"  # before selective recompute and FlashAttention
        mode, share = ("full", 1.0) if era else (mode, share)
        case = dataclasses.replace(case, plan=dataclasses.replace(case.plan, recompute=mode),
                                   recompute_share=share)
        what = (f"{case.engine}'s selective checkpointing wraps whole blocks: the least "
                "share of them that fits" if blocks else "blank under eager attention: "
                "full, that era's checkpointing" if era else "inferred: the least of none "
                "< selective < full (on the least share of the blocks) that fits")
        out.append(("recompute", recompute_words(case),
                    f"{what} ({mem.total_bytes / 1e9:,.1f} GB of "
                    f"{mem.hbm_bytes / 1e9:,.1f} GB HBM)"))
    return dataclasses.replace(case, defaults=tuple(out))


def _reported(row: dict, model: ModelShape, seq: int) -> tuple[str, str, float, str]:
    """(metric, tflops kind, reported value, FLOP count) of a row; see the module
    docstring. The FLOP count is the row's ``flops_count`` (empty: its engine's), and ours
    (``6N``) for a ``tokens`` row, whose TFLOP/s we compute; a row that gives only its step
    time (``step``) is a tokens row at its tokens per step over the step and the GPUs."""
    mfu, hfu = _pct(row, "mfu_pct"), _pct(row, "hfu_pct")
    tfl, tps = _num(row, "tflops_per_accel_reported"), _num(row, "tokens_per_s_per_accel")
    kind = "hardware" if hardware_flops_said(row.get("tflops_kind") or "") else "model"
    count = (row.get("flops_count") or "").strip()
    if count and count not in FLOP_COUNTS:
        raise Skip(f"flops_count {count!r} is unknown; use one of {', '.join(FLOP_COUNTS)}")
    step, gpus = _num(row, "step_time_s"), _num(row, "num_accel")
    per_step = _num(row, "tokens_per_step") or seq * (_num(row, "global_batch_seqs") or 0)
    timed = not tps and bool(step and gpus and per_step)  # a step time alone
    if timed:
        tps = per_step / step / gpus
    found = {"mfu": mfu and ("mfu", kind, mfu / 100, count),
             "hfu": hfu and ("hfu", kind, hfu / 100, count),
             "tflops": tfl and ("tflops", kind, tfl, count),
             "tokens": tps and ("tflops", "model", tps * model.flops_per_token(seq) / 1e12,
                                "6N")}
    found["step"] = found["tokens"] if timed else None
    cell = (row.get("metric") or "").strip()
    want = metric_said(cell) if cell else ""
    if cell:
        if want not in found:
            raise Skip(f"metric {cell.lower()!r} is unknown; use one of {', '.join(found)}")
        if not found[want]:
            raise Skip(f"metric {want!r} requested but its column is empty")
        return found[want]
    # blank: throughput first, the one figure that needs neither the source's FLOP count
    # nor the peak it divides by; then the utilisations and TFLOP/s, counted its way
    for key in ("tokens", "mfu", "hfu", "tflops"):
        if found[key]:
            return found[key]
    raise Skip("reports none of MFU, HFU, TFLOP/s, tokens/s per accelerator or a step time "
               "with its tokens per step")


def _pct(row: dict, key: str) -> float | None:
    """A utilisation in percent; one written as a fraction (0.45: no training step runs
    under 1% of peak) is read as the percent it is."""
    x = _num(row, key)
    return 100 * x if x is not None and 0 < x <= 1 else x


def heldout_ids(rows: list[dict]) -> tuple[str, ...]:
    """Ids of the rows kept aside for judging (``split`` = heldout); see docs/runs.md."""
    return tuple(r["id"] for r in rows if (r.get("split") or "").strip() == "heldout")


def cases_and_skips(rows: list[dict]) -> tuple[list[Case], list[Record]]:
    cases, skips = [], []
    for row in rows:
        try:
            cases.append(row_to_case(row))
        except Skip as e:
            eng, why = row_engine(row)
            skips.append(Record(row.get("id", "?"), source_key(row), None, None, None, str(e),
                                eng, why, e.defaults))
    return cases, skips
