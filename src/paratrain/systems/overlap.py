"""Training engines: how much of each axis' communication they hide, and how they gather.

Overlap is an explicit number per axis, the fraction of that axis' communication time
that can run under compute (1 = all of it, as far as the compute window allows; 0 =
every byte waits). The defaults below are what each engine does out of the box, from its
own documentation; ``paratrain plan --engine`` picks one, a runs-table row names its own.

==========  ====  ====  ====  ====  ====  =======  ======================================
engine      tp    pp    cp    dp    ep    gather   why
==========  ====  ====  ====  ====  ====  =======  ======================================
megatron    0     0     1     1     0     bucket   Megatron-LM: TP collectives block; p2p
                                                   blocking; ring attention overlaps the
                                                   next K/V with the current block;
                                                   overlap_grad_reduce / param_gather
nemo        0.8   1     1     1     0.5   bucket   NeMo's (and Megatron-Core's published
                                                   H100 runs') recipes turn on
                                                   tp_comm_overlap (Transformer Engine
                                                   userbuffers split each AG/RS under its
                                                   GEMM) and overlap_p2p_comm
megascale   0.8   1     1     1     0.5   bucket   MegaScale (Jiang et al. 2024) overlaps
                                                   TP with GEMMs and PP sends with compute
deepspeed   0     0     1     0.5   0     param    ZeRO-3 gathers each submodule's
                                                   parameters with its own all-gather
fsdp        0     0     1     1     0     unit     FSDP1/2: one all-gather per wrapped
                                                   block, prefetched one block ahead
torchtitan  0.5   0.5   1     1     0.5   unit     FSDP2 + async TP (Liang et al. 2024)
xla         0.5   0.5   1     1     0.5   unit     TPU/JAX: collective matmuls overlap TP
                                                   (Wang et al. 2023)
dualpipe    0     1     1     1     1     bucket   DeepSeek's HAI-LLM: DualPipe runs one
                                                   micro-batch's forward beside another's
                                                   backward so the expert all-to-alls and
                                                   PP sends hide under them ("full
                                                   overlap", DeepSeek-V3 report Sec. 3.2.1)
internevo   0     0     1     1     0     bucket   InternEvo (InternLM's trainer): TP as
                                                   Megatron's; ZeRO-1 the Colossal-AI
                                                   way (``zero1_broadcast``)
==========  ====  ====  ====  ====  ====  =======  ======================================

``attention`` is the kernel an engine runs by default: ``flash3`` (Hopper-native fused
attention: cuDNN's through Transformer Engine in NeMo; FlashAttention-2 on older chips),
``flash`` (FlashAttention-2 class, Dao 2023: PyTorch's SDPA, flash-attn, and how we price
XLA's fused attention), ``flash1`` (the first FlashAttention, at half FlashAttention-2's
rate: a runs-table engine cell that names it, as InternEvo's 1.0.5) or ``eager`` (the
s x s scores through HBM: DeepSpeed's and Megatron-DeepSpeed's default on the chips from
before FlashAttention's adoption, as any run in fp16 on them; on later chips a runs-table
row of theirs runs FlashAttention-2 class, :func:`paratrain.systems.row_engine.
case_attention`).

``fusion`` is the element-wise traffic (norms, activations, RoPE, adds) over the fully
fused count of :mod:`paratrain.systems.layer_cost`: 1 where kernels are fused (Transformer
Engine, apex, XLA), 1.5 where a few run as separate kernels (Megatron-DeepSpeed), 2 where
norms and activations are PyTorch modules (llm-foundry's FSDP models), 3 for eager
PyTorch blocks without torch.compile (torchtitan's default: an RMSNorm alone is five
kernels, each reading and writing the activations).

``selective`` is what "selective" recomputation reruns besides the attention core
(Korthikanti et al. 2022's selective recompute, Megatron's: nothing else); torchtitan's
op-level selective checkpointing saves every other matmul's output and recomputes the rest
of the forward: half its GEMMs and all its element-wise work. ``selective_blocks``: the
engine's "selective" checkpointing wraps whole blocks, some of them, not modules inside
each block: PyTorch FSDP1's ``apply_activation_checkpointing`` takes a ``check_fn`` that
picks blocks (fms-fsdp's ``selective_checkpointing`` p checkpoints a share p of them), so
a row of such an engine that says "selective" is priced as full recomputation of the
least share of its blocks that fits the HBM (:mod:`paratrain.systems.row_memory`), the
share a tuned recipe sets.

``dead_tail`` says what "full" recomputation reruns: the whole forward of the block
(False: ``torch.utils.checkpoint`` and Megatron's and DeepSpeed's checkpointing call the
saved function again, every GEMM of it), or only what the backward reads (True: XLA's
remat, MaxText's ``remat_policy: full`` = ``nn.remat`` with no saved names, is a pure
function of the block's input whose unread outputs the compiler drops). The backward of
the attention output projection and of the MLP's down projection needs their inputs, not
their outputs, so under XLA those two GEMMs are not rerun: 30% of a SwiGLU block's
forward GEMM time in MaxText's 32B v5e config
(:func:`paratrain.systems.step_model.full_rerun_share`). The hardware-FLOP count (HFU)
still adds a whole forward, as the published HFU formulas do.

``dispatcher`` is how an engine moves an MoE layer's tokens to its experts
(:mod:`paratrain.systems.moe_step`): Megatron-LM's ``moe_token_dispatcher_type`` setting
defaults to ``allgather``; NeMo's MoE recipes, DeepSeek's HAI-LLM, DeepSpeed-MoE,
torchtitan and the others (paratrain's runtime too) run ``alltoall``; ``flex`` (DeepEP,
HybridEP) sends a token across the network once per node, which a runs table's engine
cell says by naming DeepEP or HybridEP (:data:`paratrain.systems.row_engine.
ENGINE_OPTIONS`).

``hp_grad_bytes`` is the HBM traffic per local parameter of each micro-batch's gradient
accumulation outside the GEMMs, with the optimizer states sharded at most (ZeRO 0/1).
Megatron accumulates into its fp32 ``main_grad`` inside the weight-gradient GEMM
(``gradient_accumulation_fusion``): 0. DeepSpeed's BF16 optimizer, which bf16 runs with
ZeRO 0/1 use, keeps an fp32 gradient for every local parameter and after each
micro-batch's backward (``update_hp_grads``, called by the pipeline engine's backward
pass too) adds the bf16 gradients into it: zero the bf16 gradient (2 B), cast it to fp32
(read 2, write 4), add (read 4 + 4, write 4): 20 B per parameter per micro-batch, on
every stage's critical path. With ZeRO 2/3 the gradients are reduced per micro-batch
into the rank's shard instead (priced with the data-parallel sync).

``reduce_bytes``: bytes per parameter the engine's gradient reductions (all-reduce,
reduce-scatter) move; the ZeRO-3 gathers move the 16-bit weights, 2. torchtitan reduces in
float32 (``mixed_precision_reduce``, whose only admitted value is "float32"; FSDP2's
``MixedPrecisionPolicy(reduce_dtype=float32)``), 4; the others 2 (Megatron's
``grad_reduce_in_fp32`` is off by default; DeepSpeed's ``communication_data_type`` is the
model's dtype). With FSDP every micro-batch reduce-scatters, so a short micro-batch of a
wide model has the fp32 reduction exposed: OLMo-core's 13B on 8 H100 at one 4,096-token
micro-batch was priced 13.1% fast with 2 bytes, 10.6% with 4 (docs/systems-model.md).

``zero``: the ZeRO stage the engine's data parallelism runs out of the box, which a
runs-table row that names none is priced with: Megatron-LM 0 (its distributed
optimizer is off unless asked for), NeMo 1 (every NeMo 2 and Megatron-Bridge recipe turns the
distributed optimizer on), DeepSpeed 0 (``zero_optimization.stage`` defaults to 0), FSDP
3 (``ShardingStrategy.FULL_SHARD``), torchtitan 3 (``data_parallel_shard_degree`` -1:
FSDP2 over every data rank), XLA 3 (MaxText's ``ici_fsdp_parallelism`` -1), DeepSeek's
HAI-LLM 1 (the DeepSeek-V3 report's ZeRO-1), InternEvo 1 (its ``zero1`` setting).

``zero1_broadcast``: ZeRO-1 as Colossal-AI's low-level ZeRO optimizer runs it, which
InternEvo's ``HybridZeroOptimizer`` (InternLM/InternEvo, ``internlm/solver/optimizer/
hybrid_zero_optim.py``) keeps: each gradient bucket is all-reduced over the whole data
group (``reduce_tensor`` with no destination rank), twice a reduce-scatter's bytes, and
after the optimizer step every rank of a sharding group broadcasts its updated shard
(``broadcast_params(overlap=False)``), one NCCL broadcast per rank with nothing beside
it to hide under (:mod:`paratrain.systems.dp_sync`). Its ``zero1`` size is the row's
``shard_group``: the optimizer states shard within a node and replicate across nodes, so
the broadcasts stay on NVLink.

``graphed``: the engine replays the whole step's kernels from a CUDA graph
(Megatron-Core's ``cuda_graph_impl = "full_iteration"``, which Megatron-Bridge's MXFP8 MoE
recipes on GB200 run from its 26.06 container on; a runs-table engine cell says
"full-iteration CUDA graph"): no kernel is launched from the host, so each pays only the
GPU's own gap between kernels, :data:`GRAPH_KERNEL_S` (2 us, ``kernel_s``'s lower bound:
CUDA's launch latency), in place of the fitted ``kernel_s``.

``graph_scopes``: the parts of each layer the engine replays from CUDA graphs, the rest
launched from the host (Megatron-Core's ``cuda_graph_impl = "transformer_engine"`` with
its ``cuda_graph_scope`` list; a runs-table engine cell says "CUDA graph scope attn
moe_router moe_preprocess"): those kernels pay :data:`GRAPH_KERNEL_S`, the others the
fitted ``kernel_s`` (:mod:`paratrain.systems.graph_scopes` counts them).

``gather`` is how a ZeRO-3/FSDP engine gathers weights: ``bucket`` (whole-stage buckets
on NCCL rings), ``unit`` (one collective per block), ``param`` (DeepSpeed ZeRO-3 gathers each
submodule's parameters with its own coalesced all-gather: attention's projections, its
output, the MLP's two layers, ``COLLECTIVES_PER_BLOCK``; each pays the ring's (p-1)
latencies and a launch, and, being small, runs on one or two NCCL channels: one NIC's
bandwidth per node instead of the node's aggregate).
"""

