"""Score the systems model against published training runs (``data/calibration.csv``).

Each row gives a model shape, an accelerator and count, the layout (TP/PP/DP/CP/EP,
virtual stages, micro-batch size, sharding, recomputation), the batch, and what was
reported: MFU, HFU or TFLOP/s per GPU. We predict the same quantity like for like:

- ``mfu``: model FLOPs (6N + 12 L H Q T per token) / (step x GPUs x peak);
- ``hfu``: adds recomputation (Narayanan et al. 2021's eq. 3 counts the recompute forward);
- ``tflops``: achieved TFLOP/s per GPU, model or hardware FLOPs as the row's
  ``tflops_kind`` says.

Preference when a row reports several: mfu, then hfu, then tflops. Rows the model cannot
price are kept with a ``skipped_reason``. Errors: MAE in percentage points (or TFLOP/s)
and MAPE, overall and per source.

The model's free parameters (:class:`Params`) are few and physical: the matmul efficiency
eta per accelerator generation, one bandwidth efficiency applied to every link, and the
share of compute that data-parallel sync can hide under (backward, 2/3 by default).
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.plan import ParallelPlan
from paratrain.systems.catalogue import DATA_DIR
from paratrain.systems.hardware import Hardware, load_hardware
from paratrain.systems.layout import split_batch
from paratrain.systems.models import ModelShape
from paratrain.systems.step_time import OVERLAP_FRACTION, step_time

DEFAULT_RUNS = DATA_DIR / "calibration.csv"
FITTED = DATA_DIR / "fitted.toml"


@dataclass(frozen=True)
class Params:
    """Free parameters of the systems model, fitted on the published runs."""

    eta: dict = field(default_factory=dict)  # accelerator generation -> matmul efficiency
    bw_eff: float = 1.0  # achieved / nominal bandwidth on every link
    overlap_fraction: float = OVERLAP_FRACTION
    overhead_width: float = 0.0  # h0: non-matmul time = matmul time x h0 / d_model
    dp_algorithm: str = "auto"

    def apply(self, key: str, hw: Hardware) -> Hardware:
        return hw.replace(eta=self.eta.get(generation(key), hw.eta),
                          intra_bw=hw.intra_bw * self.bw_eff, inter_bw=hw.inter_bw * self.bw_eff)

    def step_kwargs(self) -> dict:
        """Keyword arguments of :func:`step_time` these parameters set."""
        return {"overlap_fraction": self.overlap_fraction, "dp_algorithm": self.dp_algorithm,
                "overhead_width": self.overhead_width}

    def replace(self, **kw) -> Params:
        import dataclasses

        return dataclasses.replace(self, **kw)


_GENERATIONS = {"a100-40gb": "a100", "h800": "h100", "h200": "h100"}


def generation(hw_key: str) -> str:
    """Accelerators that share a chip share an eta (A100 40/80 GB; H100/H800/H200)."""
    return _GENERATIONS.get(hw_key, hw_key)


def load_params(path: str | Path | None = None) -> Params:
    """Fitted parameters (default: the shipped ``data/fitted.toml``)."""
    from paratrain.systems._toml import tomllib

    p = Path(path) if path else FITTED
    if not p.is_file():
        raise ValueError(f"fitted parameters {str(p)!r} do not exist; run validate --fit")
    with p.open("rb") as f:
        d = tomllib.load(f)
    return Params(eta=dict(d.get("eta", {})), bw_eff=d.get("bw_eff", 1.0),
                  overlap_fraction=d.get("overlap_fraction", OVERLAP_FRACTION),
                  overhead_width=d.get("overhead_width", 0.0),
                  dp_algorithm=d.get("dp_algorithm", "auto"))


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


# ---- reading rows --------------------------------------------------------------------------
def read_runs(path: str | Path | None = None) -> list[dict]:
    p = Path(path) if path else DEFAULT_RUNS
    if not p.is_file():
        raise ValueError(f"runs table {str(p)!r} does not exist; pass an existing CSV")
    with p.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "id" not in rows[0]:
        raise ValueError(f"{p} has no 'id' column; use the columns of calibration.csv")
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
    from paratrain.systems.catalogue import lookup

    candidates = [name, name.split("(")[0].strip()]
    low = name.lower()
    for key in ("a100", "h100", "h800", "h200", "b200", "v100", "mi300x", "tpu v4", "tpu v5p"):
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
    t = text.lower().strip()
    if not t or t.startswith("none") or t.startswith("no "):
        return "none"
    if "selective" in t:
        return "selective"
    if any(k in t for k in ("full", "checkpoint", "rematerial", "recomput")):
        return "full"
    return "none"


def row_to_case(row: dict) -> Case:
    """Turn one CSV row into a priceable case, or raise Skip with the reason."""
    rid = row.get("id", "?")
    L, h, heads = _num(row, "layers", int), _num(row, "hidden", int), _num(row, "heads", int)
    if not (L and h and heads):
        raise Skip("model shape incomplete (layers, hidden, heads)")
    seq = _num(row, "seq_len", int)
    if not seq:
        raise Skip("no seq_len")
    gpus = _num(row, "num_accel", int)
    if not gpus:
        raise Skip("no num_accel")
    ffn = _num(row, "ffn_hidden", int)
    notes = row.get("notes") or ""
    hd = re.search(r"head dim (\d+)", notes)
    kv = _num(row, "kv_heads", int)
    mlp = "gelu" if ffn == 4 * h else "swiglu"
    try:
        model = ModelShape(
            name=row.get("model") or rid, n_layers=L, d_model=h, n_heads=heads,
            n_kv_heads=kv if kv and kv != heads else None, d_ff=ffn or 4 * h,
            vocab_size=_num(row, "vocab", int) or 51200, context=seq, mlp=mlp,
            head_size=int(hd.group(1)) if hd else None,
            tie_embeddings="palm" in (row.get("model") or "").lower())
    except ValueError as e:
        raise Skip(f"model shape invalid: {e}") from None
    hw_key, hw = _hardware(row.get("accelerator") or "")
    tp, pp = _num(row, "TP", int) or 1, _num(row, "PP", int) or 1
    cp, ep = _num(row, "CP", int) or 1, _num(row, "EP", int) or 1
    dp = _num(row, "DP", int) or gpus // (tp * pp * cp)
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
    v = _num(row, "vpp", int) or (2 if "interleaved" in notes.lower() else 1)
    sched = "interleaved" if pp > 1 and v > 1 and m % pp == 0 and pp * v <= L else "1f1b"
    if sched != "interleaved":
        v = 1
    try:
        plan = ParallelPlan(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep if dp % ep == 0 else 1,
                            zero=_zero(row.get("zero_or_fsdp") or ""), sp=tp > 1,
                            micro_batches=m, schedule=sched, virtual_stages=v,
                            recompute=_recompute(row.get("recompute") or ""))
        split_batch(tokens, seq, plan)
    except ValueError as e:
        raise Skip(f"layout invalid: {e}") from None
    if pp > L:
        raise Skip(f"PP {pp} exceeds layers {L}")
    mfu, hfu = _num(row, "mfu_pct"), _num(row, "hfu_pct")
    tfl = _num(row, "tflops_per_accel_reported")
    kind = "hardware" if "hardware" in (row.get("tflops_kind") or "").lower() else "model"
    if mfu:
        metric, rep = "mfu", mfu / 100
    elif hfu:
        metric, rep = "hfu", hfu / 100
    elif tfl:
        metric, rep = "tflops", tfl
    else:
        raise Skip("reports none of MFU, HFU or TFLOP/s per accelerator")
    return Case(rid, source_key(row), hw_key, hw, model, plan, tokens, seq, metric, kind, rep)


def predict(case: Case, params: Params) -> float:
    """The model's figure for ``case.metric`` under ``params``."""
    hw = params.apply(case.hw_key, case.hw)
    st = step_time(case.model, case.plan, hw, case.tokens, case.seq_len,
                   **params.step_kwargs())
    if case.metric == "mfu":
        return st.mfu
    if case.metric == "hfu":
        return st.hfu
    flops = st.hardware_flops if case.tflops_kind == "hardware" else st.model_flops
    return flops / st.step_s / st.gpus / 1e12


