"""The systems model's figures for one run of paratrain's own runtime (a
:class:`~paratrain.config.TrainConfig` beside its plan), torch-free: the run's precision
recipe, its model-state and activation bytes per rank, and the per-layer formulas the mesh
report (:mod:`paratrain.parallel.mesh_report`) sets beside what it measures. The
measuring stays in :mod:`paratrain.parallel`; the run prediction (:mod:`paratrain.predict`)
prints these same numbers.

Precision: :func:`run_precision` (``fp32-adam`` is 4 + 4 + 8 bytes per parameter, float64
doubles it; ``--dtype bfloat16`` is the mixed-precision recipe 2 + 2 + 12, or 2 + 4 + 12
with ``--reduce-dtype float32``), priced by :func:`paratrain.cost.memory.model_states`;
activations: :func:`paratrain.cost.memory.block_activation_bytes` (exact for this model's
block, sdpa or eager, at the run's element size) times the layers and micro-batches in
flight (docs/train-prediction.md).
"""

from __future__ import annotations

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.activations import kernel
from paratrain.cost.memory import Precision, activation_bytes, block_activation_bytes, model_states
from paratrain.cost.pipeline_sim import simulate_pipeline
from paratrain.cost.ranks import ELEMENT_BYTES, elements
from paratrain.cost.schedule import PipelineSchedule, bubble_formula
from paratrain.cost.tp_bytes import tp_wire_bytes_per_layer
from paratrain.plan import ParallelPlan


def run_precision(tcfg: TrainConfig) -> Precision:
    """The systems model's bytes-per-parameter recipe of this run
    (:func:`paratrain.cost.ranks.elements`): BF16 mixed precision is 2 (BF16 weights) + 2 or
    4 (gradients in the reduction dtype) + 12 (FP32 master, m, v); float32 / float64
    runs keep no second copy: e + e + 2e."""
    w, g, m = elements(tcfg.dtype, tcfg.reduce_dtype)
    master = m if tcfg.dtype == "bfloat16" else 0
    return Precision(f"{tcfg.dtype}-adam-reduce-{g}B", w, g, 2 * m + master, act_bytes=w)


def predicted_states(mcfg: ModelConfig, plan: ParallelPlan, tcfg: TrainConfig) -> dict:
    """The systems model's model-state bytes per rank for this run's precision."""
    ms = model_states(mcfg, plan, run_precision(tcfg))
    return {"params": ms.weights_bytes, "grads": ms.grads_bytes,
            "optimizer": ms.optimizer_bytes}


def _attention(mcfg: ModelConfig) -> str:
    """The kernel the activation count prices (:func:`paratrain.cost.activations.kernel`)."""
    return kernel(mcfg.attention)


def predicted_activations(mcfg: ModelConfig, plan: ParallelPlan, tcfg: TrainConfig) -> float:
    """The systems model's saved-activation bytes on the busiest rank for this run: the
    model's kernel at its element size, as the runtime runs it
    (:func:`paratrain.cost.memory.rank_activation_peaks`: blocks, RoPE tables, embedding
    ids, final norm, head input and loss, micro-batches in flight from the schedule)."""
    tokens = tcfg.global_batch * mcfg.context
    return activation_bytes(mcfg, plan, tokens, mcfg.context, _attention(mcfg),
                            ELEMENT_BYTES[tcfg.dtype], runtime=True)


def pipeline_figures(schedule: PipelineSchedule) -> dict:
    """The bubble of the schedule the runtime executes: simulated and closed form."""
    s = schedule
    return {"bubble_simulated": simulate_pipeline(s).bubble,
            "bubble_formula": bubble_formula(s.name, s.pp, s.micro_batches, s.virtual_stages)}


def block_figures(mcfg: ModelConfig, plan: ParallelPlan, tcfg: TrainConfig,
                  seqs_mb: int) -> dict:
    """Per layer and micro-batch of ``seqs_mb`` sequences: the activation bytes a block
    saves and (tp > 1) the bytes a rank sends in its tensor-parallel collectives; and the
    busiest rank's activations (:func:`predicted_activations`)."""
    e, t = ELEMENT_BYTES[tcfg.dtype], mcfg.context // plan.cp
    per_seq = block_activation_bytes(
        mcfg, t, tp=plan.tp, sp=plan.sp, recompute=plan.recompute,
        attention=_attention(mcfg), element_bytes=e, cp=plan.cp,
        cp_algorithm=plan.cp_algorithm, ep=plan.ep, etp=plan.etp)
    out = {"activation_bytes_per_layer_per_microbatch": per_seq * seqs_mb,
           "busiest_rank_activation_bytes": predicted_activations(mcfg, plan, tcfg)}
    if plan.tp > 1:
        out["tp_wire_bytes_per_layer_per_microbatch"] = tp_wire_bytes_per_layer(
            seqs_mb, t, mcfg.d_model, plan.tp, e, e, plan.recompute)
    return out
