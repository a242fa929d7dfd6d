"""Scoring the systems model against published runs, and fitting its free parameters.

We predict each case's reported quantity like for like:

- ``mfu``: model FLOPs (6N + 12 L H Q T per token) / (step x GPUs x peak);
- ``hfu``: adds recomputation (Narayanan et al. 2021's eq. 3 counts the recompute forward);
- ``tflops``: achieved TFLOP/s per GPU, model or hardware FLOPs as the row's
  ``tflops_kind`` says.

Errors: MAE in percentage points (or TFLOP/s) and MAPE, overall and per source.

The default model is :func:`paratrain.systems.step_model.predict_step` with the physical
parameters of :class:`paratrain.systems.step_params.StepParams`; ``reference=True`` prices
with docs/design.md's model (:func:`paratrain.systems.step_time.step_time`, catalogue eta,
flat ring). :func:`fit` is a projected, reweighted Levenberg-Marquardt on absolute
relative error inside each parameter's physical bounds; :func:`leave_one_out` refits
without each row in turn, warm-started from the full fit.
"""

from __future__ import annotations

from pathlib import Path

from paratrain.config import read_toml
from paratrain.systems.gemm import family
from paratrain.systems.row_engine import case_engine  # noqa: F401 - its home moved
from paratrain.systems.runs import DATA_DIR, Case, Record
from paratrain.systems.step_model import Breakdown, predict_step
from paratrain.systems.step_params import BOUNDS, SCALARS, StepParams

FITTED = DATA_DIR / "fitted.toml"
Params = StepParams


def generation(hw_key: str) -> str:
    """Accelerators that share a chip share its efficiencies (A100 40/80 GB; H100/H800/H200;
    every TPU): :func:`paratrain.systems.gemm.family`."""
    return family(hw_key)


def load_params(path: str | Path | None = None) -> StepParams:
    """Fitted parameters (default: the shipped ``data/fitted.toml``), each checked against
    its physical range (:data:`paratrain.systems.step_params.BOUNDS`, the table in that
    module's docstring): a value outside it, a key that is no parameter (a hardware file
    passed by mistake) or a value that is no number is one ValueError naming the file."""
    p = Path(path) if path else FITTED
    if not p.is_file():
        raise ValueError(f"fitted parameters {str(p)!r} do not exist; run validate --fit")
    d = read_toml(p)
    unknown = sorted(set(d) - set(SCALARS) - {"gemm_eff", "attn_eff"})
    if unknown:
        raise ValueError(f"{str(p)!r} has key(s) {', '.join(unknown)} that are no step-model "
                         f"parameter (is it a parameters file?); its keys are "
                         f"{', '.join(SCALARS)}, [gemm_eff], [attn_eff]")
    base = StepParams()
    kw = {k: _param(p, k, d[k], BOUNDS[k]) for k in SCALARS if k in d}
    known = {}
    for t in ("gemm_eff", "attn_eff"):
        table = d.get(t, {})
        if not isinstance(table, dict):
            raise ValueError(f"{t} in {str(p)!r} must be a table [{t}] of family = value")
        known[t] = {k: _param(p, f"{t}.{k}", v, BOUNDS[t]) for k, v in table.items()
                    if k in getattr(base, t)}  # a stale family key is no parameter
    return base.replace(gemm_eff={**base.gemm_eff, **known["gemm_eff"]},
                        attn_eff={**base.attn_eff, **known["attn_eff"]}, **kw)


def _param(path: Path, key: str, v: object, bounds: tuple[float, float]) -> float:
    lo, hi = bounds
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ValueError(f"{str(path)!r}: {key} = {v!r} is outside its physical range "
                         f"[{lo:g}, {hi:g}] (systems/step_params.py); use a value in it")
    return float(v)


def case_attention(case: Case) -> str | None:
    """Eager attention for a run in fp16 (before FlashAttention's adoption in 2022-23),
    else the engine's kernel (None)."""
    return "eager" if "fp16" in (getattr(case, "precision", "") or "").lower() else None


def breakdown(case: Case, params: StepParams) -> Breakdown:
    return predict_step(case.model, case.plan, case.hw, case.tokens, case.seq_len, params,
                        case_engine(case), case_attention(case),
                        getattr(case, "shard_group", None),
                        "fp8" in (getattr(case, "precision", "") or "").lower())


def source_count(case: Case) -> str:
    """How the row's source counts model FLOPs (``Case.flops_count``, else its engine's;
    :data:`paratrain.cost.shapes.FLOP_COUNTS`)."""
    return case.flops_count or case_engine(case).flops_count


def _figure(case: Case, st) -> float:
    """The step's figure for ``case.metric``, with model FLOPs counted the way the row's
    source counts them (:func:`source_count`): a source that leaves the input-embedding
    lookup out reports fewer FLOPs for the same step than our 6N."""
    count = source_count(case)
    m, seq = case.model, case.seq_len
    less = (m.flops_per_token(seq) - m.flops_per_token(seq, count)) * case.tokens
    model, hardware = st.model_flops - less, st.hardware_flops - less
    per_s = st.step_s * st.gpus
    if case.metric == "mfu":
        return model / (per_s * st.peak_flops)
    if case.metric == "hfu":
        return hardware / (per_s * st.peak_flops)
    return (hardware if case.tflops_kind == "hardware" else model) / per_s / 1e12