def cases_and_skips(rows: list[dict]) -> tuple[list[Case], list[Record]]:
    cases, skips = [], []
    for row in rows:
        try:
            cases.append(row_to_case(row))
        except Skip as e:
            skips.append(Record(row.get("id", "?"), source_key(row), None, None, None, str(e)))
    return cases, skips


def score(cases: list[Case], params: Params) -> list[Record]:
    return [Record(c.id, c.source, c.metric, c.reported, predict(c, params)) for c in cases]


def summarize(records: list[Record]) -> dict:
    """MAE and MAPE overall and per source, over priced records. MAE is in percentage
    points for MFU/HFU records and in TFLOP/s for tflops records (reported separately)."""
    def block(recs):
        priced = [r for r in recs if r.predicted is not None]
        if not priced:
            return {"n": 0, "mape": None, "mae_pp": None, "mae_tflops": None}
        frac = [abs(r.error) * 100 for r in priced if r.metric in ("mfu", "hfu")]
        tfl = [abs(r.error) for r in priced if r.metric == "tflops"]
        return {"n": len(priced),
                "mape": sum(r.abs_pct_error for r in priced) / len(priced),
                "mae_pp": sum(frac) / len(frac) if frac else None,
                "mae_tflops": sum(tfl) / len(tfl) if tfl else None}

    sources = sorted({r.source for r in records})
    return {"overall": block(records),
            "per_source": {s: block([r for r in records if r.source == s]) for s in sources},
            "skipped": sum(r.predicted is None for r in records)}


