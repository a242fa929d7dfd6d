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
                  thread_peak: float, step_s: float | None = None) -> MachineModel:
    """Least squares t = F / R + units x pass_s + step_s over one-process runs.

    ``runs``: (global_batch, micro_batches, seconds per step on a whole core: CPU time)
    of the same model. F is the step's FLOPs, units = micro_batches x (blocks + 1). Needs
    runs that differ in both batch and micro-batches (at least 3). eta = R / thread_peak.
    ``step_s`` given (the runs' measured CPU outside their passes, `paratrain
    check-model`), only R and pass_s are fitted, to t - step_s: as an intercept of four
    runs it came out anywhere from 2.5 to 12.9 ms in five fits of one evening on the
    2-core box, and the 8-rank plans, whose ranks do little else, moved with it.
    """
    if len(runs) < 3:
        raise ValueError(f"{len(runs)} runs cannot fit 3 parameters; pass at least 3")
    rows, ts = [], []
    for gb, m, t in runs:
        f = mcfg.n_layers * _flops_block(mcfg, gb * mcfg.context, 1) + \
            gb * mcfg.context * as_shape(mcfg).head_flops_per_token()
        rows.append((f, m * (mcfg.n_layers + 1), 1.0))
        ts.append(t)
    if step_s is None:
        inv_r, pass_s, step_s = _nnls3(rows, ts)
    else:
        inv_r, pass_s = _nnls3([r[:2] for r in rows], [t - step_s for t in ts])
    if inv_r <= 0:
        raise ValueError("the fit found no FLOP-proportional time; use larger batches")
    return MachineModel(hw, 1.0 / inv_r / thread_peak, thread_peak, pass_s, step_s,
                        fitted=True, source="fit")


def _nnls3(rows: list[tuple[float, ...]], ts: list[float]) -> list[float]:
    """Non-negative least squares for 2 or 3 unknowns: every subset of free unknowns (up
    to 8 of them) solved by ``numpy.linalg.lstsq`` on columns scaled to 1, the best feasible one
    kept. A subset whose columns are dependent (lstsq's rank short of it) is skipped, as
    is one with a negative unknown: on 3 unknowns the search is exact and needs no
    active-set iteration."""
    import numpy as np

    a, t = np.asarray(rows, dtype=float), np.asarray(ts, dtype=float)
    k = a.shape[1]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    best, best_err = np.zeros(k), float(t @ t)
    for mask in range(1, 1 << k):
        free = [j for j in range(k) if mask >> j & 1]
        sol, _, rank, _ = np.linalg.lstsq(a[:, free], t, rcond=None)
        if rank < len(free) or sol.min() < 0:
            continue
        x = np.zeros(k)
        x[free] = sol
        err = float(np.sum((a @ x - t) ** 2))
        if err < best_err - 1e-18:
            best, best_err = x, err
    return [float(v) for v in best / scale]