from __future__ import annotations

from dataclasses import dataclass

COLLECTIVES_PER_BLOCK = {"bucket": 1, "unit": 1, "param": 4}
GRAPH_KERNEL_S = 2e-6  # a kernel's fixed cost replayed from a CUDA graph (``graphed``)


@dataclass(frozen=True)
class Engine:
    name: str
    tp: float
    pp: float
    cp: float
    dp: float
    ep: float
    gather: str
    attention: str = "flash"  # the attention kernel it runs by default
    fusion: float = 1.0  # element-wise HBM traffic over the fully fused count
    selective: float = 0.0  # share of the forward's GEMMs "selective" recompute reruns
    flops_count: str = "matmul"  # how its reports count model FLOPs (models.FLOP_COUNTS)
    p2p_split: bool = True  # pipeline sends split over the TP ranks (scatter/gather)
    dispatcher: str = "alltoall"  # MoE token dispatch (systems.moe_step.DISPATCHERS)
    dead_tail: bool = False  # full recompute skips the GEMMs whose outputs backward never reads
    hp_grad_bytes: float = 0.0  # HBM bytes per local parameter per micro-batch (ZeRO 0/1)
    graphed: bool = False  # the step's kernels replayed from a CUDA graph (GRAPH_KERNEL_S)
    graph_scopes: tuple[str, ...] = ()  # parts of each layer replayed (graph_scopes)
    selective_blocks: bool = False  # "selective" checkpoints a share of whole blocks
    zero: int = 0  # the ZeRO stage its data parallelism runs when a row does not say
    reduce_bytes: float = 2.0  # bytes per parameter its gradient reductions move
    zero1_broadcast: bool = False  # ZeRO-1 all-reduces, then broadcasts shards (dp_sync)
    bucket_params: float = 0.0  # parameters per gradient bucket (0: the plan's bucket_mb)
    bucket_per_rank: float = 0.0  # ... at least this many per data rank

    def bucket(self, d: int, plan_params: float) -> float:
        """Parameters per gradient bucket over ``d`` data ranks: the engine's rule, else
        ``plan_params`` (the plan's ``bucket_mb`` of gradients)."""
        return max(self.bucket_params, self.bucket_per_rank * d) or plan_params

    def kernel_s(self, fitted: float) -> float:
        """A kernel's fixed cost under this engine: the fitted one, or a graph's."""
        return self.graph_kernel_s(fitted) if self.graphed else fitted

    def graph_kernel_s(self, fitted: float) -> float:
        """A kernel's fixed cost inside a graph-replayed scope (``graph_scopes``)."""
        return min(fitted, GRAPH_KERNEL_S)


