"""A LLaMA-style decoder in plain PyTorch: RMSNorm, RoPE, SwiGLU, causal attention (GQA).

No parallel code lives here: no process groups, no device strings, no globals.
Parallelism enters through transforms in :mod:`paratrain.parallel` that change this
model in place. Two conventions make that possible:

- Attention reads its head count from its projections' output width
  (``wq.out_features // head_dim``), so a tensor-parallel transform that shards the
  projections by heads needs no change here.
- ``cfg.attention`` picks the attention kernel: ``sdpa`` (fused; keeps q, k, v, the
  output and one log-sum-exp per row for backward) or ``eager`` (the textbook formula;
  keeps the a x T x T probabilities). They agree to rounding; the systems model prices
  the bytes each keeps (:func:`paratrain.cost.memory.block_activation_bytes`).
- :meth:`Decoder.forward` is the composition ``head(blocks(embed(idx)))``, and each part
  is callable alone, so a pipeline stage can run any contiguous slice of it.
- :class:`MoE` sorts its token assignments by expert and runs them through
  :meth:`MoE.run_sorted`; expert parallelism (:mod:`paratrain.parallel.expert`) sets
  ``moe.exchange`` to send those rows to the experts' ranks instead, and keeps only its
  own experts in ``moe.experts``.
- Inference with a KV cache (:mod:`paratrain.run.kv_cache`) reuses ``Attention.project``
  and :func:`heads_first`, so it shares every layer with ``forward`` and changes nothing
  there; the parallel transforms never see it (they wrap ``forward`` and ``attn.core``).

Shapes: B batch, T time, D model width, H heads, K kv heads, E head dim, V vocabulary.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rope_tables(head_dim: int, context: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (context, head_dim/2), in float64 (cast at use)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.outer(torch.arange(context, dtype=torch.float64), inv)
    return ang.cos(), ang.sin()


def apply_rope(x_BTHE: torch.Tensor, cos_TE: torch.Tensor, sin_TE: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) by position-dependent angles (Su et al. 2021)."""
    x1, x2 = x_BTHE[..., 0::2], x_BTHE[..., 1::2]
    c = cos_TE[None, :, None, :].to(x_BTHE.dtype)
    s = sin_TE[None, :, None, :].to(x_BTHE.dtype)
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def eager_attention(q_BHTE: torch.Tensor, k_BHSE: torch.Tensor,
                    v_BHSE: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(E) + causal mask) V, written out (Vaswani et al. 2017).

    Autograd keeps q and k (for the score matmul), the probabilities P_BHTT (softmax's
    backward needs only its output) and v. The mask is added rather than filled in, so
    it is not kept; the scaled scores before the softmax are not kept either.

    The S keys may extend the T queries backwards (a KV cache: S = cached + T): query i
    is position S - T + i and sees keys 0..S - T + i. Training has S = T.
    """
    T, S, E = q_BHTE.shape[-2], k_BHSE.shape[-2], q_BHTE.shape[-1]
    mask_TS = torch.full((T, S), float("-inf"), dtype=q_BHTE.dtype,
                         device=q_BHTE.device).triu(1 + S - T)
    s_BHTS = q_BHTE @ k_BHSE.transpose(-2, -1) / math.sqrt(E) + mask_TS
    return s_BHTS.softmax(dim=-1) @ v_BHSE


def heads_first(q_BTHE, k_BSKE, v_BSKE) -> tuple[torch.Tensor, ...]:
    """(B, H, T, E) q and (B, H, S, E) k, v: grouped-query attention repeats each of the
    K kv heads for H / K query heads."""
    q, k, v = (t.transpose(1, 2) for t in (q_BTHE, k_BSKE, v_BSKE))
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return q, k, v


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.kernel = cfg.attention
        d, e = cfg.d_model, cfg.head_dim
        self.wq = nn.Linear(d, cfg.n_heads * e, bias=False)
        self.wk = nn.Linear(d, cfg.kv_heads * e, bias=False)
        self.wv = nn.Linear(d, cfg.kv_heads * e, bias=False)
        self.wo = nn.Linear(cfg.n_heads * e, d, bias=False)

    def core(self, q_BTHE, k_BTKE, v_BTKE) -> torch.Tensor:
        """Causal softmax attention; returns (B, T, H*E). The 'selective' recompute unit."""
        q, k, v = heads_first(q_BTHE, k_BTKE, v_BTKE)
        if self.kernel == "eager":
            y = eager_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).flatten(2)

    def project(self, x_BTD, cos, sin) -> tuple[torch.Tensor, ...]:
        """q (B, T, H, E) and k (B, T, K, E) rotated by RoPE, v (B, T, K, E)."""
        B, T, _ = x_BTD.shape
        e = self.head_dim
        q = apply_rope(self.wq(x_BTD).view(B, T, -1, e), cos, sin)
        k = apply_rope(self.wk(x_BTD).view(B, T, -1, e), cos, sin)
        return q, k, self.wv(x_BTD).view(B, T, -1, e)

    def forward(self, x_BTD, cos, sin) -> torch.Tensor:
        return self.wo(self.core(*self.project(x_BTD, cos, sin)))

class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x_BTD)) * self.w_up(x_BTD))


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
    top_k experts per token (torch.topk), weights renormalised over those k.

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
            y_ND = y_ND + self.shared(x_ND)
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


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(i) else SwiGLU(cfg)

    def forward(self, x_BTD, cos, sin) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos, sin)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))

class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.context, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style: N(0, 0.02), residual outputs scaled by 1/sqrt(2 L)."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w_down.weight")):
                p.normal_(0.0, 0.02 / math.sqrt(2 * self.cfg.n_layers))
            else:
                p.normal_(0.0, 0.02)

    def rope(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for absolute positions [t0, t1)."""
        return self.rope_cos[t0:t1], self.rope_sin[t0:t1]

    def embed(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(idx_BT)

    def logits(self, h_BTD: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h_BTD))

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V)."""
        T = idx_BT.shape[1]
        if T > self.cfg.context:
            raise ValueError(f"sequence length {T} exceeds the model context {self.cfg.context}")
        cos, sin = self.rope(0, T)
        h = self.embed(idx_BT)
        for blk in self.blocks:
            h = blk(h, cos, sin)
        return self.logits(h)

def moe_modules(model: nn.Module) -> list[MoE]:
    """The MoE MLPs of ``model`` (or of a list of pipeline chunks), in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_moe_loss_scale(model: nn.Module, scale: float | None) -> None:
    """d(step loss)/d(token loss sum) = 1 / global tokens: the engines set it before each
    forward so the auxiliary loss enters backward with the same normalisation."""
    for m in moe_modules(model):
        m.loss_scale = scale


def take_moe_stats(model: nn.Module, experts: int) -> list[float]:
    """This rank's MoE statistics since the last call, as one flat list to be summed over
    ranks: [aux sum over layers and sequences, z-loss sum over layers and tokens,
    dropped assignments, load of expert 0..E-1 summed over layers] (a rank holding a
    subset of the experts counts all E: the load is counted where the tokens are routed).
    Resets them."""
    aux, z, dropped, load = 0.0, 0.0, 0, torch.zeros(experts, dtype=torch.long)
    for m in moe_modules(model):
        aux += m.stats["aux_sum"]
        z += m.stats["z_sum"]
        dropped += m.stats["dropped"]
        load += m.stats["load"]
        m.reset_stats()
    return [aux, z, float(dropped), *map(float, load.tolist())]
