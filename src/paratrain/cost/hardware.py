"""Accelerators: peak FLOP/s, memory, and the two links a collective can run over.

Catalogue: ``data/hardware.toml`` (each entry with its sources). A calibration run on
this machine writes a TOML/JSON file with the same keys; ``load_hardware(path)`` reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from paratrain.cost.catalogue import lookup

TOPOLOGIES = ("switch", "torus", "mesh")


@dataclass(frozen=True)
class Hardware:
    """One accelerator and the cluster around it (per-GPU figures, SI units).

    intra_* is the link inside a node (NVLink, ICI), inter_* the network between nodes;
    bandwidths are bytes/s per direction per GPU, alphas the latency of one collective
    step in seconds. ``eta`` is the achieved fraction of ``peak_flops`` on large matrix
    multiplies (0.473: docs/design.md's fitted H100 figure).

    ``topology`` says what ``intra_bw`` is. "switch" (NVSwitch) and "torus" (a TPU's ICI
    axis): what any group inside the node moves per rank. "mesh": every GPU of a node has
    a link of its own to every other and no switch (AMD's MI300X platform: seven Infinity
    Fabric links per GPU); ``intra_bw`` is one link, and a group of g ranks in the node
    moves over its g - 1 links to the others at once (:meth:`intra_group_bw`: RCCL's
    rings over a fully connected node run on disjoint links).
    """

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bw: float
    gpus_per_node: int
    intra_bw: float
    intra_alpha: float
    inter_bw: float
    inter_alpha: float
    peak_flops_fp8: float | None = None
    eta: float = 0.473
    topology: str = "switch"

    def __post_init__(self) -> None:
        for f in ("peak_flops", "hbm_bytes", "hbm_bw", "intra_bw", "inter_bw"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"hardware {self.name!r}: {f}={v!r} must be a positive number")
        for f in ("intra_alpha", "inter_alpha"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"hardware {self.name!r}: {f}={v!r} must be >= 0 seconds")
        if not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1):
            raise ValueError(
                f"hardware {self.name!r}: gpus_per_node={self.gpus_per_node!r} must be an "
                "integer >= 1"
            )
        if not 0 < self.eta <= 1:
            raise ValueError(f"hardware {self.name!r}: eta={self.eta!r} must be in (0, 1]")
        if self.topology not in TOPOLOGIES:
            raise ValueError(
                f"hardware {self.name!r}: topology={self.topology!r} must be one of "
                f"{', '.join(TOPOLOGIES)}"
            )

    def replace(self, **changes) -> Hardware:
        return dataclasses.replace(self, **changes)

    def intra_group_bw(self, members: int) -> float:
        """Bytes/s per rank of a group of ``members`` ranks inside one node: ``intra_bw``
        on a switch or torus; on a mesh one link per peer the group reaches (class
        docstring)."""
        if self.topology == "mesh":
            return self.intra_bw * max(1, min(members, self.gpus_per_node) - 1)
        return self.intra_bw

    def link(self, span_gpus: int, members: int | None = None) -> tuple[float, float]:
        """(alpha_s, bw_bytes_per_s) of the slowest link a group of ``members`` ranks
        (default: ``span_gpus``, consecutive) spanning ``span_gpus`` crosses: the
        intra-node links (:meth:`intra_group_bw`) if it fits in one node."""
        if span_gpus <= self.gpus_per_node:
            return self.intra_alpha, self.intra_group_bw(members or span_gpus)
        return self.inter_alpha, self.inter_bw


_FIELDS = {f.name: f for f in dataclasses.fields(Hardware)}
_REQUIRED = [n for n, f in _FIELDS.items() if f.default is dataclasses.MISSING]


def hardware_from_dict(values: dict, where: str) -> Hardware:
    """Build a Hardware from a flat dict; missing or unknown keys are one clear error."""
    values = {k: v for k, v in values.items() if k != "aliases"}
    values.setdefault("name", where)
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise ValueError(f"hardware {where!r} is missing key(s) {', '.join(missing)}; add them")
    unknown = sorted(set(values) - set(_FIELDS))
    if unknown:
        raise ValueError(
            f"hardware {where!r} has unknown key(s) {', '.join(unknown)}; "
            f"known keys: {', '.join(_FIELDS)}"
        )
    return Hardware(**values)


def load_hardware(name_or_path: str) -> Hardware:
    """A catalogue entry by name or alias (case-insensitive), or a .toml/.json file; else
    the entry an accelerator's description names (:func:`resolve_hardware`: "NVIDIA H100
    80GB HBM3", as nvidia-smi prints it, or "tpu7x-4x8x8"), as the runs table reads it."""
    try:
        key, fields = lookup(name_or_path, "hardware.toml", "hardware")
    except ValueError as unknown:
        if Path(name_or_path).suffix.lower() in (".toml", ".json"):
            raise
        try:
            key, fields = lookup(resolve_hardware(name_or_path), "hardware.toml", "hardware")
        except ValueError:
            raise unknown from None
    return hardware_from_dict(fields, key)


def hardware_names() -> list[str]:
    from paratrain.cost.catalogue import read_catalogue

    return list(read_catalogue("hardware.toml"))


def resolve_hardware(text: str) -> str:
    """The catalogue key an accelerator's name or description gives: the whole text or
    its part before a parenthesis as a key, name or alias, else the longest one the text
    contains as whole words (:func:`paratrain.cost.catalogue.named_in`: "NVIDIA GB200
    NVL72" is gb200, not b200, "H100 PCIe" h100-pcie, not h100, torch's "NVIDIA
    A100-SXM4-40GB" a100-40gb, "Intel® Gaudi® 3" gaudi3). ValueError when none fits."""
    from paratrain.cost.catalogue import named_in

    for c in filter(None, (text, text.split("(")[0].strip())):
        try:
            return lookup(c, "hardware.toml", "hardware")[0]
        except ValueError:
            continue
    key = named_in(text, "hardware.toml")
    if key is None:
        raise ValueError(f"accelerator {text!r} is not in the hardware catalogue")
    return key
