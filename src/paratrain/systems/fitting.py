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
flat ring). :func:`fit_with_errors` minimises the absolute relative error inside each parameter's
physical bounds with ``scipy.optimize.least_squares`` and reports each parameter's
uncertainty from its Jacobian; :func:`leave_one_out` refits without each row in turn,
warm-started from the full fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from paratrain.config import read_toml
from paratrain.systems.fit_rows import free_params, unseen_start
from paratrain.systems.gemm import FAMILIES, family
from paratrain.systems.partial_recompute import blend
from paratrain.systems.row_engine import case_attention, case_engine, fp8_scaling
from paratrain.systems.runs import DATA_DIR, Case, Record
from paratrain.systems.step_model import Breakdown, predict_step
from paratrain.systems.step_params import (
    BOUNDS,
    SCALARS,
    StepParams,
)

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
        # any chip family a fit can write (gemm.FAMILIES), not only those with a start
        # value: a family that first gets rows is fitted and must load; others are stale
        known[t] = {k: _param(p, f"{t}.{k}", v, BOUNDS[t]) for k, v in table.items()
                    if k in FAMILIES}
    return base.replace(gemm_eff={**base.gemm_eff, **known["gemm_eff"]},
                        attn_eff={**base.attn_eff, **known["attn_eff"]}, **kw)


def _param(path: Path, key: str, v: object, bounds: tuple[float, float]) -> float:
    lo, hi = bounds
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ValueError(f"{str(path)!r}: {key} = {v!r} is outside its physical range "
                         f"[{lo:g}, {hi:g}] (systems/step_params.py); use a value in it")
    return float(v)


def breakdown(case: Case, params: StepParams) -> Breakdown:
    """The step model's breakdown of a case; one that recomputes a share of its blocks
    is the blend of none and all (:mod:`paratrain.systems.partial_recompute`)."""
    def at(plan):
        return predict_step(case.model, plan, case.hw, case.tokens, case.seq_len, params,
                            case_engine(case), case_attention(case),
                            getattr(case, "shard_group", None), fp8_scaling(case),
                            getattr(case, "rerun", ()))

    share = getattr(case, "recompute_share", 1.0)
    if case.plan.recompute != "full" or share >= 1.0:
        return at(case.plan)
    return blend(at(dataclasses.replace(case.plan, recompute="none")), at(case.plan), share)


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


# ---- fitting: scipy's bounded, robust least squares in the unit box of the bounds ----------
F_SCALE = 0.0015  # soft_l1's knee: beyond 0.15% a row costs |r| (the MAPE), below it r^2
AT_BOUND = 1e-3  # within 0.1% of its range of a bound: the bound holds it, not the rows
NOT_PINNED = 0.25  # a standard deviation over a quarter of its range: the rows leave it free


def _label(name: str, g: str | None) -> str:
    """A parameter as systems/step_params.py's table names it: ``gemm_eff[a100]``."""
    return name if g is None else f"{name}[{g}]"


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


@dataclass(frozen=True)
class Fitted:
    """A fit's parameters and, per parameter (:func:`_label`), its standard deviation in
    the parameter's own unit, absent where the rows do not pin it down; ``bound`` names
    the parameters the fit left at a bound of their physical range ("lower" / "upper");
    ``fitted`` those it varied (a family with under MIN_ROWS rows keeps its start)."""

    params: StepParams
    sigma: dict
    bound: dict
    fitted: tuple
    rows: int
    nfev: int

    def as_dict(self) -> dict:
        """For the JSON result: every parameter with its value, sigma (None: not pinned)
        and bound, and the lists a reader wants: pinned by the rows, pinned but pressed
        against a bound (the rows would take it outside its physical range: a sign of a
        cost the model lacks), and not pinned."""
        flat = {**{_label(t, k): v for t in ("gemm_eff", "attn_eff")
                   for k, v in getattr(self.params, t).items()},
                **{k: getattr(self.params, k) for k in SCALARS}}
        pinned = [k for k in flat if k in self.sigma]
        return {"params": {k: {"value": v, "sigma": self.sigma.get(k),
                               "bound": self.bound.get(k), "fitted": k in self.fitted}
                           for k, v in flat.items()},
                "pinned": [k for k in pinned if k not in self.bound],
                "at_bound": [k for k in pinned if k in self.bound],
                "not_pinned": [k for k in flat if k not in self.sigma],
                "rows": self.rows, "nfev": self.nfev}


