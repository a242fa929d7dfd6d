"""ZeRO-3 / FSDP: parameters sharded at rest, gathered per unit just in time.

Public API (composable: any list of module groups, e.g. one pipeline stage's blocks,
any group, e.g. a mesh's ``dp`` axis)::

    fs = FullyShard(units, group, cfg, impl="native", param_dtype=None, reduce_dtype=None,
                    overlap=True, deferred=False, unit_chunks=None, counted=...)
         # units: list of module lists in forward order, e.g. default_units(model)
    loss.backward(); fs.end_backward()     # per micro-step (no pipeline)
    fs.launch_chunk(c)                      # pipeline: chunk c's backward is over
    stats = fs.finish()                     # wait for the last reduce-scatters
    fs.prepare_step(); fs.adam.local_sq(); fs.adam.scale(coef); fs.step(lr)

Life of a unit (Zhao et al. 2023, "PyTorch FSDP"; Rajbhandari et al. 2020, ZeRO-3):

- At rest a unit is one flat vector (its parameters in registration order, padded to a
  multiple of p) of which rank r keeps chunk r (``shard``, the FP32 master); every
  parameter is a view into the unit's gathered buffer, whose storage is 0 bytes at rest.
- Before the forward of any of its modules it is all-gathered (``p.data`` become views of
  the gathered buffer) and, while it computes, the next unit in forward order is
  prefetched. After the forward of its last module its storage is freed (resized to 0,
  so the views autograd saved release their memory too), and a hook is put
  on that module's output gradient: when backward reaches it, the unit is gathered again
  and the unit before it (in reverse forward order) is prefetched.
- Each gradient is copied into the unit's flat gradient buffer as autograd produces it
  (``p.grad`` released); when all trainable parameters of the unit have theirs, the
  buffer is reduce-scattered asynchronously into the owned chunk (which accumulates
  over micro-steps; every micro-step reduces) and the gathered parameters are freed.
  The owned gradient chunk exists from a step's first reduction to its optimizer step
  only (like ``zero_grad(set_to_none=True)``), so forward runs without it. A
  unit holding a frozen parameter is freed at the end of backward instead (a frozen
  parameter's last use is not signalled by a gradient).
- Wire bytes per step and micro-batch: all-gather (p-1)/p twice + reduce-scatter
  (p-1)/p = 3(p-1)/p x payload.
- Mixed precision (:mod:`.precision`): the shards are the parameters' working dtype
  (BF16 under ``--dtype bfloat16``), which is what is gathered and computed with;
  gradients are reduce-scattered in ``reduce_dtype`` (BF16 by default, or FP32) and the
  optimizer updates FP32 masters of the owned shards, rounded back into them.
- Under a pipeline (``deferred``, FSDP2's ``reshard_after_forward=False`` with gradient
  sync on the last micro-batch only, as torchtitan runs FSDP x PP): a unit is gathered
  at its first forward of the step and stays gathered; gradients accumulate over the
  micro-batches in the unit's flat buffer; when the chunk's last backward is done
  (:meth:`launch_chunk`) each unit is reduce-scattered once and freed. Wire bytes per
  step: 2(p-1)/p x payload whatever the micro-batch count (resharding after every
  forward would pay 3(p-1)/p per micro-batch instead); the price is that a stage holds
  its full parameters and gradients during the step (reported as communication
  buffers), 1/p of them at rest.
- ``overlap=False``: no prefetch, and each reduce-scatter is waited for at once.
- A parameter shared by two units (tied embeddings) is refused by :class:`FullyShard`;
  :func:`default_units` merges the embedding and the head into one root unit instead,
  gathered from the embedding's forward to the head's and again for the whole backward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.parallel.ddp import DPCommStats, _union_inside
from paratrain.parallel.ddp_comm import GroupComm
from paratrain.parallel.handle import Handle
from paratrain.parallel.zero import FlatShard, ShardedAdamW, owned_segments

MAX_IN_FLIGHT = 2  # units' gradient reduce-scatters in flight at once


def _in_backward() -> bool:
    """Whether autograd is running a backward now (a checkpointed forward being
    recomputed; :class:`paratrain.model.MoE` asks the same)."""
    return torch._C._current_graph_task_id() != -1


def default_units(model: nn.Module) -> list[list[nn.Module]]:
    """The units of a Decoder or a pipeline chunk (same attribute names, absent parts
    None) in forward order: embedding, each block, (final norm, head); with tied
    embeddings the embedding joins the head's unit (one root unit, first)."""
    emb = [model.tok_emb] if model.tok_emb is not None else []
    head = [model.norm, model.head] if model.head is not None else []
    blocks = [[b] for b in model.blocks]
    if emb and head and model.head.weight is model.tok_emb.weight:
        return [emb + head, *blocks]
    return [u for u in (emb, *blocks, head) if u]


