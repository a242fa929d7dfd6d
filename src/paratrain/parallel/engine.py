"""What the training loop needs from a (possibly parallel) model: the Engine.

The loop reads top to bottom as: batch -> ``forward_backward`` -> ``reduce_gradients``
-> ``clip_and_step``. Each parallelism is an Engine subclass (or a transform applied to
the model before the Engine is built) that changes where the arithmetic happens, never
what it computes.

Loss normalisation happens once, globally: every micro-batch's loss is the *sum* of its
token losses divided by the *global* token count of the step (all data ranks, all
micro-batches). Summing gradients over ranks then gives exactly the mean gradient of the
global batch, with no per-rank or per-micro-batch rescaling to get wrong. That division,
and the MoE auxiliary losses' matching scale, live here only (:func:`normalise_aux`,
:func:`normalised`); the one-process engine, the mesh engine and the pipeline runtime
call them. So does the clipping: :meth:`Engine.clip_and_step` is the one global-norm
clip, over the squares an engine says it owns (:meth:`Engine.global_sq`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config import TrainConfig
from paratrain.model import set_moe_loss_scale
from paratrain.parallel.optim import build_adamw, set_lr
from paratrain.parallel.placement import record_plain
from paratrain.parallel.precision import optimizer_owned, to_working


@dataclass
class CommStats:
    """Communication of one step, per rank."""

    seconds: float = 0.0  # time spent waiting on gradient communication after backward
    payload_bytes: int = 0  # bytes of gradient this rank contributed to reductions
    wire_bytes: float = 0.0  # bytes this rank sent (counted, or by the algorithm's formula)


def grad_sq(g: torch.Tensor) -> torch.Tensor:
    """||g||^2 as a float64 CPU scalar: the norm in the gradient's own dtype (as
    ``clip_grad_norm_`` computes it, no float64 copy of the tensor), squared in float64."""
    return torch.linalg.vector_norm(g).double().cpu() ** 2


def normalise_aux(model: nn.Module, n_tokens_global: int) -> None:
    """Before a forward: MoE auxiliary losses join backward with the loss's normalisation."""
    set_moe_loss_scale(model, 1.0 / n_tokens_global)


def normalised(loss_sum: torch.Tensor, n_tokens_global: int) -> torch.Tensor:
    """What backward starts from: a micro-batch's token-loss sum over the step's global
    token count (docs/design.md); ranks, micro-batches and stages then only sum gradients."""
    return loss_sum / n_tokens_global


def clip_coef(norm: float, clip: float) -> float:
    """The factor global-norm clipping multiplies every gradient by (1.0: no clipping)."""
    return min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0


