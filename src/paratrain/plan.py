"""The parallel plan: one small frozen value, executed by the runtime, priced by the
systems model, drawn by the plots (docs/design.md, "Plans are values").

Pure Python (no torch import).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paratrain.config import MAX_BATCH, MAX_LAYERS, ModelConfig, check_ranges, setting

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
V_SHAPED = ("zb-v", "dualpipev")  # 2 chunks per rank in a V (paratrain.cost.schedule)
RECOMPUTE = ("none", "selective", "full")
COLLECTIVES = ("native", "ours")
CP_ALGORITHMS = ("ring", "all-to-all")
MAX_RANKS = 2**20  # any one axis; the largest published run (calibration.csv) has 16,384
MAX_MICRO_BATCHES = MAX_BATCH  # micro-batches split the global batch (config.MAX_BATCH)


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


@dataclass(frozen=True)
class ParallelPlan:
    """How the work is split. Sizes multiply to the world size: dp * tp * pp * cp.

    ``ep`` (expert parallelism) and ``etp`` (expert tensor parallelism) lay the MoE layers
    over the same ranks as the dense ones, Megatron-Core's "MoE parallel folding": a
    stage's dp * cp * tp ranks are regrouped as edp x ep x etp (etp innermost, then ep),
    so ep * etp must divide dp * cp * tp and etp must divide tp. Each expert is split over
    etp ranks, the experts over ep groups of them, and the edp = dp*cp*tp / (ep*etp)
    copies of each expert reduce their gradients together.
    ``micro_batches`` is the pipeline's micro-batch count, or gradient accumulation steps
    when pp == 1.
    """

    dp: int = setting(1, "Data-parallel size (default: world / (tp*pp*cp)).", lo=1,
                      hi=MAX_RANKS)
    tp: int = setting(1, "Tensor-parallel size.", lo=1, hi=MAX_RANKS)
    pp: int = setting(1, "Pipeline stages.", lo=1, hi=MAX_LAYERS)
    cp: int = setting(1, "Context-parallel size (sequence split).", lo=1, hi=MAX_RANKS)
    ep: int = setting(1, "Expert-parallel size (ep*etp divides dp*cp*tp).", lo=1,
                      hi=MAX_RANKS)
    etp: int = setting(1, "Expert tensor-parallel size: each expert split over etp ranks "
                       "(divides tp).", lo=1, hi=MAX_RANKS)
    zero: int = setting(0, "ZeRO stage 0-3 (3 = FSDP).", lo=0, hi=3)
    dp_replicate: int = setting(1, "HSDP: dp split into R replicas of dp/R ranks; ZeRO "
                                "shards within a replica, replicas all-reduce (divides dp; "
                                "needs --zero >= 1).", lo=1, hi=MAX_RANKS)
    sp: bool = setting(False, "Sequence parallelism (needs tp > 1).")
    micro_batches: int = setting(1, "Micro-batches (gradient accumulation at pp 1).", lo=1,
                                 hi=MAX_MICRO_BATCHES)
    schedule: str = setting("1f1b", "Pipeline schedule.", choices=SCHEDULES)
    virtual_stages: int = setting(1, "Chunks per stage (interleaved; 2 for zb-v, dualpipev).",
                                  lo=1, hi=MAX_LAYERS)
    recompute: str = setting("none", "Activation recomputation.", choices=RECOMPUTE)
    bucket_mb: float = setting(25.0, "Gradient bucket size, MB.", gt=0, hi=2**20)
    overlap: bool = setting(True, "Overlap gradient sync with backward.")
    compress: str | None = setting(None, "Gradient compression, e.g. topk:16.")
    collectives: str = setting("native", "Collective implementation.", choices=COLLECTIVES)
    cp_algorithm: str = setting("ring", "Context parallelism: ring (K/V pass around the cp "
                                "ring) or all-to-all (Ulysses).", choices=CP_ALGORITHMS)

    def __post_init__(self) -> None:
        check_ranges(self)  # each field's documented range (setting(lo=, hi=))
        _require(
            self.schedule in SCHEDULES,
            f"schedule={self.schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}",
        )
        _require(
            self.recompute in RECOMPUTE,
            f"recompute={self.recompute!r} is unknown; choose one of {', '.join(RECOMPUTE)}",
        )
        _require(
            self.collectives in COLLECTIVES,
            f"collectives={self.collectives!r} is unknown; choose one of {', '.join(COLLECTIVES)}",
        )
        _require(
            self.cp_algorithm in CP_ALGORITHMS,
            f"cp_algorithm={self.cp_algorithm!r} is unknown; choose one of "
            f"{', '.join(CP_ALGORITHMS)}",
        )
        _require(
            self.tp % self.etp == 0,
            f"etp={self.etp} must divide tp={self.tp}; pass --etp 1 or a divisor of --tp",
        )
        folded = self.dp * self.cp * self.tp
        _require(
            folded % (self.ep * self.etp) == 0,
            f"ep*etp={self.ep}*{self.etp} must divide dp*cp*tp={folded} (the MoE layers "
            "regroup the same ranks); choose --ep dividing "
            f"{folded // self.etp}",
        )
        _require(
            self.dp % self.dp_replicate == 0,
            f"dp_replicate={self.dp_replicate} must divide dp={self.dp} (R replicas of "
            "dp/R shards); pass --dp-replicate with a divisor of --dp",
        )
        _require(
            self.dp_replicate == 1 or self.dp_replicate < self.dp * self.cp,
            f"dp_replicate={self.dp_replicate} = dp*cp leaves one rank per shard: that is "
            "plain data parallelism; pass --zero 0 and drop --dp-replicate",
        )
        _require(
            self.dp_replicate == 1 or self.zero >= 1,
            f"--dp-replicate {self.dp_replicate} needs --zero 1, 2 or 3 (with --zero 0 every "
            "dp rank is a replica already); pass --zero 3 or drop --dp-replicate",
        )
        _require(
            not self.sp or self.tp > 1,
            "sequence parallelism (sp) needs tp > 1; pass --tp 2 or drop --sp",
        )
        _require(
            self.virtual_stages == 1 or self.schedule in ("interleaved", *V_SHAPED),
            f"virtual_stages={self.virtual_stages} needs --schedule interleaved",
        )
        _require(
            self.schedule not in V_SHAPED or self.virtual_stages == 2,
            f"schedule={self.schedule} places 2 chunks per rank in a V; pass "
            "--virtual-stages 2",
        )
        _require(
            self.schedule != "dualpipev" or self.pp == 1 or self.micro_batches >= 2 * self.pp,
            f"schedule=dualpipev needs micro_batches >= 2*pp = {2 * self.pp} (got "
            f"{self.micro_batches}); pass --micro-batches {2 * self.pp}",
        )
        if self.compress is not None:
            kind, _, k = self.compress.partition(":")
            _require(
                kind == "topk" and k.isdigit() and int(k) >= 1,
                f"compress={self.compress!r} is not understood; use e.g. topk:16",
            )

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def check(self, model: ModelConfig, world_size: int | None = None,
              global_batch: int | None = None) -> None:
        """Raise one clear ValueError if this plan cannot run ``model`` on ``world_size``."""
        if world_size is not None:
            _require(
                self.world_size == world_size,
                f"dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*{self.cp} = {self.world_size} "
                f"but there are {world_size} processes; make the product equal the "
                "process count",
            )
        _require(
            model.n_heads % self.tp == 0,
            f"tp={self.tp} does not divide n_heads={model.n_heads}; choose a tp that divides it",
        )
        _require(
            model.kv_heads % self.tp == 0,
            f"tp={self.tp} does not divide n_kv_heads={model.kv_heads}; choose a divisor",
        )
        _require(
            model.experts % self.ep == 0 if model.experts else True,
            f"ep={self.ep} does not divide experts={model.experts}; choose ep dividing it",
        )
        stages = self.pp * self.virtual_stages
        _require(
            stages <= model.n_layers,
            f"pp*virtual_stages={stages} exceeds n_layers={model.n_layers}; "
            "use fewer pipeline stages",
        )
        if global_batch is not None:
            per_mb = self.dp * self.micro_batches
            _require(
                global_batch % per_mb == 0,
                f"global batch {global_batch} is not divisible by dp*micro_batches="
                f"{self.dp}*{self.micro_batches}={per_mb}; pick a multiple of {per_mb}",
            )
        _require(
            not (self.sp and model.context % (self.tp * self.cp)),
            f"sequence parallelism needs context ({model.context}) divisible by "
            f"cp*tp={self.cp * self.tp} (it cuts each cp rank's tokens over tp); choose a "
            f"multiple of {self.cp * self.tp}",
        )
        if self.cp > 1:
            _require(
                model.context % (2 * self.cp) == 0,
                f"context {model.context} is not divisible by 2*cp={2 * self.cp} (each "
                f"sequence is cut into 2*cp chunks); use a multiple of {2 * self.cp}",
            )
            ct = self.cp * self.tp
            _require(
                self.cp_algorithm != "all-to-all"
                or (model.n_heads % ct == 0 and model.kv_heads % ct == 0),
                f"--cp-algorithm all-to-all needs n_heads ({model.n_heads}) and kv heads "
                f"({model.kv_heads}) divisible by cp*tp={ct}; use --cp-algorithm ring",
            )
        if self.schedule == "interleaved" and self.pp > 1:
            _require(
                self.micro_batches % self.pp == 0,
                f"interleaved schedule needs micro_batches ({self.micro_batches}) to be a "
                f"multiple of pp ({self.pp})",
            )

    def check_runtime(self, model: ModelConfig) -> None:
        """Combinations the paratrain runtime refuses although the systems model can price
        them (parallel/mesh_engine.py says why); call before launching a training run."""
        _require(
            not (self.pp > 1 and model.tie_embeddings),
            f"tied embeddings with pp={self.pp} are not supported (embedding and head live "
            "on different stages); drop --tie-embeddings or use --pp 1",
        )
        _require(
            not (self.schedule in ("zb-h1", *V_SHAPED) and self.pp > 1
                 and self.recompute != "none"),
            f"{self.schedule} with recompute={self.recompute} is not supported (the "
            "recomputed forward would not defer weight gradients); use --recompute none or "
            "another schedule",
        )
        _require(
            self.compress is None or self.zero == 0,
            f"--compress {self.compress} works with --zero 0 only (compressed gradients are "
            "all-gathered, not reduce-scattered); drop one",
        )
        _require(
            self.ep == 1 or model.experts > 0,
            f"ep={self.ep} needs a Mixture-of-Experts model; pass --experts E (a multiple "
            f"of {self.ep}) or use --ep 1",
        )
        _require(
            self.dp_replicate == 1 or self.ep == self.etp == 1,
            f"--dp-replicate {self.dp_replicate} with --ep {self.ep} --etp {self.etp} is not "
            "supported (the expert reducer has its own data group); use --ep 1 --etp 1 or "
            "--dp-replicate 1",
        )
        _require(
            self.etp == 1 or model.experts > 0,
            f"etp={self.etp} needs a Mixture-of-Experts model; pass --experts E or use "
            "--etp 1",
        )
        _require(
            self.sp or self.etp in (1, self.tp),
            f"--etp {self.etp} with --tp {self.tp} and no --sp: the tp ranks hold the same "
            "tokens, so the runtime splits experts over all of them (--etp tp) or none "
            "(--etp 1); pass --sp or --etp 1",
        )
        _require(
            self.sp or self.etp == self.tp or (self.dp * self.cp) % self.ep == 0,
            f"--ep {self.ep} with --tp {self.tp} and no --sp must divide dp*cp="
            f"{self.dp * self.cp} (tp ranks route the same tokens, so the expert groups "
            "cannot span them); pass --sp to fold ep over tp, or --etp tp",
        )
        _require(
            not model.experts or model.expert_ffn % self.etp == 0,
            f"etp={self.etp} does not divide the expert width {model.expert_ffn}; choose "
            "--etp dividing --moe-ffn",
        )
        if self.ep > 1 or self.etp > 1:
            _require(
                self.compress is None,
                f"--ep {self.ep} --etp {self.etp} works without --compress (expert and dense "
                "gradients go to two reducers); drop --compress",
            )

    def check_run(self, model: ModelConfig, world_size: int, global_batch: int) -> None:
        """Everything `paratrain train` checks before it runs this plan: :meth:`check`,
        then :meth:`check_runtime` (the launcher, the training loop and both searches
        call this one method, so what is ranked is what runs)."""
        self.check(model, world_size, global_batch)
        self.check_runtime(model)

    def replace(self, **changes) -> ParallelPlan:
        return dataclasses.replace(self, **changes)


def infer_dp(values: dict, world: int, world_name: str = "nproc") -> dict:
    """``values`` of a [plan] table (field -> value) with dp = world / (tp pp cp) when
    it names no dp: the one place the data-parallel size is inferred, for `paratrain
    train` and `paratrain plan` (``world_name``: what set the world size, for the
    message)."""
    if "dp" in values:
        return values
    tp, pp, cp = (values.get(k, 1) for k in ("tp", "pp", "cp"))
    denom = tp * pp * cp
    if denom < 1 or world % denom:
        raise ValueError(f"tp*pp*cp = {tp}*{pp}*{cp} = {denom} does not divide "
                         f"{world_name}={world}; choose sizes whose product divides it")
    return {**values, "dp": world // denom}
