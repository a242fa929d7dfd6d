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
if set, else the first reported of mfu, hfu, tflops, tokens/s per accelerator; tokens/s
is priced as model TFLOP/s (tokens/s x the model's FLOPs per token, the count the step
model uses, so this compares throughput). Rows marked ``confirmed=no`` are skipped with
that reason. Columns, sources policy and the held-out rule: docs/runs.md.
"""

from __future__ import annotations

import csv
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from paratrain.cost.groups import split_batch
from paratrain.cost.hardware import Hardware, load_hardware
from paratrain.cost.moe_layout import default_etp
from paratrain.cost.shapes import FLOP_COUNTS, ModelShape, load_model
from paratrain.plan import ParallelPlan, infer_dp

DATA_DIR = Path(__file__).parent / "data"  # the published runs and the fitted values
DEFAULT_RUNS = DATA_DIR / "calibration.csv"
SPLITS = ("fit", "heldout")
# the expert-parallel issue's column names -> ModelShape (ModelConfig) fields
MOE_COLUMNS = {"experts": "experts", "top_k": "top_k", "moe_ffn_hidden": "moe_ffn",
               "shared_experts": "shared_experts"}
# shape columns -> ModelShape fields
SHAPE_COLUMNS = {"layers": "n_layers", "hidden": "d_model", "heads": "n_heads",
                 "kv_heads": "n_kv_heads", "ffn_hidden": "d_ff", "vocab": "vocab_size",
                 "head_dim": "head_size"}


class Skip(Exception):
    """A row the model cannot price; the message is the reason."""


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
    engine: str = ""  # the software that ran the job (Megatron-LM, NeMo, FSDP, ...)
    split: str = "fit"  # fit or heldout (docs/runs.md)
    precision: str = ""
    step_time_s: float | None = None  # as published, when published
    tokens_per_s: float | None = None  # per accelerator, as published or derived
    shard_group: int | None = None  # ZeRO/FSDP group when smaller than DP (hybrid sharding)
    # how the source counts model FLOPs (models.FLOP_COUNTS); empty = its engine's way
    flops_count: str = ""


@dataclass(frozen=True)
class Record:
    id: str
    source: str
    metric: str | None
    reported: float | None
    predicted: float | None
    skipped_reason: str | None = None

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else self.predicted - self.reported

    @property
    def abs_pct_error(self) -> float | None:
        return None if self.predicted is None else abs(self.error) / abs(self.reported) * 100

    def as_dict(self) -> dict:
        return {"id": self.id, "source": self.source, "metric": self.metric,
                "reported": self.reported, "predicted": self.predicted, "error": self.error,
                "abs_pct_error": self.abs_pct_error, "skipped_reason": self.skipped_reason}


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


def _num(row: dict, key: str, kind=float):
    v = (row.get(key) or "").strip()
    if not v:
        return None
    try:
        x = float(v)
    except ValueError:
        return None
    return int(x) if kind is int and x == int(x) else (None if kind is int else x)


def source_key(row: dict) -> str:
    s = (row.get("source") or "unknown").strip()
    return s.split(",")[0].split(" (")[0].strip()[:40] or "unknown"


def _hardware(name: str) -> tuple[str, Hardware]:
    from paratrain.cost.catalogue import lookup

    candidates = [name, name.split("(")[0].strip()]
    low = name.lower()
    for key in ("a100", "h100", "h800", "h200", "b200", "v100", "mi300x", "tpu v3", "tpu v4",
                "tpu v5p", "tpu v5e"):
        if key in low:
            candidates.append(key.replace(" ", "-"))
    for c in candidates:
        if not c:
            continue
        try:
            key, _ = lookup(c, "hardware.toml", "hardware")
        except ValueError:
            continue
        return key, load_hardware(key)
    raise Skip(f"accelerator {name!r} is not in the hardware catalogue")


def _zero(text: str) -> int:
    t = text.lower()
    if "zero-3" in t or "2d sharding" in t or ("fsdp" in t and "not resharded" not in t):
        return 3
    if "zero-2" in t or "fsdp" in t:
        return 2
    if "zero-1" in t or "distributed optimizer" in t:
        return 1
    return 0


def _recompute(text: str) -> str:
    """none, selective or full from a row's words. A selective recomputation whose module
    list names the MLP or the MoE layer (Megatron-Core's recompute modules ``mlp``,
    ``moe``) reruns most of the block's GEMMs and its all-to-alls: priced as full."""
    t = text.lower().strip()
    if not t or t.startswith("none") or t.startswith("no "):
        return "none"
    if "selective" in t:
        mods = t.split("modules", 1)[1] if "modules" in t else ""
        return "full" if re.search(r"\b(mlp|moe)\b", mods) else "selective"
    if any(k in t for k in ("full", "checkpoint", "rematerial", "recomput")):
        return "full"
    return "none"