def token_loss_sum(logits_BTV: torch.Tensor, y_BT: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the token cross-entropies, computed in at least float32."""
    logits = logits_BTV.flatten(0, 1)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, y_BT.flatten(), reduction="sum")


class Engine:
    """One process, the whole model: the reference every parallel mode must reproduce."""

    dp_rank = 0  # which slice of the global batch this process takes
    dp_size = 1  # into how many slices the global batch is cut

    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device) -> None:
        self.model = model
        self.cfg = cfg
        self.device = device
        record_plain(model)  # one process: every parameter is its own whole tensor
        self.opt = build_adamw(model, cfg)  # FP32 masters under --dtype bfloat16

    # ---- forward / backward -------------------------------------------------------
    def loss_sum(self, x_BT: torch.Tensor, y_BT: torch.Tensor) -> torch.Tensor:
        logits = self.model(x_BT.to(self.device))
        return token_loss_sum(logits, y_BT.to(self.device))

    def forward_backward(self, x_BT, y_BT, n_tokens_global: int) -> float:
        """Accumulate d(loss_sum / n_tokens_global) into .grad; return the local loss sum.
        MoE layers add their auxiliary loss with the same normalisation (in backward)."""
        normalise_aux(self.model, n_tokens_global)
        loss = self.loss_sum(x_BT, y_BT)
        normalised(loss, n_tokens_global).backward()
        return float(loss.detach())

    @torch.no_grad()
    def eval_loss_sum(self, x_BT, y_BT) -> float:
        self.model.eval()
        try:
            return float(self.loss_sum(x_BT, y_BT))
        finally:
            self.model.train()

    # ---- communication and update -------------------------------------------------
    def reduce_gradients(self) -> CommStats:
        return CommStats()

    def all_sum(self, values: list[float]) -> list[float]:
        """Sum scalars over the data-parallel ranks (identity for one process)."""
        return values

    @torch.no_grad()
    def clip_and_step(self, lr: float) -> float:
        """Clip by global gradient norm, take the AdamW step, zero grads; return the norm
        (``math.sqrt``, correctly rounded, as the mesh engine always took it)."""
        norm = math.sqrt(float(self.global_sq()))
        self.scale_grads(clip_coef(norm, self.cfg.grad_clip))
        self.update(lr)
        return float(norm)

    def global_sq(self) -> torch.Tensor:
        """Sum of squares of the whole model's gradient, each unique gradient once."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return sum(grad_sq(g) for g in grads) if grads else torch.zeros(())

    def scale_grads(self, coef: float) -> None:
        if coef != 1.0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)

    def update(self, lr: float) -> None:
        """The optimizer step on the (clipped) gradients, then release them."""
        set_lr(self.opt, lr)
        self.opt.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        """Drop this step's gradients (engines that own gradient storage override it)."""
        self.opt.zero_grad(set_to_none=True)

    # ---- checkpoints: this rank's share of the state -------------------------------
    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])

    # ---- what the checkpoint reads (placements: :mod:`.placement`) ----------------
    def axis_index(self, axis: str) -> int:
        """This rank's coordinate on a mesh axis (one process: 0 on all)."""
        return 0

    def owned_state(self) -> list[tuple[nn.Parameter, torch.Tensor, object]]:
        """(parameter, tensor its optimizer state is keyed by, torch optimizer) for every
        piece this rank's optimizer holds (:meth:`.data_axis.DataAxis.owned_state`)."""
        return optimizer_owned(self.opt, list(self.model.parameters()))

    def residuals(self) -> list[torch.Tensor]:
        """Per-rank optimizer state that is no piece of a model tensor."""
        return []

    @torch.no_grad()
    def sync_working(self) -> None:
        """Working parameters from the optimizer's (loaded) masters."""
        to_working(self.opt)


class SimulatedWorkers(Engine):
    """W workers in one process: W shares of the batch, forward/backward each, the
    gradients averaged, one step. The classic check that data parallelism changes where
    the arithmetic happens, not what it computes."""

    def __init__(self, model, cfg, device, workers: int) -> None:
        super().__init__(model, cfg, device)
        self.workers = workers

    def forward_backward(self, x_BT, y_BT, n_tokens_global: int) -> float:
        if x_BT.shape[0] % self.workers:
            raise ValueError(f"batch of {x_BT.shape[0]} windows is not divisible by "
                             f"--simulate-workers {self.workers}; use a multiple")
        params = [p for p in self.model.parameters() if p.requires_grad]
        before = [p.grad for p in params]  # earlier micro-batches' accumulation, if any
        per_worker, total = [], 0.0
        for xs, ys in zip(x_BT.chunk(self.workers), y_BT.chunk(self.workers), strict=True):
            for p in params:
                p.grad = None
            total += super().forward_backward(xs, ys, n_tokens_global)
            per_worker.append([p.grad for p in params])
        t0 = time.perf_counter()
        for i, p in enumerate(params):  # the "all-reduce": a plain sum over workers
            grads = [g[i] for g in per_worker if g[i] is not None]
            if before[i] is not None:
                grads.insert(0, before[i])
            p.grad = torch.stack(grads).sum(0) if grads else None
        self.sim_comm_s = time.perf_counter() - t0
        return total
