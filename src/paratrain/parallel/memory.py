"""Memory per rank, measured from real tensor storages, beside the systems model.

Public API::

    meter = ActivationMeter()
    with meter.watch(True):            # around one forward + backward
        engine.forward_backward(...)
    meter.peak_bytes                   # bytes saved for backward (storages, params excluded)
    meter.snapshot(engine)             # model states now (after a gradient reduction)

    measure_states(engine)             # {"params", "grads", "optimizer", "comm_buffers"}
    memory_report(engine, mcfg, plan, tcfg, meter)   # per-rank measured + predicted

How it measures (not the formula):

- Model states: an engine may describe its own tensors through ``state_tensors()``
  (``{"params": [...], "grads": [...], "optimizer": [...], "comm_buffers": [...]}``);
  the plain Engine is read from ``model.parameters()``, ``.grad`` and the optimizer's
  state. Bytes are summed over *distinct storages* (a view into a flat bucket counts
  once, with the bucket's full size, padding included). Optimizer ``step`` counters
  (0-dim) are not model state and are skipped.
- Owned elements: how many elements of the plain model this rank's optimizer holds,
  read from the parameters' placements (:mod:`.placement`: the ZeRO range of each box,
  or the whole box), each parameter once; the systems model's per-rank parameter count.
- Communication buffers: the peak bytes of transient flat buffers an engine reports
  (``comm_buffer_peak``: ZeRO-2 gradient buckets, ZeRO-3 gathered units) plus any
  persistent ones it lists.
- Activations: a ``saved_tensors_hooks`` pack hook records the storage of every tensor
  autograd saves for backward during one forward, parameters and views of them
  excluded; the peak is
  the total at the end of forward (when the graph is largest).

The prediction beside it is the systems model's, for this run's precision
(:mod:`paratrain.cost.run_figures`: :func:`~paratrain.cost.run_figures.predicted_states`,
:func:`~paratrain.cost.run_figures.predicted_activations`); this module only measures.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.run_figures import predicted_activations, predicted_states
from paratrain.plan import ParallelPlan


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        s = t.untyped_storage()
        key = (s.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


class ActivationMeter:
    """Bytes of the tensors autograd saves for backward: parameters and views of them
    excluded (by type, and by storage: ZeRO's parameters are views into flat buffers),
    each storage counted once per key. Live per key — a (micro-batch, chunk) of the
    pipeline, or one watched forward + backward — with the peak of their sum.

    ``recording(key)`` / ``release(key)`` follow micro-batches in flight (the pipeline
    runtime, the engines); ``watch(active)`` measures one forward + backward window;
    ``snapshot(engine)`` records the model states for the run's memory report."""

    def __init__(self, params=()) -> None:
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict = {}
        self.current = 0
        self.peak = 0
        self.active = True  # False: recording() measures nothing (and costs nothing)
        self.states: dict[str, int] | None = None

    @property
    def peak_bytes(self) -> int:
        return self.peak

    @peak_bytes.setter
    def peak_bytes(self, value: int) -> None:
        self.peak = value

    def snapshot(self, engine) -> None:
        """Record the model states now (the loop calls it after the last step's gradient
        reduction, when gradients, optimizer state and buffers all exist)."""
        self.states = measure_states(engine)

    def recording(self, key):
        if not self.active:
            return contextlib.nullcontext()
        seen: set[int] = set()
        self.live[key] = 0

        def pack(t: torch.Tensor):
            if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) \
                    or not t.numel():
                return t
            try:
                ptr = t.untyped_storage().data_ptr()
                size = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # no plain storage (e.g. sparse)
                return t  # nothing to count; autograd keeps it as is
            if ptr not in seen and ptr not in self.param_ptrs:
                seen.add(ptr)
                self.live[key] += size
                self.current += size
                self.peak = max(self.peak, self.current)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def release(self, key) -> None:
        self.current -= self.live.pop(key, 0)

    def reset(self) -> None:
        """Forget what is live and the peak (engines keep one peak per step)."""
        self.live.clear()
        self.current = self.peak = 0

    @contextlib.contextmanager
    def watch(self, active: bool = True):
        if not active:
            yield
            return
        with self.recording("watch"):
            yield
        self.release("watch")


def measure_states(engine) -> dict[str, int]:
    """Bytes this rank holds in parameters, gradients, optimizer state, comm buffers."""
    if hasattr(engine, "state_tensors"):
        st = engine.state_tensors()
    else:
        from paratrain.parallel.precision import optimizer_tensors

        params = list(engine.model.parameters())
        st = {"params": params, "grads": [p.grad for p in params],
              "optimizer": optimizer_tensors(engine.opt)}
    out = {k: storage_bytes(st.get(k, [])) for k in ("params", "grads", "optimizer")}
    out["comm_buffers"] = storage_bytes(st.get("comm_buffers", []))
    out["comm_buffers"] += int(getattr(engine, "comm_buffer_peak", 0) or 0)
    if hasattr(engine, "owned_state"):  # elements of the plain model, from placements
        from paratrain.parallel.placement import held_elements

        out["owned_elements"] = held_elements(p for p, _, _ in engine.owned_state())
    return out


def memory_report(engine, mcfg: ModelConfig, plan: ParallelPlan, tcfg: TrainConfig,
                  meter: ActivationMeter) -> dict:
    """Measured bytes of every rank (collective when a group exists) and the prediction."""
    mine = dict(meter.states) if meter.states is not None else measure_states(engine)
    mine["activations_peak"] = meter.peak_bytes
    ranks = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    pred = predicted_states(mcfg, plan, tcfg)
    pred["activations_peak"] = predicted_activations(mcfg, plan, tcfg)
    return {"measured_per_rank": ranks, "predicted_per_rank": pred}


def format_report(rep: dict) -> str:
    """A small table: one row per kind, measured (rank 0, max over ranks) vs predicted."""
    rows = ["memory per rank (MB)   measured r0   max rank   predicted"]
    pred = rep["predicted_per_rank"]
    for k in ("params", "grads", "optimizer", "comm_buffers", "activations_peak"):
        vals = [r[k] for r in rep["measured_per_rank"]]
        p = pred.get(k)
        ptxt = f"{p / 1e6:10.3f}" if p is not None else "         -"
        rows.append(f"  {k:<20} {vals[0] / 1e6:11.3f} {max(vals) / 1e6:10.3f} {ptxt}")
    return "\n".join(rows)
