"""The Mixture-of-Experts MLP of :mod:`paratrain.model`: router, top-k SwiGLU experts,
shared experts, capacity, the auxiliary and z losses, and the token sort that expert
parallelism (:mod:`paratrain.parallel.expert`) hands to other ranks.

Shapes: B batch, T time, D model width, N = B T tokens, K top-k, E experts, S sorted
assignments.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config import ModelConfig


class Expert(nn.Module):
    """One SwiGLU expert of hidden width ``ffn`` (the same three matrices as SwiGLU)."""

    def __init__(self, d_model: int, ffn: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, ffn, bias=False)
        self.w_up = nn.Linear(d_model, ffn, bias=False)
        self.w_down = nn.Linear(ffn, d_model, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x_ND)) * self.w_up(x_ND))


class _AuxGrad(torch.autograd.Function):
    """Identity on the MLP output; in backward the auxiliary-loss sum gets the gradient
    ``scale`` = d(step loss)/d(aux sum), whichever rank or pipeline stage holds the layer
    (Megatron-LM's MoEAuxLossAutoScaler does the same)."""

    @staticmethod
    def forward(ctx, y, aux, scale: float):
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=g.device), None


def sort_assignments(idx_NK: torch.Tensor, w_NK: torch.Tensor, keep_NK, experts: int):
    """Token assignments (token n, slot j) sorted by expert (stable: token order inside
    an expert): returns token index, router weight, and the count per expert (E,)."""
    N, K = idx_NK.shape
    e = idx_NK.flatten()
    tok = torch.arange(N, device=idx_NK.device).repeat_interleave(K)
    w = w_NK.flatten()
    if keep_NK is not None:
        k = keep_NK.flatten()
        e, tok, w = e[k], tok[k], w[k]
    order = torch.argsort(e, stable=True)
    return tok[order], w[order], torch.bincount(e, minlength=experts)


