"""KDA state slots: one per running sequence, holding every KDA layer's recurrent and conv state."""

from __future__ import annotations

from ...layers.cache import HybridCache


class StatePool:
    """Hands out slots of a HybridCache's KDA state; a slot is zeroed when it is handed out."""

    def __init__(self, cache: HybridCache, num_slots: int):
        self.cache = cache
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A zeroed slot; the caller checks num_free first."""
        slot = self._free.pop()
        for state in self.cache.kda:
            state.conv[slot].zero_()
            state.recurrent[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        """Give slot dst the state of slot src (a forked sequence continues from its parent's state)."""
        for state in self.cache.kda:
            state.conv[dst] = state.conv[src]
            state.recurrent[dst] = state.recurrent[src]