# Megatron-Core's DistributedDataParallelConfig.bucket_size default: max(40M, 1M x dp)
_MCORE_BUCKET = {"bucket_params": 40e6, "bucket_per_rank": 1e6}
ENGINES = {
    "megatron": Engine("megatron", 0.0, 0.0, 1.0, 1.0, 0.0, "bucket", "flash",
                       dispatcher="allgather", **_MCORE_BUCKET),
    "nemo": Engine("nemo", 0.8, 1.0, 1.0, 1.0, 0.5, "bucket", "flash3", zero=1,
                   **_MCORE_BUCKET),
    "megascale": Engine("megascale", 0.8, 1.0, 1.0, 1.0, 0.5, "bucket", "flash",
                        **_MCORE_BUCKET),
    "deepspeed": Engine("deepspeed", 0.0, 0.0, 1.0, 0.5, 0.0, "param", "eager", 1.5,
                        p2p_split=False, hp_grad_bytes=20.0, bucket_params=5e8),
    "fsdp": Engine("fsdp", 0.0, 0.0, 1.0, 1.0, 0.0, "unit", "flash", 2.0,
                   selective_blocks=True, zero=3),
    "torchtitan": Engine("torchtitan", 0.5, 0.5, 1.0, 1.0, 0.5, "unit", "flash", 3.0, 0.5,
                         zero=3, reduce_bytes=4.0),
    "xla": Engine("xla", 0.5, 0.5, 1.0, 1.0, 0.5, "unit", "flash", dead_tail=True, zero=3),
    "dualpipe": Engine("dualpipe", 0.0, 1.0, 1.0, 1.0, 1.0, "bucket", "flash", zero=1,
                       **_MCORE_BUCKET),
    "internevo": Engine("internevo", 0.0, 0.0, 1.0, 1.0, 0.0, "bucket", "flash", zero=1,
                        zero1_broadcast=True, bucket_params=512 * 2**20),
}
DEFAULT_ENGINE = "megatron"
# The search recommends a layout for a run someone would start today, so it prices the
# engine large runs use now: Megatron-Core with Transformer Engine, TP collectives split
# under their GEMMs and p2p overlapped (the published H100 recipes). Priced with blocking
# TP collectives ("megatron", Megatron-LM 2021) every tensor-parallel byte is exposed and
# the search trades tp 8 for context parallelism and 64 two-layer stages (tp 4, pp 64,
# cp 8 for Llama 3 405B on 16K H100), which no one runs; under this engine it picks tp 8,
# pp 16 (docs/systems-model.md).
SEARCH_ENGINE = "nemo"

