"""Mixed precision as the reference recipe describes it (Micikevicius et al. 2018;
ZeRO's 2 + 2 + 12 bytes per parameter).

Under ``--dtype bfloat16``:

- the model's parameters are BF16 (the working copy every rank computes with), so
  autograd produces BF16 gradients, and activations, the residual stream and the
  pipeline's messages are BF16 too (norms compute their statistics in FP32);
- the optimizer holds an FP32 *master* copy of each parameter plus FP32 Adam moments:
  4 + 4 + 4 = 12 bytes per parameter, sharded by ZeRO-1/2/3 like any optimizer state;
  after each update the master is rounded into the working copy;
- gradients are reduced in ``--reduce-dtype``: ``bfloat16`` (default: a 2-byte payload
  per parameter) or ``float32`` (4 bytes, accumulated and summed in FP32: each BF16
  gradient is added into an FP32 buffer, ``p.main_grad``, as it is produced, as
  Megatron-LM's ``main_grad`` does).

With ``float32`` / ``float64`` runs the working copy *is* the master: no second copy.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import TrainConfig

WORKING = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
MASTER = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.float32}


def working_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype of the model's parameters (what every rank computes with)."""
    return WORKING[cfg.dtype]


def master_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype of the optimizer's weights and moments."""
    return MASTER[cfg.dtype]


def reduce_dtype(cfg: TrainConfig) -> torch.dtype:
    """The dtype gradients are summed across ranks in."""
    if cfg.dtype != "bfloat16":
        return WORKING[cfg.dtype]
    return WORKING[cfg.reduce_dtype]


def grad_of(p: nn.Parameter) -> torch.Tensor | None:
    """The gradient to update ``p`` with: its FP32 ``main_grad`` when one exists."""
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


class MasterAdamW:
    """AdamW on FP32 master copies of (BF16) working parameters.

    Quacks like the torch optimizer the loop, checkpoints and the memory meter use
    (``param_groups``, ``state``, ``step``, ``zero_grad``, ``state_dict``): the groups
    and state are the inner AdamW's, over the masters, so learning rates set on
    ``param_groups`` and checkpoints hold the FP32 state."""

    def __init__(self, groups: list[dict], cfg: TrainConfig) -> None:
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        inner = []
        for g in groups:
            masters = []
            for p in g["params"]:
                m = nn.Parameter(p.detach().to(master_dtype(cfg)).clone())
                self.pairs.append((p, m))
                masters.append(m)
            inner.append({**g, "params": masters})
        self.opt = torch.optim.AdamW(inner, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                                     foreach=False)
        self.param_groups = self.opt.param_groups
        self.state = self.opt.state

    @torch.no_grad()
    def step(self) -> None:
        for p, m in self.pairs:
            g = grad_of(p)
            m.grad = None if g is None else g.to(m.dtype)
        self.opt.step()
        for p, m in self.pairs:
            if m.grad is not None:
                p.copy_(m)
                m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, _ in self.pairs:
            p.grad = None

    def masters(self) -> list[torch.Tensor]:
        return [m for _, m in self.pairs]

    @torch.no_grad()
    def to_working(self) -> None:
        """Round the masters into the working parameters (after loading them)."""
        for p, m in self.pairs:
            p.copy_(m)

    def state_dict(self) -> dict:
        return {"adamw": self.opt.state_dict(), "masters": [m.detach() for m in self.masters()]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.opt.load_state_dict(state["adamw"])
        for (p, m), saved in zip(self.pairs, state["masters"], strict=True):
            m.copy_(saved)
            p.copy_(m)


def optimizer_owned(opt, params) -> list[tuple[nn.Parameter, torch.Tensor, object]]:
    """(parameter, the tensor its optimizer state is keyed by, the torch optimizer holding
    that state) for each trainable parameter of ``params`` an optimizer from
    :func:`paratrain.parallel.optim.build_adamw` updates whole."""
    if isinstance(opt, MasterAdamW):
        masters = {id(p): m for p, m in opt.pairs}
        return [(p, masters[id(p)], opt.opt) for p in params if p.requires_grad]
    return [(p, p, opt) for p in params if p.requires_grad]


@torch.no_grad()
def to_working(opt) -> None:
    """Working parameters from the masters (a no-op without mixed precision)."""
    if isinstance(opt, MasterAdamW):
        opt.to_working()


def optimizer_tensors(opt) -> list[torch.Tensor]:
    """What an optimizer holds per parameter: Adam moments, and FP32 masters if any."""
    out = [t for st in opt.state.values() for t in st.values()
           if torch.is_tensor(t) and t.dim() > 0]
    if isinstance(opt, MasterAdamW):
        out += opt.masters()
    return out
