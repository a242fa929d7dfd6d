"""The systems model's free parameters, scoring against published runs, and fitting.

We predict each case's reported quantity like for like:

- ``mfu``: model FLOPs (6N + 12 L H Q T per token) / (step x GPUs x peak);
- ``hfu``: adds recomputation (Narayanan et al. 2021's eq. 3 counts the recompute forward);
- ``tflops``: achieved TFLOP/s per GPU, model or hardware FLOPs as the row's
  ``tflops_kind`` says.

Errors: MAE in percentage points (or TFLOP/s) and MAPE, overall and per source.

The free parameters (:class:`Params`) are few and physical: the matmul efficiency eta per
accelerator generation, one bandwidth efficiency applied to every link, the share of
compute that data-parallel sync can hide under (backward, 2/3 by default) and a
non-matmul overhead width. :func:`fit` finds them by least squares on relative error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.systems._toml import tomllib
from paratrain.systems.catalogue import DATA_DIR
from paratrain.systems.hardware import Hardware
from paratrain.systems.runs import Case, Record
from paratrain.systems.step_time import OVERLAP_FRACTION, step_time

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
    p = Path(path) if path else FITTED
    if not p.is_file():
        raise ValueError(f"fitted parameters {str(p)!r} do not exist; run validate --fit")
    with p.open("rb") as f:
        d = tomllib.load(f)
    return Params(eta=dict(d.get("eta", {})), bw_eff=d.get("bw_eff", 1.0),
                  overlap_fraction=d.get("overlap_fraction", OVERLAP_FRACTION),
                  overhead_width=d.get("overhead_width", 0.0),
                  dp_algorithm=d.get("dp_algorithm", "auto"))


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
        iters: int = 25, max_evals: int = 400, restarts: int = 3) -> Params:
    """Least squares on relative error, within physical bounds: eta per accelerator
    generation in the table, one bandwidth efficiency, one overlap fraction, one non-matmul
    overhead width h0. Coordinate descent (golden-section search per parameter) finds the
    basin; Nelder-Mead then follows the eta-h0 valley (both scale compute time), restarted
    from its best point up to ``restarts`` times while that lowers the loss by > 0.1%."""
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

    def loss_u(x: list[float]) -> float:
        return _loss(cases, to_params(x))

    # Restart from the best point while that helps: a simplex that has collapsed against
    # a bound (bw_eff at 1, say) stops short of the valley's floor; a fresh one does not.
    u, best = to_unit(p), _loss(cases, p)
    for _ in range(restarts + 1):
        v = _nelder_mead(loss_u, u, max_evals=max_evals)
        lv = loss_u(v)
        if lv >= best * (1 - 1e-3):
            if lv < best:
                u, best = v, lv
            break
        u, best = v, lv
    return to_params(u)


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