def predict(case: Case, params: StepParams | None = None, reference: bool = False) -> float:
    """The model's figure for ``case.metric``: the step model under ``params``, or
    docs/design.md's reference model."""
    if reference:
        from paratrain.systems.step_time import step_time

        return _figure(case, step_time(case.model, case.plan, case.hw, case.tokens,
                                       case.seq_len))
    return _figure(case, breakdown(case, params or StepParams()))


def score(cases: list[Case], params: StepParams | None, reference: bool = False
          ) -> list[Record]:
    return [Record(c.id, c.source, c.metric, c.reported, predict(c, params, reference))
            for c in cases]


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


# ---- fitting: projected Levenberg-Marquardt in the unit box of the bounds ------------------
MIN_ROWS = 3  # a generation's efficiencies are fitted only with this many rows on it


def _names(cases: list[Case]) -> list[tuple[str, str | None]]:
    """The parameters the rows can inform: each generation's GEMM (and FlashAttention-2)
    efficiency when it has MIN_ROWS rows, and the scalars."""
    count: dict = {}
    for c in cases:
        g = generation(c.hw.name)
        count[g] = count.get(g, 0) + 1
    gens = sorted(g for g, n in count.items() if n >= MIN_ROWS)
    return ([("gemm_eff", g) for g in gens] + [("attn_eff", g) for g in gens if g != "tpu"]
            + [(s, None) for s in SCALARS])


def _to_params(u, names, base: StepParams) -> StepParams:
    dicts = {"gemm_eff": dict(base.gemm_eff), "attn_eff": dict(base.attn_eff)}
    kw = {}
    for (name, g), x in zip(names, u, strict=True):
        lo, hi = BOUNDS[name]
        v = lo + min(1.0, max(0.0, float(x))) * (hi - lo)
        if g is None:
            kw[name] = v
        else:
            dicts[name][g] = v
    return base.replace(**dicts, **kw)


def _to_unit(p: StepParams, names) -> list[float]:
    out = []
    for name, g in names:
        lo, hi = BOUNDS[name]
        v = getattr(p, name) if g is None else (
            p.gemm_for(g) if name == "gemm_eff" else p.attn_eff.get(g, 0.5))
        out.append(min(1.0, max(0.0, (v - lo) / (hi - lo))))
    return out


def fit(cases: list[Case], start: StepParams | None = None, iters: int = 30,
        tol: float = 1e-9) -> StepParams:
    """Least absolute relative error (the MAPE that ``validate`` reports), each parameter
    inside its physical bound (:data:`paratrain.systems.step_params.BOUNDS`).

    Iteratively reweighted Levenberg-Marquardt: each Gauss-Newton step solves the normal
    equations weighted by 1 / max(|r|, 1%), which minimise sum |r| at their fixed point;
    a step is kept only if sum |r| falls, and steps are projected back into the box. A
    least-squares fit lets the few rows the model cannot explain (a run with an
    unrecorded slowdown) pull every parameter toward them; this one does not."""
    import numpy as np

    if not cases:
        raise ValueError("no priceable rows to fit on; check the runs table")
    base = start or StepParams()
    names = _names(cases)

    def resid(u) -> np.ndarray:
        p = _to_params(u, names, base)
        return np.array([predict(c, p) / c.reported - 1 for c in cases])

    u = np.array(_to_unit(base, names))
    r = resid(u)
    cost, lam, h = float(np.abs(r).sum()), 1e-2, 1e-4
    for _ in range(iters):
        J = np.empty((len(cases), len(u)))
        for k in range(len(u)):
            du = u.copy()
            step = h if u[k] + h <= 1 else -h
            du[k] += step
            J[:, k] = (resid(du) - r) / step
        w = 1.0 / np.maximum(np.abs(r), 0.01)
        g, A = J.T @ (w * r), J.T @ (w[:, None] * J)
        improved = False
        for _ in range(8):
            delta = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-9), -g)
            v = np.clip(u + delta, 0.0, 1.0)
            rv = resid(v)
            cv = float(np.abs(rv).sum())
            if cv < cost:
                improved = cost - cv > tol * max(cost, 1e-12)
                u, r, cost, lam = v, rv, cv, max(lam / 3, 1e-7)
                break
            lam *= 4
        if not improved:
            break
    return _to_params(u, names, base)


def leave_one_out(cases: list[Case], start: StepParams | None = None, iters: int = 4
                  ) -> list[Record]:
    """Refit without each row in turn (warm-started from ``start``, the full fit) and
    predict it: the honest error."""
    out = []
    for i, c in enumerate(cases):
        rest = cases[:i] + cases[i + 1:]
        p = fit(rest, start, iters)
        out.append(Record(c.id, c.source, c.metric, c.reported, predict(c, p)))
    return out


def write_params(params: StepParams, path: str | Path, provenance: list[str]) -> Path:
    lines = [f"# {line}" for line in provenance]
    lines += [f"{k} = {getattr(params, k):.6g}" for k in SCALARS]
    for table in ("gemm_eff", "attn_eff"):
        lines += ["", f"[{table}]"]
        lines += [f'"{k}" = {v:.4f}' for k, v in sorted(getattr(params, table).items())]
    out = Path(path)
    out.write_text("\n".join(lines) + "\n")
    return out
