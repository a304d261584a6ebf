"""The interface every transfer backend implements (backends.py names the implementations)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from ..engine.handoff import Handoff
from .outbox import Key, Outbox


class TransferBackend(ABC):
    """Moves handoffs from a prefill instance's outbox to the decode instances that ask for them."""

    @abstractmethod
    async def serve(self, outbox: Outbox, host: str, port: int) -> None:
        """Prefill side: start answering decode instances on the bootstrap port (returns once listening)."""

    @abstractmethod
    async def fetch(self, host: str, port: int, key: Key, timeout: float) -> Handoff:
        """Decode side: key's handoff from the prefill instance bootstrapped at host:port, its tensors verified;
        TransferError if it fails, arrives corrupted, or is not all here within timeout seconds of the call (one
        deadline for connecting, waiting for the prompt and the transfer)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop listening."""

