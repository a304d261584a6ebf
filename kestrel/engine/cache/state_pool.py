"""KDA state slots: one per running sequence, holding every KDA layer's recurrent and conv state."""

from __future__ import annotations

from .device_ops import DeviceOps


class StatePool:
    """Hands out slot numbers of a HybridCache's KDA state (the first num_slots). A handed-out slot holds whatever
    its last holder left: a sequence's first step ignores it (the layers read a slot only past position 0)."""

    def __init__(self, num_slots: int, ops: DeviceOps):
        self.num_slots = num_slots
        self.ops = ops
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A slot; the caller checks num_free first."""
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        """Give slot dst the state of slot src (a forked sequence continues from its parent's state) before the next
        step."""
        self.ops.copy_slots([src], [dst])
