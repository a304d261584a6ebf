"""The interface every transfer backend implements, and the backends kestrel has (NIXL and Mooncake are absent: see
README's PD section)."""

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
        TransferError if it cannot be had within timeout seconds, fails, or arrives corrupted."""

    @abstractmethod
    async def close(self) -> None:
        """Stop listening."""


def transfer_backend(name: str) -> TransferBackend:
    from .tcp import TcpBackend
    backends = {"tcp": TcpBackend}
    if name not in backends:
        raise ValueError(f"the transfer backend {name!r} is not available; use one of {', '.join(backends)}.")
    return backends[name]()
