"""This machine as the prediction sees it: the hardware profile, the CPU fit saved beside
it, and the sessions sharing the cores (:mod:`paratrain.predict`)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from paratrain.bench.calibrate import (  # noqa: F401 - the profile's files, re-exported
    DEFAULT_PROFILE,
    SCHED_NAME,
    save_sched,
    sched_path,
)
from paratrain.cost.hardware import Hardware, load_hardware

RING_FIELDS = ("ring_hop_s", "ring_byte_s", "ring_hop_cpu_s", "ring_byte_cpu_s")
FIT_NAME = "cpu_fit.json"  # written next to the profile by `paratrain check-model`


@dataclass(frozen=True)
class MachineModel:
    """This machine as the prediction sees it: the profile plus the CPU fit.

    ``eta`` is relative to ``thread_peak`` (one thread's matmul FLOP/s); ``pass_s`` and
    ``step_s`` are the fixed costs of a block pass and of a step on a whole core;
    ``others`` the runnable threads of each other active session, one tuple per sample.
    """

    hw: Hardware
    eta: float
    thread_peak: float
    pass_s: float = 0.0
    step_s: float = 0.0
    others: tuple[tuple[int, ...], ...] = ()
    coll_call_cpu_s: float = 0.0  # CPU a rank spends per collective call (gloo's hand-off)
    coll_step_cpu_s: float = 0.0  # CPU a rank spends per collective step (gloo, loopback)
    coll_byte_cpu_s: float = 0.0  # CPU per byte it sends (0: priced as bytes / intra_bw)
    route_s: float = 0.0  # CPU per routed assignment of an MoE block, fwd + bwd (fit)
    scalar_cpu_s: float = 0.0  # CPU of an 8-byte all-reduce (the loss, the grad norm; fit)
    ring_hop_s: float = 0.0  # a CP ring rank's own CPU per hop and per byte it sends,
    ring_byte_s: float = 0.0  # its core's work beyond the FLOPs included: in line with
    # its compute (fit, run/ring_fit.py)
    ring_hop_cpu_s: float = 0.0  # gloo's progress thread's CPU per ring hop and byte
    ring_byte_cpu_s: float = 0.0
    wake_s: float = 0.0  # a blocking sync on free cores, beyond its latency (sched.py)
    sync_cpu_s: float = 0.0  # the CPU a call costs after compute, beyond a tight loop's
    busy_sync_s: float = 0.0  # idle core time per sync when ranks outnumber cores
    core_speed: float = 1.0  # a core's compute speed with every core computing, vs alone
    sched: str = ""  # where wake_s and busy_sync_s come from ("": not calibrated)
    fitted: bool = False
    source: str = "profile"

    @property
    def cores(self) -> int:
        return self.hw.gpus_per_node

    @property
    def other_threads(self) -> float:
        """Mean runnable threads of other sessions (for the record)."""
        return sum(map(sum, self.others)) / len(self.others) if self.others else 0.0

    @property
    def other_sessions(self) -> float:
        return sum(map(len, self.others)) / len(self.others) if self.others else 0.0

    def share(self, nproc: int) -> float:
        """Fraction of a core each of ``nproc`` one-thread ranks gets: the session's
        water-filled cores over its ranks, averaged over the samples of the others."""
        samples = self.others or ((),)
        return sum(waterfill(self.cores, nproc, o) for o in samples) / len(samples)

    def at_pace(self, pace: float) -> MachineModel:
        """This machine with its CPU work done ``pace`` times as fast as the fit measured
        it (a VM whose host is busier a while later runs the same step 10-25% slower): the
        matmul peak times ``pace``, every fixed and per-call CPU cost over it. Wall
        latency and bandwidth, the core share and the sync costs (``wake_s``,
        ``sync_cpu_s``, ``busy_sync_s``: the calibration's, not the fit's) are left as measured."""
        return self.replace(
            thread_peak=self.thread_peak * pace, pass_s=self.pass_s / pace,
            step_s=self.step_s / pace, coll_call_cpu_s=self.coll_call_cpu_s / pace,
            coll_step_cpu_s=self.coll_step_cpu_s / pace,
            coll_byte_cpu_s=self.coll_byte_cpu_s / pace, route_s=self.route_s / pace,
            scalar_cpu_s=self.scalar_cpu_s / pace,
            **{k: getattr(self, k) / pace for k in RING_FIELDS})

    def replace(self, **changes) -> MachineModel:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d.update(changes)
        return MachineModel(**d)


def waterfill(cores: float, nproc: int, others: tuple[int, ...]) -> float:
    """Per-rank core share when ``cores`` are split fairly between sessions (each capped
    at its runnable threads): ours has ``nproc`` ranks, the others ``others`` threads."""
    demands = sorted([*others, nproc])
    left, k = float(cores), len(demands)
    for d in demands:
        fair = left / k
        give = min(d, fair)
        if d == nproc:
            return min(1.0, give / nproc)
        left -= give
        k -= 1
    return min(1.0, cores / nproc)


def sample_other_sessions(samples: int = 10, interval_s: float = 0.02
                          ) -> tuple[tuple[int, ...], ...]:
    """Runnable threads of every other session (autogroup) with any, per sample, from
    /proc; empty where /proc or autogroups are missing (then the box counts as free)."""
    def group(pid: str) -> str | None:
        try:
            with open(f"/proc/{pid}/autogroup") as f:
                return f.read().split()[0]
        except (OSError, IndexError):
            return None

    mine = group("self")
    if mine is None:
        return ()
    out = []
    for i in range(samples):
        counts: dict[str, int] = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            running = 0
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        running += f.read().rsplit(")", 1)[1].split()[0] == "R"
                except (OSError, IndexError):
                    continue
            if running:
                g = group(pid)
                if g is not None and g != mine:
                    counts[g] = counts.get(g, 0) + running
        out.append(tuple(sorted(counts.values())))
        if i + 1 < samples:
            time.sleep(interval_s)
    return tuple(out)


def fit_path(profile: Path) -> Path:
    return profile.expanduser().with_name(FIT_NAME)


def _sched(path: Path) -> dict:
    """wake_s, sync_cpu_s, busy_sync_s and core_speed from the file beside ``path``
    (none there: {}). A file without ``segment_s`` timed its syncs after 1.4 ms of bare
    matmuls, a thirtieth of the wake-up a step pays (docs/train-prediction.md): it is
    ignored as stale, and the prediction's note asks for `paratrain bench calibrate`."""
    sp = sched_path(path)
    got = json.loads(sp.read_text()) if sp.is_file() else {}
    if not {"wake_s", "busy_sync_s", "sync_cpu_s", "segment_s"} <= set(got):
        return {}
    return {"wake_s": got["wake_s"], "busy_sync_s": got["busy_sync_s"],
            "sync_cpu_s": got["sync_cpu_s"],
            "core_speed": got.get("core_speed", 1.0), "sched": f"{sp} ({got.get('date', '?')})"}


def load_machine(profile: str | Path | None = None) -> MachineModel | None:
    """The profile (default ``~/.cache/paratrain/hardware.toml``) and, if present, the CPU
    fit and the scheduler's constants beside it; ``None`` when this machine has not been
    calibrated."""
    path = Path(profile or DEFAULT_PROFILE).expanduser()
    if not path.is_file():
        return None
    hw = load_hardware(str(path))
    fp = fit_path(path)
    fit = json.loads(fp.read_text()) if fp.is_file() else {}
    sched = _sched(path)
    if {"eta", "thread_peak", "pass_s", "step_s"} <= set(fit):  # else none or stale: ignored
        if fit.get("coll_alpha_s") and fit.get("coll_bw"):  # the step's own collectives
            hw = hw.replace(intra_alpha=fit["coll_alpha_s"], intra_bw=fit["coll_bw"])
        if "core_speed" in fit:  # measured on the fit run itself, every core running it
            sched = {**sched, "core_speed": fit["core_speed"]}
        return MachineModel(hw, fit["eta"], fit["thread_peak"], fit["pass_s"], fit["step_s"],
                            coll_call_cpu_s=fit.get("coll_call_cpu_s", 0.0),
                            coll_step_cpu_s=fit.get("coll_step_cpu_s", 0.0),
                            coll_byte_cpu_s=fit.get("coll_byte_cpu_s", 0.0),
                            route_s=fit.get("route_s", 0.0),
                            scalar_cpu_s=fit.get("scalar_cpu_s", 0.0),
                            **{k: fit.get(k, 0.0) for k in RING_FIELDS}, fitted=True,
                            source=f"fit {fp} ({fit.get('fitted_on', '?')})", **sched)
    return MachineModel(hw, hw.eta, hw.peak_flops / hw.gpus_per_node,
                        source=f"profile {path} (eta {hw.eta:g}, no CPU fit: run "
                               "`paratrain check-model` to fit one)", **sched)


def save_fit(m: MachineModel, profile: str | Path | None, fitted_on: str) -> Path:
    path = fit_path(Path(profile or DEFAULT_PROFILE))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"eta": m.eta, "thread_peak": m.thread_peak, "pass_s": m.pass_s,
                                "step_s": m.step_s, "coll_call_cpu_s": m.coll_call_cpu_s,
                                "coll_step_cpu_s": m.coll_step_cpu_s,
                                "coll_byte_cpu_s": m.coll_byte_cpu_s,
                                "coll_alpha_s": m.hw.intra_alpha, "coll_bw": m.hw.intra_bw,
                                "core_speed": m.core_speed, "route_s": m.route_s,
                                "scalar_cpu_s": m.scalar_cpu_s,
                                **{k: getattr(m, k) for k in RING_FIELDS},
                                "fitted_on": fitted_on,
                                "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    return path