def _catalogue_model(row: dict) -> ModelShape | None:
    """The catalogue model a row names: its ``model_key`` column if set (nothing else),
    else its ``model`` text (whole, then without a trailing parenthetical like "(NeMo)")."""
    key, text = (row.get("model_key") or "").strip(), (row.get("model") or "").strip()
    for name in ((key,) if key else (text, text.split("(")[0].strip())):
        if name:
            try:
                return load_model(name)
            except ValueError:
                continue
    return None


def _moe_fields(row: dict, n_layers: int) -> dict:
    out = {field: _num(row, col, int) for col, field in MOE_COLUMNS.items()}
    out = {k: v for k, v in out.items() if v is not None}
    moe_layers = _num(row, "moe_layers", int)
    if moe_layers is not None:
        out["first_dense_layers"] = n_layers - moe_layers
    return out


def _style(row: dict) -> dict:
    """The ``mlp`` (swiglu/gelu: three or two matrices) and ``tied`` (yes/no) columns."""
    out: dict = {}
    mlp = (row.get("mlp") or "").strip().lower()
    if mlp:
        out["mlp"] = mlp
    tied = (row.get("tied") or "").strip().lower()
    if tied:
        out["tie_embeddings"] = tied in ("yes", "true", "1")
    return out


def row_shape(row: dict, seq: int) -> ModelShape:
    """The model a row ran: its shape columns, or the catalogue model it names with the
    non-empty shape and MoE columns applied on top. Raises Skip with the reason."""
    rid = row.get("id", "?")
    L, h, heads = _num(row, "layers", int), _num(row, "hidden", int), _num(row, "heads", int)
    base = _catalogue_model(row) if (row.get("model_key") or "").strip() or not (
        L and h and heads) else None
    if (row.get("model_key") or "").strip() and base is None:
        raise Skip(f"model_key {row['model_key']!r} is not in the model catalogue "
                   "(data/models.toml); use a catalogue name or fill the shape columns")
    try:
        if base is not None:
            over = {f: _num(row, c, int) for c, f in SHAPE_COLUMNS.items()}
            over = {k: v for k, v in over.items() if v}
            over.update(_style(row))
            n_layers = over.get("n_layers", base.n_layers)
            over.update(_moe_fields(row, n_layers))
            if "first_dense_layers" not in over and base.is_moe:
                over["first_dense_layers"] = min(base.first_dense_layers, n_layers - 1)
            return dataclasses.replace(base, context=seq, **over)
        if not (L and h and heads):
            raise Skip(f"model shape incomplete (layers, hidden, heads) and model "
                       f"{row.get('model') or rid!r} is not in the model catalogue; fill the "
                       "shape columns or set model_key")
        ffn = _num(row, "ffn_hidden", int)
        hd = re.search(r"head dim (\d+)", row.get("notes") or "")
        kv = _num(row, "kv_heads", int)
        style = {"mlp": "gelu" if ffn == 4 * h else "swiglu",
                 "tie_embeddings": "palm" in (row.get("model") or "").lower(),
                 **_style(row)}
        return ModelShape(
            name=row.get("model") or rid, n_layers=L, d_model=h, n_heads=heads,
            n_kv_heads=kv if kv and kv != heads else None, d_ff=ffn or 4 * h,
            vocab_size=_num(row, "vocab", int) or 51200, context=seq,
            head_size=_num(row, "head_dim", int) or (int(hd.group(1)) if hd else None),
            **style, **_moe_fields(row, L))
    except (ValueError, TypeError) as e:
        raise Skip(f"model shape invalid: {e}") from None