# ---- fitting -------------------------------------------------------------------------------
def _loss(cases: list[Case], params: Params) -> float:
    return sum((predict(c, params) / c.reported - 1) ** 2 for c in cases)


def _golden(f, lo: float, hi: float, iters: int) -> float:
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


BOUNDS = {"eta": (0.2, 1.0), "bw_eff": (0.2, 1.0), "overlap_fraction": (0.0, 1.0),
          "overhead_width": (0.0, 2000.0)}
SCALARS = ("bw_eff", "overlap_fraction", "overhead_width")


def _nelder_mead(f, x0: list[float], step: float = 0.1, max_evals: int = 400,
                 tol: float = 1e-12) -> list[float]:
    """Minimise ``f`` over the unit box [0, 1]^n (points are clipped into it)."""
    clip = lambda x: [min(1.0, max(0.0, v)) for v in x]  # noqa: E731
    n = len(x0)
    pts = [clip(x0)] + [clip([v + (step if k == i else 0.0) for k, v in enumerate(x0)])
                        for i in range(n)]
    vals = [f(x) for x in pts]
    evals = len(pts)
    while evals < max_evals:
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        cen = [sum(p[k] for p in pts[:-1]) / n for k in range(n)]
        refl = clip([c + (c - w) for c, w in zip(cen, pts[-1], strict=True)])
        fr = f(refl)
        evals += 1
        if fr < vals[0]:
            exp = clip([c + 2 * (c - w) for c, w in zip(cen, pts[-1], strict=True)])
            fe = f(exp)
            evals += 1
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = clip([c + 0.5 * (w - c) for c, w in zip(cen, pts[-1], strict=True)])
            fc = f(con)
            evals += 1
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                best = pts[0]
                pts = [best] + [[b + 0.5 * (v - b) for b, v in zip(best, p, strict=True)]
                                for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
                evals += n
    return pts[min(range(n + 1), key=vals.__getitem__)]


def fit(cases: list[Case], start: Params | None = None, sweeps: int = 2,
        iters: int = 25, max_evals: int = 400) -> Params:
    """Least squares on relative error, within physical bounds: eta per accelerator
    generation in the table, one bandwidth efficiency, one overlap fraction, one non-matmul
    overhead width h0. Coordinate descent (golden-section search per parameter) finds the
    basin; Nelder-Mead then follows the eta-h0 valley (both scale compute time)."""
    if not cases:
        raise ValueError("no priceable rows to fit on; check the runs table")
    p = start or Params()
    gens = sorted({generation(c.hw_key) for c in cases})
    p = p.replace(eta={g: p.eta.get(g, 0.5) for g in gens})
    for _ in range(sweeps):
        for g in gens:
            sub = [c for c in cases if generation(c.hw_key) == g]

            def f_eta(x, g=g, sub=sub, p=p):
                return _loss(sub, p.replace(eta={**p.eta, g: x}))

            p = p.replace(eta={**p.eta, g: _golden(f_eta, *BOUNDS["eta"], iters)})
        for name in SCALARS:
            best = _golden(lambda x, name=name, p=p: _loss(cases, p.replace(**{name: x})),
                           *BOUNDS[name], iters)
            p = p.replace(**{name: best})
    names = [("eta", g) for g in gens] + [(n, None) for n in SCALARS]

    def to_params(u: list[float]) -> Params:
        eta, kw = {}, {}
        for (name, g), x in zip(names, u, strict=True):
            lo, hi = BOUNDS[name]
            if g is None:
                kw[name] = lo + x * (hi - lo)
            else:
                eta[g] = lo + x * (hi - lo)
        return p.replace(eta=eta, **kw)

    def to_unit(q: Params) -> list[float]:
        out = []
        for name, g in names:
            lo, hi = BOUNDS[name]
            v = q.eta[g] if g is not None else getattr(q, name)
            out.append((v - lo) / (hi - lo))
        return out

    u = _nelder_mead(lambda x: _loss(cases, to_params(x)), to_unit(p), max_evals=max_evals)
    q = to_params(u)
    return q if _loss(cases, q) <= _loss(cases, p) else p


def leave_one_out(cases: list[Case], start: Params | None = None, sweeps: int = 1,
                  iters: int = 20) -> list[Record]:
    """Refit without each row in turn and predict it: the honest error."""
    out = []
    for i, c in enumerate(cases):
        rest = cases[:i] + cases[i + 1:]
        if not any(generation(x.hw_key) == generation(c.hw_key) for x in rest):
            out.append(Record(c.id, c.source, c.metric, c.reported, None,
                              f"no other row on {generation(c.hw_key)} to fit its eta"))
            continue
        p = fit(rest, start, sweeps, iters)
        out.append(Record(c.id, c.source, c.metric, c.reported, predict(c, p)))
    return out


def write_params(params: Params, path: str | Path, provenance: list[str]) -> Path:
    lines = [f"# {line}" for line in provenance]
    lines += [f"bw_eff = {params.bw_eff:.4f}",
              f"overlap_fraction = {params.overlap_fraction:.4f}",
              f"overhead_width = {params.overhead_width:.1f}",
              f'dp_algorithm = "{params.dp_algorithm}"', "", "[eta]"]
    lines += [f'"{k}" = {v:.4f}' for k, v in sorted(params.eta.items())]
    out = Path(path)
    out.write_text("\n".join(lines) + "\n")
    return out


# ---- the `paratrain validate` command body ------------------------------------------------------
HOLDOUT = ("megascale_530b_megatronlm_11200", "bloom_176b", "glm_130b",
           "llama3_405b_16384_seq131072", "narayanan21_t1_1008.0B", "dgxc_gpt3_175b_2048")
UNFITTED = Params(eta={}, bw_eff=1.0, overlap_fraction=OVERLAP_FRACTION, overhead_width=0.0,
                  dp_algorithm="ring")


def params_dict(p: Params) -> dict:
    return {"eta": dict(p.eta), "bw_eff": p.bw_eff, "overlap_fraction": p.overlap_fraction,
            "overhead_width": p.overhead_width, "dp_algorithm": p.dp_algorithm}


def run_validate(runs: str | None, params_path: str | None, unfitted: bool, do_fit: bool,
                 holdout: tuple[str, ...], out: str | None) -> dict:
    """Everything `paratrain validate` reports, as one dict."""
    rows = read_runs(runs)
    cases, skips = cases_and_skips(rows)
    result: dict = {"runs": str(runs or DEFAULT_RUNS)}
    if do_fit:
        unknown = sorted(set(holdout) - {c.id for c in cases} - {s.id for s in skips})
        if unknown:
            raise ValueError(f"holdout id(s) {', '.join(unknown)} are not in the table; "
                             "pass ids from its 'id' column")
        train = [c for c in cases if c.id not in holdout]
        held = [c for c in cases if c.id in holdout]
        params = fit(train)
        loo = leave_one_out(train, params)
        result["fit"] = {"params": params_dict(params), "train_rows": len(train),
                         "loo": summarize(loo), "loo_records": [r.as_dict() for r in loo],
                         "holdout_ids": [c.id for c in held]}
        if held:
            h = score(held, params)
            result["fit"]["holdout"] = summarize(h)
        if out:
            prov = [
                "Fitted free parameters of the paratrain systems model.",
                f"Written by `paratrain validate --fit` on {len(train)} rows of "
                f"{Path(runs).name if runs else 'calibration.csv'} (sources in that table),",
                f"holding out: {', '.join(c.id for c in held) or 'none'}.",
                f"Leave-one-out MAPE {result['fit']['loo']['overall']['mape']:.2f}% on the "
                "fitted rows"
                + (f"; held-out MAPE {result['fit']['holdout']['overall']['mape']:.2f}%."
                   if held else "."),
                "eta: dense matmul efficiency per accelerator generation; bw_eff: achieved /",
                "nominal link bandwidth; overlap_fraction: compute share that hides the",
                "data-parallel sync; overhead_width h0: compute time x (1 + h0 / d_model).",
            ]
            result["fit"]["written"] = str(write_params(params, out, prov))
    elif unfitted:
        params = UNFITTED
    else:
        params = load_params(params_path)
    records = score(cases, params) + skips
    order = {r["id"]: i for i, r in enumerate(rows)}
    records.sort(key=lambda r: order.get(r.id, 0))
    result["params"] = params_dict(params)
    result["records"] = [r.as_dict() for r in records]
    result["summary"] = summarize(records)
    return result


def render_validate(res: dict, console=None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = console or Console()

    def fmt(metric, x):
        if x is None:
            return "-"
        return f"{x:.1f}" if metric == "tflops" else f"{100 * x:.1f}%"

    t = Table(title=f"Published runs: predicted vs reported ({res['runs']})",
              box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for c in ("id", "metric", "reported", "predicted", "error %"):
        t.add_column(c, justify="left" if c == "id" else "right", no_wrap=c != "id")
    for r in res["records"]:
        if r["skipped_reason"]:
            t.add_row(r["id"], "-", "-", "-", f"skipped: {r['skipped_reason']}")
            continue
        t.add_row(r["id"], r["metric"], fmt(r["metric"], r["reported"]),
                  fmt(r["metric"], r["predicted"]), f"{r['abs_pct_error']:.1f}")
    con.print(t)

    def line(name, s):
        mae = f"MAE {s['mae_pp']:.2f} pp" if s["mae_pp"] is not None else ""
        if s["mae_tflops"] is not None:
            mae += f" {s['mae_tflops']:.1f} TFLOP/s"
        return f"{name}: n={s['n']}, MAPE {s['mape']:.2f}%, {mae}" if s["n"] else \
            f"{name}: no priced rows"

    con.print(line("overall", res["summary"]["overall"]))
    for src, s in res["summary"]["per_source"].items():
        con.print("  " + line(src, s))
    p = res["params"]
    con.print("parameters: eta " + ", ".join(f"{k} {v:.3f}" for k, v in p["eta"].items())
              + f"; bw_eff {p['bw_eff']:.3f}; overlap_fraction {p['overlap_fraction']:.3f}; "
              f"overhead_width {p['overhead_width']:.0f}; dp sync {p['dp_algorithm']}")
    if "fit" in res:
        f = res["fit"]
        con.print(f"[bold]fit[/] on {f['train_rows']} rows; "
                  + line("leave-one-out", f["loo"]["overall"]))
        if "holdout" in f:
            con.print(f"held out ({', '.join(f['holdout_ids'])}): "
                      + line("held-out", f["holdout"]["overall"]))
        if "written" in f:
            con.print(f"wrote {f['written']}")
