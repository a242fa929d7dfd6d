"""Execute a :class:`~.schedule.PipelineSchedule` with point-to-point sends and receives.

Each pipeline rank walks its own action list in order:

- ``RECV_F`` / ``RECV_B``: post an ``irecv`` into a fresh buffer of the known shape
  (activation (b, T', D) with T' = T / tp under sequence parallelism, else T).
- ``F``: wait for the input's receive (stage 0 takes token ids), run the chunk; the last
  virtual stage also computes the loss sum of the micro-batch.
- ``B``: wait for the output gradient's receive (the last stage starts from
  ``loss_sum / n_tokens_global``) and backpropagate through the chunk.
- ``BI`` / ``BW`` (zero bubble, Qi et al. 2023): ``BI`` backpropagates the input
  gradient only — every matmul weight gradient is deferred (:class:`WeightGradStore`:
  the forward ran under a mode that routes ``F.linear`` through a function whose backward
  stashes (input, output-grad) instead of computing dW); ``BW`` computes those stashed
  dW = g^T x and accumulates them into ``.grad``. Small weight gradients (norm gains,
  the embedding) are computed inside ``BI``.
- ``SEND_F`` / ``SEND_B``: ``isend`` the output or the input gradient.
- V placement (zb-v, dualpipev): stages p-1 and p share rank p-1, so there the output
  (forward) and the input gradient (backward) pass within the process, detached as a
  message would be, with no send or receive.

Note (why this cannot deadlock on gloo). Sends are never waited on until the whole list
is done, so a rank only ever blocks in ``wait()`` of a receive, and that receive's
producer is an earlier compute action of another rank in the validated schedule
(:func:`paratrain.cost.pipeline_sim.validate` executes the lists under exactly these
semantics and rejects cycles). Posting an ``irecv`` never blocks, so the runtime posts
the receives of the *next* compute action before running the current one (their transfer
overlaps it); the wait still happens only right before the consumer, so the order of
blocking points is exactly the validated one.
Messages are matched by tag (kind, micro-batch, receiving virtual stage), so several
in-flight messages between the same two ranks cannot be confused; on the world group
different (dp, tp) pipelines use disjoint rank pairs. At the end of the step all sends
are waited for, so the buffers stay alive until delivered.

Loss normalisation: each micro-batch's loss *sum* is divided by the *global* token count
of the step before backward (engine.py), so accumulating over micro-batches and summing
over data ranks gives exactly the single-process gradient — once, nowhere else.

Every compute action is timed (``perf_counter``, one clock for all processes on a
machine) so the run can report the measured bubble and draw the measured Gantt chart.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from paratrain.cost.schedule import COMPUTE, Action, PipelineSchedule
from paratrain.parallel.engine import normalised
from paratrain.parallel.memory import ActivationMeter


# ---- zero-bubble: deferring weight gradients ---------------------------------------
class WeightGradStore:
    """Stashed (weight, input, output-grad) per (micro-batch, chunk), consumed by BW."""

    def __init__(self) -> None:
        self.pending: dict[tuple[int, int], list] = {}

    def put(self, key, w, x, g) -> None:
        self.pending.setdefault(key, []).append((w, x, g))

    @torch.no_grad()
    def flush(self, key) -> None:
        for w, x_NI, g_NO in self.pending.pop(key, []):
            gw = (g_NO.reshape(-1, g_NO.shape[-1]).t() @ x_NI.reshape(-1, x_NI.shape[-1]))
            gw = gw.to(w.dtype)  # computed in the compute dtype, kept in the master's
            if w.grad is None:
                w.grad = gw
            else:
                w.grad.add_(gw)


class _LinearDeferW(torch.autograd.Function):
    """y = x W^T whose backward returns dx only and stashes (x, dy) for BW. ``w`` is the
    weight used (under autocast, already cast to the compute dtype); ``param`` the
    Parameter whose ``.grad`` BW accumulates into (a saved tensor may come back as
    another object, e.g. through saved-tensor hooks, so it travels on ctx)."""

    @staticmethod
    def forward(ctx, x, w, store, key, param):
        ctx.save_for_backward(x, w)
        ctx.param, ctx.store, ctx.key = param, store, key
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ctx.store.put(ctx.key, ctx.param, x, g)
        gx = g @ w if ctx.needs_input_grad[0] else None
        return gx, None, None, None, None


class DeferWeightGrads(TorchFunctionMode):
    """While active, ``F.linear(x, W)`` with a trainable W defers dW to ``store``."""

    def __init__(self, store: WeightGradStore, key) -> None:
        super().__init__()
        self.store, self.key = store, key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if func is F.linear and bias is None and len(args) >= 2 \
                and isinstance(args[1], torch.nn.Parameter) and args[1].requires_grad:
            x, w = args[0], args[1]
            dev = x.device.type
            if torch.is_autocast_enabled(dev):  # cast as autocast would, before the mode
                dt = torch.get_autocast_dtype(dev)
                x, w = x.to(dt), w.to(dt)
            return _LinearDeferW.apply(x, w, self.store, self.key, args[1])
        return func(*args, **kwargs)


# ---- the runtime -------------------------------------------------------------------
class PipelineRuntime:
    """Runs ``schedule`` for pipeline rank ``rank`` over ``chunks`` (one per local
    virtual stage). ``peer(r)`` maps a pipeline rank to its global rank."""

    def __init__(self, chunks, schedule: PipelineSchedule, rank: int, peer: Callable[[int], int],
                 loss_fn: Callable, hidden_shape: Callable[[int], tuple], dtype: torch.dtype,
                 device: torch.device, meter: ActivationMeter, autocast: bool = False,
                 on_chunk_done: Callable[[int], None] | None = None) -> None:
        self.chunks = chunks
        self.s = schedule
        self.rank = rank
        self.peer = peer
        self.loss_fn = loss_fn
        self.hidden_shape = hidden_shape  # micro-batch size -> (b, T', D)
        self.dtype, self.device = dtype, device
        self.meter = meter
        self.autocast = autocast  # bf16 compute from fp32 weights (as Engine does)
        self.store = WeightGradStore()
        self.timeline: list[tuple[str, int, int, float, float]] = []
        self.sent_bytes = 0  # activations and input gradients isent by training steps
        # after the last gradient-producing action of each chunk, ``on_chunk_done(c)``
        # (the data-parallel reduction of that chunk may start: its gradients are final)
        self.on_chunk_done = on_chunk_done
        acts = schedule.actions[rank]
        self.last_grad_action = {a.chunk: i for i, a in enumerate(acts)
                                 if a.kind in ("B", "BI", "BW")}

    def _amp(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)

    def _tag(self, kind: str, mb: int, stage: int) -> int:
        return ((0 if kind == "F" else 1) * self.s.stages + stage) * self.s.micro_batches + mb

    def run(self, x_mbs: list, y_mbs: list, n_tokens_global: int, T: int) -> float:
        """One step: every action of this rank; returns this rank's loss sum."""
        acts: tuple[Action, ...] = self.s.actions[self.rank]
        recvs: dict[tuple, tuple] = {}
        sends = []
        state: dict[tuple[int, int], tuple] = {}  # (mb, chunk) -> (input, output or loss)
        grads_in: dict[tuple[int, int], torch.Tensor] = {}
        loss_sum = 0.0
        self.timeline = []
        self.wait_s = 0.0  # blocked in receives (the bubble as this rank sees it)
        t_start = time.perf_counter()
        zb = any(a.kind == "BI" for a in acts)
        posted: set[int] = set()

        def do(i: int) -> float:
            with torch.profiler.record_function(f"pipeline {acts[i]}"):
                return self._do(acts[i], x_mbs, y_mbs, n_tokens_global, T, recvs, sends,
                                state, grads_in, zb)

        for i, a in enumerate(acts):
            if i in posted:
                continue
            if a.kind in COMPUTE:  # prefetch: the next compute action's receives go up
                for q in range(i + 1, len(acts)):  # now, so they arrive during this one
                    if acts[q].kind in COMPUTE:
                        break
                    if acts[q].kind.startswith("RECV"):
                        do(q)
                        posted.add(q)
            loss_sum += do(i)
            if self.on_chunk_done is not None and self.last_grad_action.get(a.chunk) == i:
                self.on_chunk_done(a.chunk)
        t_sends = time.perf_counter()
        for work, _ in sends:
            work.wait()
        self.wait_s += time.perf_counter() - t_sends
        self.wall_s = time.perf_counter() - t_start
        return loss_sum

    def overhead_s(self) -> float:
        """Last step's time neither computing nor waiting: the runtime's own cost
        (posting sends and receives, bookkeeping, hooks)."""
        busy = sum(b - a for _, _, _, a, b in self.timeline)
        return self.wall_s - busy - self.wait_s

    def _do(self, a: Action, x_mbs, y_mbs, n_tokens_global, T, recvs, sends, state,
            grads_in, zb) -> float:
        """Execute one action; return the loss sum it produced (last stage's F), else 0."""
        s, last, loss_sum = self.s, self.s.stages - 1, 0.0
        k = s.stage(self.rank, a.chunk)
        key = (a.mb, a.chunk)
        if a.kind in ("RECV_F", "RECV_B"):
            kind = a.kind[-1]
            buf = torch.empty(self.hidden_shape(x_mbs[a.mb].shape[0]), dtype=self.dtype,
                              device=self.device)
            work = dist.irecv(buf, src=self.peer(a.peer), tag=self._tag(kind, a.mb, k))
            recvs[(kind, a.mb, a.chunk)] = (work, buf)
        elif a.kind == "SEND_F":
            out = state[key][1].detach().contiguous()
            self.sent_bytes += out.numel() * out.element_size()
            sends.append((dist.isend(out, dst=self.peer(a.peer),
                                     tag=self._tag("F", a.mb, k + 1)), out))
        elif a.kind == "SEND_B":
            g = grads_in.pop(key)
            self.sent_bytes += g.numel() * g.element_size()
            sends.append((dist.isend(g, dst=self.peer(a.peer),
                                     tag=self._tag("B", a.mb, k - 1)), g))
        elif a.kind == "F":
            if k == 0:
                inp = x_mbs[a.mb]
            elif s.locate(k - 1)[0] == self.rank:  # V bottom: the previous stage is local
                inp = state[(a.mb, s.locate(k - 1)[1])][1].detach().requires_grad_(True)
            else:
                work, inp = recvs.pop(("F", a.mb, a.chunk))
                tw = time.perf_counter()
                work.wait()  # waiting is bubble, not compute: timed from here
                self.wait_s += time.perf_counter() - tw
                inp.requires_grad_(True)
            t0 = time.perf_counter()
            with self.meter.recording(key):
                with self._amp():
                    if zb:
                        with DeferWeightGrads(self.store, key):
                            out = self.chunks[a.chunk](inp, T)
                    else:
                        out = self.chunks[a.chunk](inp, T)
                if k == last:
                    loss = self.loss_fn(out, y_mbs[a.mb])
                    loss_sum += float(loss.detach())
                    out = normalised(loss, n_tokens_global)
            state[key] = (inp, out)
            self.timeline.append(("F", a.mb, a.chunk, t0, time.perf_counter()))
        elif a.kind in ("B", "BI"):
            inp, out = state.pop(key)
            if k == last:
                grad = None
            elif s.locate(k + 1)[0] == self.rank:  # V bottom: the next stage is local
                grad = grads_in.pop((a.mb, s.locate(k + 1)[1]))
            else:
                work, grad = recvs.pop(("B", a.mb, a.chunk))
                tw = time.perf_counter()
                work.wait()
                self.wait_s += time.perf_counter() - tw
            t0 = time.perf_counter()
            if a.kind == "BI":
                with DeferWeightGrads(self.store, key):  # recompute sees the same ops
                    torch.autograd.backward(out, grad)
            else:
                torch.autograd.backward(out, grad)
                if zb:  # a full B in a schedule that also splits (dualpipev): the
                    self.store.flush(key)  # forward deferred dW, so B computes it now
                self.meter.release(key)
            if k > 0:
                grads_in[key] = inp.grad.contiguous()
            self.timeline.append((a.kind, a.mb, a.chunk, t0, time.perf_counter()))
        elif a.kind == "BW":
            t0 = time.perf_counter()
            self.store.flush(key)
            self.meter.release(key)
            self.timeline.append(("BW", a.mb, a.chunk, t0, time.perf_counter()))
        else:
            raise ValueError(f"unknown action {a}")
        return loss_sum

    @torch.no_grad()
    def forward_only(self, x_BT, y_BT, T: int) -> float:
        """Evaluation: the whole batch through the stages in order (blocking receives of
        earlier stages only, non-blocking sends: cannot deadlock); loss sum on the last."""
        s, last = self.s, self.s.stages - 1
        sends, loss_sum, local = [], 0.0, {}
        for c, chunk in enumerate(self.chunks):
            k = s.stage(self.rank, c)
            if k == 0:
                inp = x_BT
            elif k - 1 in local:  # V bottom: the previous stage ran here
                inp = local.pop(k - 1)
            else:
                inp = torch.empty(self.hidden_shape(x_BT.shape[0]), dtype=self.dtype,
                                  device=self.device)
                dist.recv(inp, src=self.peer(s.locate(k - 1)[0]), tag=self._tag("F", 0, k))
            with self._amp():
                out = chunk(inp, T)
            if k == last:
                loss_sum += float(self.loss_fn(out, y_BT))
            elif s.locate(k + 1)[0] == self.rank:
                local[k] = out
            else:
                out = out.contiguous()
                sends.append((dist.isend(out, dst=self.peer(s.locate(k + 1)[0]),
                                         tag=self._tag("F", 0, k + 1)), out))
        for work, _ in sends:
            work.wait()
        return loss_sum
