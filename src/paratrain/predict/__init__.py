"""The systems model's prediction for a run on THIS machine, set beside what it measured.

Why a separate package: :mod:`paratrain.systems` prices GPUs; this glue knows what is
special about a CPU box running gloo, and counts every byte with the runtime's own
torch-free layout (:mod:`paratrain.cost.layout`). Importing it does not import torch.
Everything it says is in the open, in :attr:`Prediction.notes`.

Modules: :mod:`.machine` (the profile, the CPU fit on disk, the cores' water-filling
between sessions), :mod:`.model` (:class:`Prediction`, :func:`predict`,
:func:`fit_from_runs`), :mod:`.report` (:func:`compare`, :func:`summary_prediction`,
:func:`format_prediction`, :func:`summary_row`), :mod:`.axes` (the context- and
expert-parallel terms :func:`predict` adds per stage; docs/train-prediction.md),
:mod:`.calls` (the calls each rank makes per step), :mod:`.sched` (the oversubscribed
CPU: compute time-sharing the cores, blocking syncs waiting for peers the scheduler has
not run), :mod:`.gpu` (a run on CUDA GPUs, priced by the systems model's step model on
the catalogue's entry for the device).

What is special here, and how it is priced:

- **Ranks are processes with one thread each, sharing the cores.** Linux schedules
  fairly between *sessions* first (autogroups, ``/proc/sys/kernel/sched_autogroup_enabled``)
  and then between the threads of a session. So ``C`` cores are water-filled between the
  active sessions, each capped at its runnable threads; this run's session (n ranks) gets
  ``c`` cores and each rank ``share = c / n`` of one (:func:`waterfill`). Alone on the box
  that is ``min(1, C / n)``; on a box shared with three colleagues' jobs it is about
  ``C / 4`` for the whole run, however many ranks it has. ``C`` is the profile's
  ``gpus_per_node`` (``bench calibrate`` writes the core count); the other sessions'
  runnable threads are sampled from /proc (:func:`sample_other_sessions`).
- **Small matmuls on one CPU thread are not a GPU's.** Fitted once from three
  single-process runs of the same model (:func:`fit_from_runs`; ``check-model`` does it
  and saves the result beside the profile), on CPU time so another session's load does not
  leak in: ``eta``, the achieved fraction of one thread's matmul peak (measured then, with
  :func:`paratrain.bench.peak.matmul_peak_flops`: a calibration taken under load can understate
  it), ``pass_s``, the fixed cost of one block's forward + backward for one micro-batch
  (Python and autograd dispatch of tens of small kernels, which does not shrink with the
  batch), and ``step_s``, the fixed cost of a step (optimizer, clip, data). Without a
  fit, ``eta`` and the peak are the profile's and the fixed costs 0, and a note says so.
- **gloo over loopback**: alpha and bandwidth from the profile, priced per collective
  call with :func:`paratrain.cost.collectives.time_s` (ring), so a ZeRO-3 run pays
  one latency chain per unit and a TP run one per block region.

Step time is the larger of two bounds. The critical path on free cores: pipeline stages
s with per-micro-batch time t_s run m micro-batches in m max_s t_s plus the other stages'
fill, the schedule's own bubble (:mod:`paratrain.predict.pipeline`: for equal stages
(p-1)/(m+p-1) of the step under GPipe and 1F1B, /v interleaved, ZB-H1's smaller one, as
the simulated schedule); TP collectives sit inside
every block (exposed), so do the CP exchanges (each rank computes T/cp tokens; the ring
hides its hops under the block attention) and the MoE all-to-alls (exposed); the
pipeline's point-to-point sends cost alpha + bytes/bw each;
the data-parallel sync is exposed except for buckets that finish while backward still
runs (a model that fits one bucket hides nothing). And the session's CPU work per step
(every rank's compute, fixed costs and loopback copies) over the cores it gets: when
ranks outnumber those cores, a rank waiting in a collective or a pipeline bubble hands its
core to another, so waits are hidden and the work sets the pace -- except the blocking
syncs, where no rank of the group computes: :mod:`.sched` stretches the critical path's
compute by the ranks per core, adds a measured wake-up per sync on free cores and the
measured oversubscribed sync's cost to the work bound (``bench calibrate`` measures both,
``cpu_sched.json`` beside the profile).

Bytes are counted exactly, per rank, by :mod:`paratrain.cost.layout`: the stage split, tensor
shards (heads, SwiGLU units, vocabulary rows ``ceil(V/t)``; norms replicated), and the dp
reducer's flat buffers per pipeline chunk, padded to a multiple of the data-parallel size
(buckets of ``bucket_mb`` MiB in reverse registration order; ZeRO-3 units). The systems
model's busiest-rank formula (:func:`paratrain.cost.memory.model_states`) is reported
beside it.
"""

from __future__ import annotations

from paratrain.config import ModelConfig, TrainConfig
from paratrain.cost.layout import ELEMENT_BYTES, RankLayout, coords, rank_layout
from paratrain.cost.layout import dp_payload_bytes as _payload
from paratrain.cost.layout import state_bytes as _state_bytes
from paratrain.plan import ParallelPlan
from paratrain.predict.fit import fit_from_runs
from paratrain.predict.machine import (
    DEFAULT_PROFILE,
    FIT_NAME,
    MachineModel,
    fit_path,
    load_machine,
    sample_other_sessions,
    save_fit,
    waterfill,
)
from paratrain.predict.report import (
    CALIBRATE_HINT,
    compare,
    format_prediction,
    summary_prediction,
    summary_row,
)
from paratrain.predict.step import Prediction, _flops_block, predict

__all__ = ["CALIBRATE_HINT", "DEFAULT_PROFILE", "ELEMENT_BYTES", "FIT_NAME",
           "MachineModel",
           "Prediction", "RankLayout", "_flops_block", "compare", "coords",
           "dp_payload_bytes", "fit_from_runs", "fit_path", "format_prediction",
           "load_machine", "predict", "rank_layout", "rank_state_bytes",
           "sample_other_sessions", "save_fit", "summary_prediction", "summary_row",
           "waterfill"]


def rank_state_bytes(mcfg: ModelConfig, plan: ParallelPlan, tcfg: TrainConfig, rank: int
                     ) -> dict[str, int]:
    """Model-state bytes of ``rank`` (:func:`paratrain.cost.layout.state_bytes`)."""
    return _state_bytes(mcfg, plan, tcfg.dtype, rank, tcfg.reduce_dtype)


def dp_payload_bytes(mcfg: ModelConfig, plan: ParallelPlan, tcfg: TrainConfig, rank: int
                     ) -> int:
    """Bytes ``rank`` reduces over dp (:func:`paratrain.cost.layout.dp_payload_bytes`)."""
    return _payload(mcfg, plan, tcfg.dtype, rank, tcfg.reduce_dtype)
