"""Live curves: a run's step records as TensorBoard event files (``--tensorboard DIR``).

Why TensorBoard's own format: TensorBoard pointed at DIR (or any tool that reads event
files) shows the curves while the run goes, with no paratrain code on the viewing side.
Written by rank 0 only, through :class:`torch.utils.tensorboard.SummaryWriter`, from the
same records that go to ``metrics.jsonl`` (one home for every number).

Tags (x axis = optimizer step):

- ``loss/train``, ``loss/val`` (nats per token), ``loss/unigram_baseline`` (end of run)
- ``optim/lr``, ``optim/grad_norm``
- ``speed/tokens_per_s``, ``speed/mfu`` (fraction of the matmul peak measured once,
  before training: the same denominator for every step), ``speed/step_s``,
  ``speed/compute_s``, ``speed/exposed_comm_s`` (the wait on gradient communication
  after backward)
- ``comm/<axis>_wire_bytes``, ``comm/<axis>_s`` for each axis of the mesh the runtime
  counts (dp, tp, pp, cp, ep; rank 0's, per step; :mod:`paratrain.run.summary` says what
  each axis' seconds are)
- ``memory/process_bytes`` (resident set on CPU, allocator peak on CUDA), and at the end
  ``memory/measured/<kind>`` (max over ranks) beside ``memory/predicted/<kind>``
- the prediction block as text (``prediction``)
"""

from __future__ import annotations

import math

from paratrain.run.summary import AXES

_STEP_TAGS = {
    "loss": "loss/train", "val_loss": "loss/val", "lr": "optim/lr",
    "grad_norm": "optim/grad_norm", "tokens_per_s": "speed/tokens_per_s", "mfu": "speed/mfu",
    "step_s": "speed/step_s", "compute_s": "speed/compute_s",
    "comm_s": "speed/exposed_comm_s", "mem_bytes": "memory/process_bytes",
    "aux_loss": "moe/aux_loss", "moe_dropped": "moe/dropped",
}
MEMORY_KINDS = ("params", "grads", "optimizer", "comm_buffers", "activations_peak")


class EventLog:
    """A SummaryWriter fed with step records and, once, the run's summary."""

    def __init__(self, logdir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=logdir, flush_secs=5)

    def _scalar(self, tag: str, value, step: int) -> None:
        if isinstance(value, (int, float)) and math.isfinite(value):
            self.writer.add_scalar(tag, float(value), step)

    def step(self, rec: dict) -> None:
        """One step's record (the dict written to metrics.jsonl)."""
        for key, tag in _STEP_TAGS.items():
            if key in rec:
                self._scalar(tag, rec[key], rec["step"])
        for axis, c in (rec.get("comm_by_axis") or {}).items():
            if axis in AXES:
                self._scalar(f"comm/{axis}_wire_bytes", c["wire_bytes"], rec["step"])
                self._scalar(f"comm/{axis}_s", c["s"], rec["step"])

    def summary(self, s: dict, step: int) -> None:
        """End of run: baseline, memory measured (max over ranks) vs predicted, and the
        prediction block as text."""
        from paratrain.predict import format_prediction

        last = step - 1
        self._scalar("loss/unigram_baseline", s.get("unigram_entropy"), last)
        mem = s.get("memory") or {}
        ranks = mem.get("measured_per_rank") or []
        pred = mem.get("predicted_per_rank") or {}
        for k in MEMORY_KINDS:
            if ranks:
                self._scalar(f"memory/measured/{k}", max(r.get(k, 0) for r in ranks), last)
            if k in pred:
                self._scalar(f"memory/predicted/{k}", pred[k], last)
        self.writer.add_text("prediction", "    " + format_prediction(
            s.get("prediction")).replace("\n", "\n    "), last)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
