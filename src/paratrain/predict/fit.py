"""The CPU fit that calibrates the run prediction from single-process runs: eta and the
fixed costs per pass and per step, by non-negative least squares
(:func:`fit_from_runs`; ``paratrain check-model`` runs it)."""

from __future__ import annotations

from paratrain.config import ModelConfig
from paratrain.cost.hardware import Hardware
from paratrain.cost.shapes import as_shape
from paratrain.predict.machine import MachineModel
from paratrain.predict.step import _flops_block


def fit_from_runs(mcfg: ModelConfig, runs: list[tuple[int, int, float]], hw: Hardware,
                  thread_peak: float) -> MachineModel:
    """Least squares t = F / R + units x pass_s + step_s over one-process runs.

    ``runs``: (global_batch, micro_batches, seconds per step on a whole core: CPU time)
    of the same model. F is the step's FLOPs, units = micro_batches x (blocks + 1). Needs
    runs that differ in both batch and micro-batches (at least 3). eta = R / thread_peak.
    """
    if len(runs) < 3:
        raise ValueError(f"{len(runs)} runs cannot fit 3 parameters; pass at least 3")
    rows, ts = [], []
    for gb, m, t in runs:
        f = mcfg.n_layers * _flops_block(mcfg, gb * mcfg.context, 1) + \
            gb * mcfg.context * as_shape(mcfg).head_flops_per_token()
        rows.append((f, m * (mcfg.n_layers + 1), 1.0))
        ts.append(t)
    inv_r, pass_s, step_s = _nnls3(rows, ts)
    if inv_r <= 0:
        raise ValueError("the fit found no FLOP-proportional time; use larger batches")
    return MachineModel(hw, 1.0 / inv_r / thread_peak, thread_peak, pass_s, step_s,
                        fitted=True, source="fit")


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination for a small square system; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[piv][c]) < 1e-300:
            return None
        m[c], m[piv] = m[piv], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


def _nnls3(rows: list[tuple[float, ...]], ts: list[float]) -> list[float]:
    """Non-negative least squares for 3 unknowns: try every subset of free unknowns
    (8 of them), keep the best feasible one. Columns are scaled first."""
    k = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    x_rows = [[r[j] / scale[j] for j in range(k)] for r in rows]
    best, best_err = [0.0] * k, sum(t * t for t in ts)
    for mask in range(1, 1 << k):
        free = [j for j in range(k) if mask >> j & 1]
        ata = [[sum(r[i] * r[j] for r in x_rows) for j in free] for i in free]
        atb = [sum(r[i] * t for r, t in zip(x_rows, ts, strict=True)) for i in free]
        sol = _solve3(ata, atb)
        if sol is None or min(sol) < 0:
            continue
        x = [0.0] * k
        for j, v in zip(free, sol, strict=True):
            x[j] = v
        err = sum((sum(r[j] * x[j] for j in range(k)) - t) ** 2
                  for r, t in zip(x_rows, ts, strict=True))
        if err < best_err - 1e-18:
            best, best_err = x, err
    return [best[j] / scale[j] for j in range(k)]