# words that name a training stack -> engine (first match wins: "Megatron-DeepSpeed" is
# deepspeed, "FSDP ... with Megatron tensor parallelism" fsdp, FSDP2 torchtitan's, as in
# the table above); which columns of a runs-table row are read, and in what order:
# paratrain.systems.row_engine
_KEYWORDS = (("dualpipe", "dualpipe"), ("hai-llm", "dualpipe"),
             ("internevo", "internevo"), ("internlm", "internevo"),
             ("nemo", "nemo"), ("dgxc", "nemo"), ("megatron-core", "nemo"), ("mcore", "nemo"),
             ("megatron-bridge", "nemo"), ("deepspeed", "deepspeed"),
             ("torchtitan", "torchtitan"), ("fsdp2", "torchtitan"), ("fsdp", "fsdp"),
             ("composer", "fsdp"), ("llm-foundry", "fsdp"), ("mosaic", "fsdp"),
             ("pax", "xla"), ("jax", "xla"), ("t5x", "xla"), ("maxtext", "xla"),
             ("levanter", "xla"), ("axlearn", "xla"), ("praxis", "xla"), ("easydel", "xla"),
             ("tpu", "xla"),
             # PyTorch-native stacks on FSDP2's fully_shard (torchtitan's engine) or on
             # FSDP1 (LitGPT's pretraining, through Lightning's FSDPStrategy; Lightning
             # itself names no sharding: its default strategy is DDP); AMD's Primus is
             # Megatron-LM's fork
             ("olmo-core", "torchtitan"), ("torchtune", "torchtitan"),
             ("vescale", "torchtitan"), ("litgpt", "fsdp"), ("primus", "megatron"),
             ("megatron", "megatron"), ("megascale", "megascale"))


def named_engine(text: str | None) -> tuple[str, str] | None:
    """(engine, the word that names it) for the first of :data:`_KEYWORDS` in ``text``
    (an engine's own name counts as its word), else None."""
    low = (text or "").lower().strip()
    if low in ENGINES:
        return low, low
    return next(((eng, key) for key, eng in _KEYWORDS if key in low), None)


def engine(name: str | None) -> Engine:
    """An engine by name (case-insensitive; any text that names one, e.g. a runs-table
    ``engine`` cell "Megatron-DeepSpeed" gives deepspeed)."""
    if not name:
        return ENGINES[DEFAULT_ENGINE]
    found = named_engine(name)
    if found is None:
        raise ValueError(f"engine {name!r} is unknown; choose one of {', '.join(ENGINES)}")
    return ENGINES[found[0]]