class MoE(nn.Module):
    """Mixture-of-Experts MLP: router, top-k SwiGLU experts, optional shared experts.

    Router: logits = x W_r (d -> E), probabilities p = softmax (float32 at least), the
    top_k experts per token (torch.topk), weights renormalised over those k (Mixtral's;
    ``moe_renorm`` false keeps the probabilities, as Qwen2-MoE does). The shared experts
    see every token, their output scaled by sigmoid(x w_g) under ``shared_gate``
    (Qwen2-MoE's gate, w_g d -> 1).

    Load-balancing auxiliary loss (Switch Transformer / GShard), computed **per
    sequence** s of T tokens: aux_s = E * sum_e f_se P_se, with f_se the fraction of the
    sequence's T*k assignments routed to e and P_se its mean router probability (1.0 when
    perfectly balanced). The step loss is (sum of token cross-entropies + coef * sum_s T
    aux_s) / (global tokens), i.e. the mean token loss plus coef x the mean over
    sequences of aux_s. A sequence never spans data ranks or micro-batches, so this is a
    sum over sequences and composes exactly under any data / pipeline split with no
    collective of router statistics (DeepSeek-V3's sequence-wise balance loss has the
    same shape); a sequence cut over cp / sp ranks sums its counts (below). The engine
    sets ``loss_scale`` = 1 / global tokens before each forward; while it is None (a
    plain forward) the auxiliary loss adds no gradient.

    Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5), when ``z_loss_coef`` > 0: the
    squared log-sum-exp of each token's router logits, z_n = (log sum_e exp x_ne)^2,
    which keeps the logits small (bf16 round-off in the softmax). It is a sum over
    tokens, so the step loss adds z_coef x sum_n z_n / (global tokens) = z_coef x the
    mean over tokens, exactly under any split, like the auxiliary loss.

    Capacity (``capacity_factor`` C > 0): each expert takes at most ceil(C T k / E)
    assignments per sequence, first come first served in position order (a token's k
    slots in rank order); the rest are dropped (the token keeps its residual) and counted.
    C = 0 is dropless.

    Sharded sequences (context / sequence parallelism set ``shards``: each rank holds
    1/``shards.factor`` of every sequence's tokens and routes only those): the counts
    c_se are summed over the shards (``shards.all_reduce``, integers: exact) before
    f_se is formed, and P_se is this rank's sum of router probabilities over T (the whole
    sequence), so the shards' aux_s add up to the single process's and each token's
    gradient, E f_se / T, is the one it gets there (f carries no gradient in either).
    The statistics are the group's totals, kept by ``shards.owner`` only (0 elsewhere).
    Capacity needs every assignment's place in line over the whole sequence: the expert
    indices (B, T, k) are gathered in position order, the keep mask is computed there
    as above and each rank keeps its own rows, so the same assignments are dropped.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.experts, cfg.top_k
        self.coef, self.capacity_factor = cfg.aux_loss_coef, cfg.capacity_factor
        self.z_coef = cfg.z_loss_coef
        self.router = nn.Linear(cfg.d_model, cfg.experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.d_model, cfg.expert_ffn)
                                     for _ in range(cfg.experts))
        self.shared = (Expert(cfg.d_model, cfg.shared_experts * cfg.expert_ffn)
                       if cfg.shared_experts else None)
        self.shared_gate = nn.Linear(cfg.d_model, 1, bias=False) if cfg.shared_gate else None
        self.renorm = cfg.moe_renorm
        self.exchange = None  # expert parallelism: (moe, x_SD, counts_E) -> y_SD
        self.shards = None  # cp / sp: .factor, .owner, .all_reduce(t) (sums over shards)
        self.loss_scale: float | None = None
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"aux_sum": 0.0, "z_sum": 0.0, "dropped": 0,
                      "load": torch.zeros(self.num_experts, dtype=torch.long)}

    def route(self, x_ND: torch.Tensor, T: int):
        """(top-k expert index, renormalised weight, keep mask or None, aux sum, z sum
        (None when the z-loss is off), statistics (aux, z, load (E,) or None: the kept
        assignments counted here, dropped or None: counted here) of this rank's record).
        ``T``: the tokens of each sequence on this rank."""
        N, E, K = x_ND.shape[0], self.num_experts, self.top_k
        logits = self.router(x_ND)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        z = logits.logsumexp(-1).square().sum() if self.z_coef > 0 else None
        probs_NE = logits.softmax(-1)
        w_NK, idx_NK = probs_NE.topk(K, dim=-1)
        if self.renorm:
            w_NK = w_NK / w_NK.sum(-1, keepdim=True)
        B = N // T
        onehot_BAE = F.one_hot(idx_NK.view(B, T * K), E)  # A = T*K assignments, in order
        if self.shards is None:
            f_BE = onehot_BAE.sum(1).to(probs_NE.dtype) / (T * K)
            aux = E * (f_BE * probs_NE.view(B, T, E).mean(1)).sum()
            stats = [aux.detach(), z, None, None]
        elif not torch.is_grad_enabled():  # evaluation: no auxiliary loss, no statistics
            aux, stats = None, None
        else:
            aux, stats = self._sharded_aux(onehot_BAE.sum(1), probs_NE.view(B, T, E), z)
        keep = None
        if self.capacity_factor > 0:
            keep = self._capacity(idx_NK.view(B, T, K), onehot_BAE, stats)
        return idx_NK, w_NK.to(x_ND.dtype), keep, aux, z, stats

    def _capacity(self, idx_BTK: torch.Tensor, onehot_BAE: torch.Tensor, stats):
        """Keep mask (N, K): at most ceil(C T k / E) assignments per expert and whole
        sequence, in position order. With shards the sequence's expert indices are
        gathered in position order (``shards.whole``), the mask computed there and this
        rank's rows taken (``shards.mine``); the owner's statistics count the whole."""
        sh, E, K = self.shards, self.num_experts, self.top_k
        B, Tl, _ = idx_BTK.shape
        T = Tl * (1 if sh is None else sh.factor)
        whole = idx_BTK if sh is None else sh.whole(idx_BTK)
        oh = onehot_BAE if sh is None else F.one_hot(whole.reshape(B, T * K), E)
        cap = math.ceil(self.capacity_factor * T * K / E)
        pos_BA = (oh.cumsum(1) * oh).sum(-1)  # 1-based place in line
        keep_BTK = (pos_BA <= cap).view(B, T, K)
        if sh is None:
            return keep_BTK.view(B * T, K)
        if stats is not None:  # training: the group's dropped and kept, on the owner
            kept = torch.bincount(whole[keep_BTK], minlength=E)
            stats[2] = kept if sh.owner else torch.zeros_like(kept)
            stats[3] = int((~keep_BTK).sum()) if sh.owner else 0
        return sh.mine(keep_BTK).reshape(B * Tl, K)

    def _sharded_aux(self, counts_BE: torch.Tensor, probs_BTE: torch.Tensor, z):
        """This shard's part of the auxiliary sum (class docstring) and the group's
        statistics, from one all-reduce of [counts, probability sums, z] (float64)."""
        sh, E, K = self.shards, self.num_experts, self.top_k
        B, Tl, _ = probs_BTE.shape
        T = Tl * sh.factor  # the whole sequence
        psum_BE = probs_BTE.sum(1)
        zd = torch.zeros(1, dtype=torch.float64, device=psum_BE.device) if z is None \
            else z.detach().double().view(1)
        packed = torch.cat((counts_BE.double().flatten(), psum_BE.detach().double().flatten(),
                            zd))
        sh.all_reduce(packed)
        counts_g = packed[:B * E].view(B, E)
        f_BE = counts_g.to(probs_BTE.dtype) / (T * K)  # the whole sequence's fractions
        aux = E * (f_BE * (psum_BE / T)).sum()
        if not sh.owner:
            return aux, [torch.zeros(()), None, torch.zeros(E, dtype=torch.long), 0]
        full = E * (f_BE.double() * packed[B * E:2 * B * E].view(B, E) / T).sum()
        return aux, [full, None if z is None else packed[-1], counts_g.sum(0).long(), 0]

    def run_sorted(self, x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert, ``counts_E`` rows each -> expert outputs, same order.
        Every expert runs (on zero rows if need be), so each gets a gradient."""
        sizes = [int(c) for c in counts_E]
        outs = [ex(xs) for ex, xs in zip(self.experts, x_SD.split(sizes), strict=True)]
        return torch.cat(outs)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        idx_NK, w_NK, keep, aux, z, rec = self.route(x_ND, T)
        tok_S, w_S, counts_E = sort_assignments(idx_NK, w_NK, keep, self.num_experts)
        x_SD = x_ND[tok_S]
        if self.exchange is None:
            y_SD = self.run_sorted(x_SD, counts_E)
        else:
            y_SD = self.exchange(self, x_SD, counts_E)
        y_ND = torch.zeros_like(x_ND).index_add_(0, tok_S, y_SD * w_S[:, None])
        if self.shared is not None:
            s_ND = self.shared(x_ND)
            if self.shared_gate is not None:
                s_ND = torch.sigmoid(self.shared_gate(x_ND)) * s_ND
            y_ND = y_ND + s_ND
        if not torch.is_grad_enabled():
            return y_ND.view(B, T, D)  # evaluation: no auxiliary loss, no statistics
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside backward
            st = self.stats
            st["aux_sum"] += float(rec[0])
            st["z_sum"] += 0.0 if rec[1] is None else float(rec[1].detach())
            st["dropped"] += rec[3] if rec[3] is not None else (
                0 if keep is None else int((~keep).sum()))
            st["load"] += (counts_E if rec[2] is None else rec[2]).cpu()
        T_seq = T * (1 if self.shards is None else self.shards.factor)
        if self.loss_scale is not None and self.coef > 0:
            y_ND = _AuxGrad.apply(y_ND, aux, self.coef * T_seq * self.loss_scale)
        if self.loss_scale is not None and z is not None:
            y_ND = _AuxGrad.apply(y_ND, z, self.z_coef * self.loss_scale)
        return y_ND.view(B, T, D)