def fit_with_errors(cases: list[Case], start: StepParams | None = None, iters: int = 60,
                    tol: float = 1e-9) -> Fitted:
    """Least absolute relative error (the MAPE that ``validate`` reports), each parameter
    inside its physical bound (:data:`paratrain.systems.step_params.BOUNDS`), and each
    parameter's uncertainty from the Jacobian at the solution (:func:`_sigmas`).

    ``scipy.optimize.least_squares``: trust-region reflective in the unit box of the
    bounds, a two-point Jacobian at the 1e-4 step the model's kinks tolerate, and
    ``loss="soft_l1"`` with ``f_scale`` F_SCALE: beyond that knee a row costs its absolute
    error, so the fit minimises the MAPE, and a row the model cannot explain (a run with
    an unrecorded slowdown) pulls the parameters no harder than a row just past the knee,
    where a least-squares fit would follow it. A robust loss rather than reweighting
    rounds over least_squares: it is the same objective (reweighting by
    1 / max(|r|, knee) has soft_l1's fixed point to within the knee) in one solve, and
    the Jacobian scipy returns is then that of the robust cost, which the uncertainty
    needs. The knee was chosen on leave-one-out over the fit rows (never the held-out
    ones): 0.15% beat 0.3%, 0.5%, 1% and 2%; at 0.05% the solve nears its evaluation
    cap for no better in-table error. ``iters`` bounds the evaluations."""
    import numpy as np
    from scipy.optimize import least_squares

    if not cases:
        raise ValueError("no priceable rows to fit on; check the runs table")
    base = start or StepParams()
    names = free_params(cases)

    def resid(u) -> np.ndarray:
        p = _to_params(u, names, base)
        return np.array([predict(c, p) / c.reported - 1 for c in cases])

    res = least_squares(resid, np.array(_to_unit(base, names)), bounds=(0.0, 1.0),
                        loss="soft_l1", f_scale=F_SCALE, diff_step=1e-4, ftol=tol,
                        xtol=tol, gtol=tol, max_nfev=iters)
    sigma_u = _sigmas(res.jac, 2 * res.cost, len(cases))
    sigma, bound = {}, {}
    for k, (name, g) in enumerate(names):
        lo, hi = BOUNDS[name]
        if sigma_u[k] is not None:
            sigma[_label(name, g)] = sigma_u[k] * (hi - lo)
        if min(res.x[k], 1 - res.x[k]) < AT_BOUND:
            bound[_label(name, g)] = "lower" if res.x[k] < 0.5 else "upper"
    return Fitted(_to_params(res.x, names, base), sigma, bound,
                  tuple(_label(*n) for n in names), len(cases), res.nfev)


def _sigmas(jac, cost: float, rows: int) -> list[float | None]:
    """Standard deviations of the unit-box parameters, None for those the rows leave free.

    Covariance = pinv(J^T J) x the residual variance (the robust cost over rows minus the
    directions the rows pin), the way ``scipy.optimize.curve_fit`` takes it, through the
    SVD of J: a direction with a zero singular value (a parameter no row depends on, or
    two that trade off exactly) has no variance in the pseudo-inverse, so a parameter
    that direction moves (a component of 0.1 or more) is reported not pinned, as is
    one whose standard deviation exceeds a quarter of its range (NOT_PINNED)."""
    import numpy as np

    _, s, vt = np.linalg.svd(jac, full_matrices=False)
    null = s <= np.finfo(float).eps * max(jac.shape) * (s[0] if s.size else 0.0)
    rank = int((~null).sum())
    if rows <= rank:
        return [None] * jac.shape[1]
    var = np.sum((vt[~null] / s[~null, None]) ** 2, axis=0) * cost / (rows - rank)
    free = np.sum(vt[null] ** 2, axis=0)
    return [None if free[k] > 0.01 or np.sqrt(var[k]) > NOT_PINNED else float(np.sqrt(var[k]))
            for k in range(jac.shape[1])]


def fit(cases: list[Case], start: StepParams | None = None, iters: int = 60,
        tol: float = 1e-9) -> StepParams:
    """The parameters of :func:`fit_with_errors`."""
    return fit_with_errors(cases, start, iters, tol).params


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


def leave_source_out(train: list[Case], cases: list[Case], start: StepParams,
                     iters: int = 10) -> list[Record]:
    """Refit without each source's rows in turn and predict all of that source's
    ``cases`` (fit and held out): the error on a source the fit never saw, which is how
    the model meets a new table. Warm-started from ``start`` (the full fit), except that a
    chip family only the left-out source informs goes back to where a fit that never
    saw it would leave it (:func:`~paratrain.systems.fit_rows.unseen_start`)."""
    out = []
    for src in sorted({c.source for c in cases}):
        rest = [c for c in train if c.source != src]
        p = fit(rest, unseen_start(start, rest), iters) if rest else start
        out += [Record(c.id, c.source, c.metric, c.reported, predict(c, p))
                for c in cases if c.source == src]
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
