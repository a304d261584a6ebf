"""The prefill side's meeting point: handoffs by key (bootstrap_room, sequence index) until a decode instance takes
them, and the outcome of each transfer for the prefill request that made it.

The prefill request and the decode instance's fetch arrive in either order; whichever comes first waits for the
other (at most `timeout` seconds, then the key is dropped and both sides are told). Everything here runs on the
server's event loop except `publish`, which the engine thread calls.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..engine.handoff import Handoff
from .wire import TransferError

Key = tuple[int, int]
"""(bootstrap_room, index of the sequence among the request's n)."""


class RoomInUse(Exception):
    """A prefill request asked for a (room, index) that another prefill request holds."""


@dataclass
class _Slot:
    handoff: asyncio.Future = field(default_factory=asyncio.Future)    # the prefill side's Handoff
    outcome: asyncio.Future = field(default_factory=asyncio.Future)    # None once delivered, else the error
    timer: asyncio.TimerHandle | None = None
    opened: bool = False                                               # a prefill request holds it


class Outbox:
    """Handoffs waiting for their decode instance, keyed by (room, index)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float):
        self.loop, self.timeout = loop, timeout
        self._slots: dict[Key, _Slot] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def _slot(self, key: Key) -> _Slot:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot()
            slot.timer = self.loop.call_later(self.timeout, self._expire, key)
        return slot

    def open(self, key: Key) -> asyncio.Future:
        """The prefill side, before it computes key's prompt: the future of the transfer's outcome (None once
        delivered, else a TransferError); RoomInUse if another prefill request holds key."""
        slot = self._slot(key)
        if slot.opened:
            raise RoomInUse(f"bootstrap_room {key[0]} is already in use by another request on this prefill instance; "
                            "give every request its own room.")
        slot.opened = True
        return slot.outcome

    def publish(self, key: Key, handoff: Handoff) -> None:
        """From any thread: the prefill side finished key's prompt."""
        self.loop.call_soon_threadsafe(self._publish, key, handoff)

    def _publish(self, key: Key, handoff: Handoff) -> None:
        slot = self._slots.get(key)
        if slot is not None and not slot.handoff.done():
            slot.handoff.set_result(handoff)

    async def take(self, key: Key) -> Handoff:
        """The decode side: wait for key's handoff; TransferError if it fails or times out first."""
        return await asyncio.shield(self._slot(key).handoff)

    def finish(self, key: Key, error: TransferError | None = None) -> None:
        """The transfer of key ended (error None: delivered); its memory is released and both sides are told."""
        slot = self._slots.pop(key, None)
        if slot is None:
            return
        slot.timer.cancel()
        for future in (slot.handoff, slot.outcome):
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
                future.exception()          # retrieved: a side that stopped waiting is not an error to log

    def _expire(self, key: Key) -> None:
        self.finish(key, TransferError(f"the other side of this request did not arrive within {self.timeout:g} s "
                                       "(--disaggregation-timeout)."))
