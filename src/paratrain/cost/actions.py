"""One action of a pipeline schedule (:mod:`paratrain.cost.schedule`): a compute step of
one micro-batch on one local chunk, or a point-to-point send or receive. No torch here."""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE = ("F", "B", "BI", "BW")
COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class Action:
    kind: str  # one of COMPUTE or COMMS
    mb: int  # micro-batch
    chunk: int = 0  # local model chunk on this rank (0 .. v-1)
    peer: int = -1  # the other pipeline rank of a send/receive

    def __str__(self) -> str:
        c = f"c{self.chunk}" if self.chunk else ""
        p = f"->{self.peer}" if self.kind.startswith("SEND") else (
            f"<-{self.peer}" if self.kind.startswith("RECV") else "")
        return f"{self.kind}{self.mb}{c}{p}"