def row_to_case(row: dict) -> Case:
    """Turn one CSV row into a priceable case, or raise Skip with the reason."""
    rid = row.get("id", "?")
    if (row.get("confirmed") or "").strip().lower() == "no":
        raise Skip("confirmed=no: unverified, kept for reference")
    seq = _num(row, "seq_len", int)
    if not seq:
        raise Skip("no seq_len")
    gpus = _num(row, "num_accel", int)
    if not gpus:
        raise Skip("no num_accel")
    notes = row.get("notes") or ""
    model = row_shape(row, seq)
    L = model.n_layers
    hw_key, hw = _hardware(row.get("accelerator") or "")
    domain = _num(row, "accel_per_domain", int)
    if domain:  # the job's fast-interconnect domain (a TPU slice) differs from the catalogue's
        hw = dataclasses.replace(hw, gpus_per_node=domain)
    tp, pp = _num(row, "TP", int) or 1, _num(row, "PP", int) or 1
    cp, ep = _num(row, "CP", int) or 1, _num(row, "EP", int) or 1
    try:
        dp = _num(row, "DP", int) or infer_dp({"tp": tp, "pp": pp, "cp": cp}, gpus,
                                                "num_accel")["dp"]
    except ValueError as e:
        raise Skip(str(e)) from None
    if tp * pp * dp * cp != gpus:
        raise Skip(f"TP*PP*DP*CP = {tp * pp * dp * cp} != num_accel {gpus}")
    tokens = _num(row, "tokens_per_step", int)
    seqs = _num(row, "global_batch_seqs", int)
    if not tokens and seqs:
        tokens = seqs * seq
    if not tokens:
        raise Skip("no batch size (tokens_per_step or global_batch_seqs)")
    seqs = tokens // seq
    if seqs % dp:
        raise Skip(f"{seqs} sequences do not split over DP {dp}")
    per_replica = seqs // dp
    mbs = _num(row, "microbatch", int) or (1 if pp > 1 else per_replica)
    if per_replica % mbs:
        raise Skip(f"micro-batch {mbs} does not divide {per_replica} sequences per replica")
    m = per_replica // mbs
    # interleaving noted without its depth: one block per virtual stage as far as the
    # layers allow (Llama 3's paper: a first chunk holding only the embedding)
    v = _num(row, "vpp", int) or (max(1, L // pp) if "interleaved" in notes.lower() else 1)
    sched = "interleaved" if pp > 1 and v > 1 and m % pp == 0 and pp * v <= L else "1f1b"
    if sched != "interleaved":
        v = 1
    try:
        # expert parallelism as given, folded over dp*cp*tp; expert TP as the row says,
        # else Megatron-Core's default (etp = tp where ep fits, cost.moe_layout)
        plan = ParallelPlan(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep,
                            etp=_num(row, "ETP", int) or default_etp(dp, cp, tp, ep),
                            zero=_zero(row.get("zero_or_fsdp") or ""), sp=tp > 1,
                            micro_batches=m, schedule=sched, virtual_stages=v,
                            recompute=_recompute(row.get("recompute") or ""))
        split_batch(tokens, seq, plan)
    except ValueError as e:
        raise Skip(f"layout invalid: {e}") from None
    if pp > L:
        raise Skip(f"PP {pp} exceeds layers {L}")
    metric, kind, rep, count = _reported(row, model, seq)
    split = (row.get("split") or "fit").strip() or "fit"
    if split not in SPLITS:
        raise Skip(f"split {split!r} is unknown; use one of {', '.join(SPLITS)}")
    return Case(rid, source_key(row), hw_key, hw, model, plan, tokens, seq, metric, kind, rep,
                engine=(row.get("engine") or "").strip(), split=split,
                precision=(row.get("precision") or "").strip(),
                step_time_s=_num(row, "step_time_s"),
                tokens_per_s=_num(row, "tokens_per_s_per_accel"),
                shard_group=_num(row, "shard_group", int), flops_count=count)


def _reported(row: dict, model: ModelShape, seq: int) -> tuple[str, str, float, str]:
    """(metric, tflops kind, reported value, FLOP count) of a row; see the module
    docstring. The FLOP count is the row's ``flops_count`` (empty: its engine's), and ours
    (``6N``) for a ``tokens`` row, whose TFLOP/s we compute."""
    mfu, hfu = _num(row, "mfu_pct"), _num(row, "hfu_pct")
    tfl, tps = _num(row, "tflops_per_accel_reported"), _num(row, "tokens_per_s_per_accel")
    kind = "hardware" if "hardware" in (row.get("tflops_kind") or "").lower() else "model"
    count = (row.get("flops_count") or "").strip()
    if count and count not in FLOP_COUNTS:
        raise Skip(f"flops_count {count!r} is unknown; use one of {', '.join(FLOP_COUNTS)}")
    found = {"mfu": mfu and ("mfu", kind, mfu / 100, count),
             "hfu": hfu and ("hfu", kind, hfu / 100, count),
             "tflops": tfl and ("tflops", kind, tfl, count),
             "tokens": tps and ("tflops", "model", tps * model.flops_per_token(seq) / 1e12,
                                "6N")}
    want = (row.get("metric") or "").strip().lower()
    if want:
        if want not in found:
            raise Skip(f"metric {want!r} is unknown; use one of {', '.join(found)}")
        if not found[want]:
            raise Skip(f"metric {want!r} requested but its column is empty")
        return found[want]
    for key in found:
        if found[key]:
            return found[key]
    raise Skip("reports none of MFU, HFU, TFLOP/s or tokens/s per accelerator")


def heldout_ids(rows: list[dict]) -> tuple[str, ...]:
    """Ids of the rows kept aside for judging (``split`` = heldout); see docs/runs.md."""
    return tuple(r["id"] for r in rows if (r.get("split") or "").strip() == "heldout")


def cases_and_skips(rows: list[dict]) -> tuple[list[Case], list[Record]]:
    cases, skips = [], []
    for row in rows:
        try:
            cases.append(row_to_case(row))
        except Skip as e:
            skips.append(Record(row.get("id", "?"), source_key(row), None, None, None, str(e)))
    return cases, skips
