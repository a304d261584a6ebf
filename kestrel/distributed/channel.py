"""Rank 0's messages to the other ranks (each step's batch, then a stop), their answers, and agreeing on numbers
across ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class StepChannel:
    """Broadcasts picklable messages from rank 0 over a gloo group; `None` tells the other ranks to stop."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def send(self, message: Any) -> None:
        """Rank 0: hand message to every other rank."""
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.group)

    def receive(self) -> Any:
        """Another rank: the next message from rank 0 (waits as long as rank 0 is idle)."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, message: Any) -> list[Any] | None:
        """Every rank's message, in rank order, on rank 0 (None on the others)."""
        rank0 = dist.get_rank(self.group) == 0
        out = [None] * dist.get_world_size(self.group) if rank0 else None
        dist.gather_object(message, out, dst=0, group=self.group)
        return out


def agree_min(values: list[int], group: dist.ProcessGroup) -> list[int]:
    """Element-wise minimum of every rank's values (all ranks get the same list)."""
    tensor = torch.tensor(values, dtype=torch.long)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group)
    return tensor.tolist()