@dataclass
class Unit:
    name: str
    modules: list[nn.Module]
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    padded: int
    shard: torch.Tensor  # (padded / p,) owned chunk, working dtype
    grad_shard: torch.Tensor | None  # (padded / p,) reduced, accumulated gradient chunk
    n_trainable: int
    has_frozen: bool
    full: torch.Tensor | None = None  # (padded,) gathered parameters; 0-byte storage at rest
    gathered: bool = False
    gather: Handle | None = None
    grad_full: torch.Tensor | None = None  # (padded,) this backward's gradients
    ready: int = 0
    index: dict = field(default_factory=dict)
    chunk: int = 0  # the pipeline chunk (virtual stage of this rank) the unit belongs to


class FullyShard:
    """ZeRO-3 over ``units`` (module lists in forward order) on ``group``."""

    def __init__(self, units: list[list[nn.Module]], group, cfg: TrainConfig,
                 impl: str = "native", param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, overlap: bool = True,
                 deferred: bool = False, unit_chunks: list[int] | None = None,
                 counted=lambda q: True, select=None, pad_to: int | None = None) -> None:
        """``select(q)``: the parameters of the units' modules this instance shards
        (default all); expert parallelism runs two, dense over dp and the experts over
        the expert-data-parallel group (:mod:`.expert`). ``pad_to`` (a multiple of the
        group size, default it): each unit's flat length is padded to a multiple of it
        (HSDP pads to the whole dp, :mod:`.dp_sharded`)."""
        self.comm = GroupComm(group, impl)
        self.overlap, self.deferred = overlap, deferred
        unit_chunks = unit_chunks or [0] * len(units)
        p, r = self.comm.size, self.comm.rank
        owner: dict[int, int] = {}
        self.units: list[Unit] = []
        for i, mods in enumerate(units):
            params = []
            for m in mods:
                for q in m.parameters():
                    if select is not None and not select(q):
                        continue
                    if id(q) in owner and owner[id(q)] != i:
                        raise ValueError(f"a parameter of shape {tuple(q.shape)} is shared by "
                                         f"units {owner[id(q)]} and {i}; put those modules "
                                         "in one unit (see default_units)")
                    if id(q) not in owner:
                        owner[id(q)] = i
                        params.append(q)
            self.units.append(self._make_unit(f"unit{i}", mods, params, p, r, pad_to or p))
            self.units[-1].chunk = unit_chunks[i]
        self.shard_dtype = self.units[0].shard.dtype  # the working dtype (FP32 masters, if
        self.param_dtype = param_dtype or self.shard_dtype  # any, live in the optimizer)
        self.reduce_dtype = reduce_dtype or self.shard_dtype
        for u in self.units:
            # Each parameter becomes, once and for all, a view into its unit's gathered
            # buffer, whose *storage* is resized to 0 bytes at rest and refilled by each
            # all-gather. Tensors autograd saved in forward (e.g. a weight's transpose)
            # are views of the same storage: freeing it really frees the memory, and the
            # re-gather before backward makes them valid again (the FSDP storage trick).
            u.full = torch.empty(u.padded, dtype=self.param_dtype, device=u.shard.device)
            for q, off, shape in zip(u.params, u.offsets, u.shapes, strict=True):
                q.data = u.full[off:off + shape.numel()].view(shape)
            self._free(u)
            for m in u.modules:
                m.register_forward_pre_hook(lambda _m, _a, u=u: self._pre_forward(u))
            u.modules[-1].register_forward_hook(lambda _m, _a, out, u=u: self._post_forward(u, out))
            for q in u.params:
                if q.requires_grad:
                    q.register_post_accumulate_grad_hook(lambda q, u=u: self._on_grad(u, q))
        self._flat_shards = {id(u): FlatShard(u.shard, None,
                                              owned_segments(u.params, u.offsets,
                                                             r * (u.padded // p),
                                                             (r + 1) * (u.padded // p),
                                                             u.shapes, counted))
                             for u in self.units if u.n_trainable}
        self.adam = ShardedAdamW(list(self._flat_shards.values()), cfg)
        self._fwd_order: list[Unit] = []
        self._inflight: list[Handle] = []  # reduce-scatters launched, not yet waited
        self._retired: list[tuple[float, float]] = []  # (launch, done) of waited ones
        self.wait_s = 0.0  # time blocked on gathers this step
        self.gathered_peak = 0  # bytes of gathered parameter + gradient buffers at once

    @staticmethod
    @torch.no_grad()
    def _make_unit(name, mods, params, p, r, pad_to) -> Unit:
        offsets, n = [], 0
        for q in params:
            offsets.append(n)
            n += q.numel()
        padded = -(-n // pad_to) * pad_to
        s = padded // p
        flat = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
        for q, off in zip(params, offsets, strict=True):
            flat[off:off + q.numel()].copy_(q.reshape(-1))
        trainable = sum(q.requires_grad for q in params)
        shard = flat[r * s:(r + 1) * s].clone()
        u = Unit(name, mods, params, offsets, n, padded, shard, None, trainable,
                 trainable < len(params))
        u.index = {id(q): i for i, q in enumerate(params)}
        u.shapes = [q.shape for q in params]
        return u

    def layout(self) -> str:
        how = ("gathered once per step, reduced per chunk" if self.deferred else
               "gathered per forward and backward")
        lines = [f"{len(self.units)} FSDP units over {self.comm.size} ranks "
                 f"(gather dtype {self.param_dtype}, {how}, prefetch "
                 f"{'1 ahead' if self.overlap else 'off'}):"]
        for u in self.units:
            kinds = ", ".join(type(m).__name__ for m in u.modules)
            lines.append(f"  {u.name}: [{kinds}] {len(u.params)} params, {u.numel} elements, "
                         f"shard {u.padded // self.comm.size}")
        return "\n".join(lines)

    # ---- gather / free ------------------------------------------------------------
    def _launch_gather(self, u: Unit) -> None:
        if u.gathered or u.gather is not None:
            return
        u.full.untyped_storage().resize_(u.padded * u.full.element_size())
        u.gather = self.comm.all_gather(u.full, u.shard.to(self.param_dtype), async_op=True)

    def _ensure(self, u: Unit) -> None:
        if u.gathered:
            return
        self._launch_gather(u)
        t0 = time.perf_counter()
        u.gather.wait()
        self.wait_s += time.perf_counter() - t0
        u.gather, u.gathered = None, True
        self._note_peak()

    def _free(self, u: Unit) -> None:
        if u.gather is not None:  # prefetched but never used: let it land first
            u.gather.wait()
            u.gather = None
        u.full.untyped_storage().resize_(0)
        u.gathered = False

    def _note_peak(self) -> None:
        live = sum(u.full.untyped_storage().nbytes() for u in self.units)
        live += sum(u.padded * u.shard.element_size() for u in self.units
                    if u.grad_full is not None)
        live += sum(h.nbytes for h in self._inflight)  # gradients being reduce-scattered
        self.gathered_peak = max(self.gathered_peak, live)

    # ---- hooks ----------------------------------------------------------------------
    def _pre_forward(self, u: Unit) -> None:
        self._ensure(u)
        if _in_backward():  # a recomputed forward: backward is about to use this unit
            return
        i = self.units.index(u)  # prefetch the next unit of the same chunk
        if self.overlap and i + 1 < len(self.units) and self.units[i + 1].chunk == u.chunk:
            self._launch_gather(self.units[i + 1])

    def _post_forward(self, u: Unit, out) -> None:
        if _in_backward():
            # Recompute inside backward (a unit within a checkpointed block, e.g. an MoE
            # layer's experts): keep it gathered for the backward that follows; its last
            # gradient frees it. Freeing here would gather it a third time.
            return
        training = torch.is_grad_enabled() and torch.is_tensor(out) and out.requires_grad
        if training and self.deferred:
            return  # stays gathered until its chunk is reduced
        if training:
            self._fwd_order.append(u)
            out.register_hook(lambda _g, u=u: self._pre_backward(u))
        self._free(u)

    def _pre_backward(self, u: Unit) -> None:
        self._ensure(u)
        order = self._fwd_order[::-1]
        i = order.index(u)
        if self.overlap and i + 1 < len(order) \
                and order[i + 1].ready < order[i + 1].n_trainable:
            self._launch_gather(order[i + 1])

    def _on_grad(self, u: Unit, q: nn.Parameter) -> None:
        if q.grad is None:  # a deferred weight gradient (zero bubble): swept later
            return
        if u.grad_full is None:
            u.grad_full = torch.zeros(u.padded, dtype=self.reduce_dtype, device=u.shard.device)
            self._note_peak()
        off = u.offsets[u.index[id(q)]]
        u.grad_full[off:off + q.numel()].add_(q.grad.reshape(-1))
        q.grad = None
        u.ready += 1
        if u.ready == u.n_trainable and not self.deferred:
            self._reduce(u)
            if not u.has_frozen:
                self._free(u)

    def _sweep(self, u: Unit) -> None:
        """Gradients assigned without autograd's accumulation (the zero-bubble
        schedule's deferred weight gradients) join the unit's flat buffer."""
        for q in u.params:
            if q.requires_grad and q.grad is not None:
                self._on_grad(u, q)

    def launch_chunk(self, c: int) -> None:
        """Pipeline: chunk ``c``'s backward is over for every micro-batch; reduce its
        units now (overlapping the rest of the step) and free their parameters."""
        if self.overlap:
            for u in self.units:
                if u.chunk == c:
                    self._close(u)

    def _close(self, u: Unit) -> None:
        self._sweep(u)
        if u.grad_full is not None:
            self._reduce(u)
        if u.gathered or u.gather is not None:
            self._free(u)
        u.ready = 0

    def _reduce(self, u: Unit) -> None:
        out = torch.empty_like(u.shard, dtype=self.reduce_dtype)
        h = self.comm.reduce_scatter(out, u.grad_full, async_op=True)
        h.then = lambda: self._accumulate(u, out)
        h.nbytes = u.grad_full.numel() * u.grad_full.element_size()
        self._inflight.append(h)
        u.grad_full = None  # the handle keeps the buffer alive until sent
        if not self.overlap:
            self._retire(0)
            return
        # At most MAX_IN_FLIGHT units' full gradients exist at once: wait for the oldest
        # (usually long done: it was launched one unit of backward ago).
        self._retire(MAX_IN_FLIGHT)

    def _retire(self, window: int) -> None:
        while len(self._inflight) > window:
            old = self._inflight.pop(0)
            t0 = time.perf_counter()
            old.wait()
            self.wait_s += time.perf_counter() - t0
            self._retired.append((old.launched_s, old.done_s))

    def _accumulate(self, u: Unit, out: torch.Tensor) -> None:
        """The reduced chunk becomes (or is added to) the unit's gradient shard, which
        exists only from the first reduction of a step to the optimizer step."""
        if u.grad_shard is None:
            u.grad_shard = out
        else:
            u.grad_shard.add_(out)

    # ---- per micro-step / per step ----------------------------------------------------
    def end_backward(self) -> None:
        """After each backward: free what is still gathered, reduce what never
        completed (unused parameters), forget this forward's order."""
        for u in self.units:
            if u.grad_full is not None:
                self._reduce(u)
            if u.gathered or u.gather is not None:
                self._free(u)
            u.ready = 0
        self._fwd_order = []

    def finish(self) -> DPCommStats:
        if self.deferred:
            for u in self.units:
                self._close(u)
        t_end = time.perf_counter()
        intervals, self._retired = self._retired, []
        for h in self._inflight:
            h.wait()
            intervals.append((h.launched_s, h.done_s))
        self._inflight = []
        exposed = time.perf_counter() - t_end
        payload = sum(u.padded for u in self.units) * self.reduce_dtype.itemsize
        stats = DPCommStats(seconds=exposed + self.wait_s, payload_bytes=payload,
                            hidden_s=_union_inside(intervals, t_end),
                            buckets=len(intervals))
        self.wait_s = 0.0
        return stats

    def prepare_step(self) -> None:
        """Show the optimizer this step's reduced gradient shards."""
        for u in self.units:
            if u.n_trainable:
                self._flat_shards[id(u)].grad = u.grad_shard
        self.adam.bind_grads()

    def step(self, lr: float) -> None:
        """AdamW on the owned shards (already clipped), then free the gradient shards
        until the next backward."""
        self.adam.step(lr)
        for u in self.units:
            u.grad_shard = None
            if u.n_trainable:
                self._flat_shards[id(u)].grad = None
        self.adam.bind_grads()

    @torch.no_grad()
    def full_parameters(self) -> dict[int, torch.Tensor]:
        """id(param) -> its full value in the working dtype (collective: all-gathers every
        unit's shards; for checks and exports, not for training)."""
        out = {}
        for u in self.units:
            full = torch.empty(u.padded, dtype=u.shard.dtype, device=u.shard.device)
            self.comm.all_gather(full, u.shard.clone(), async_op=False).wait()
            for q, off, shape in zip(u.params, u.offsets, u.shapes, strict=True):
                out[id(q)] = full[off:off + shape.numel()].view(shape).clone()
        return out

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [u.shard for u in self.units],
                "grads": [u.grad_shard for u in self.units if u.grad_shard is not None],
                "optimizer": self.adam.state_tensors()}
