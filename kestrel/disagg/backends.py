"""The transfer backends kestrel has, by the name --disaggregation-transfer-backend takes (NIXL and Mooncake are
absent: see README's PD section)."""

from __future__ import annotations

from .tcp import TcpBackend
from .transport import TransferBackend

BACKENDS: dict[str, type[TransferBackend]] = {"tcp": TcpBackend}


def transfer_backend(name: str) -> TransferBackend:
    """A new backend of the given name; a ValueError naming the available ones for any other."""
    if name not in BACKENDS:
        raise ValueError(f"the transfer backend {name!r} is not available; use one of {', '.join(BACKENDS)}.")
    return BACKENDS[name]()
