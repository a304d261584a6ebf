"""A server's role in prefill/decode disaggregation (--disaggregation-mode prefill|decode): the prefill instance's
bootstrap port, and which side of kestrel.disagg.roles runs a request's prompts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ..disagg import roles
from ..disagg.backends import transfer_backend
from ..disagg.outbox import Outbox, RoomInUse
from ..engine.async_engine import AsyncEngine
from ..engine.outputs import RequestOutput
from ..engine.sampling import SamplingParams
from .errors import ApiError
from .options import ServerOptions


class PDRole:
    """The prefill or decode side of a disaggregated deployment, for one server."""

    def __init__(self, engine: AsyncEngine, options: ServerOptions):
        self.engine, self.options, self.mode = engine, options, options.disaggregation_mode
        self.backend = transfer_backend(options.disaggregation_transfer_backend)
        self.outbox: Outbox | None = None

    async def start(self) -> None:
        """Prefill: listen on the bootstrap port (on the server's event loop, before the first request)."""
        if self.mode == "prefill":
            self.outbox = Outbox(asyncio.get_running_loop(), self.options.disaggregation_timeout)
            await self.backend.serve(self.outbox, self.options.bootstrap_bind_host,
                                     self.options.disaggregation_bootstrap_port)

    async def stop(self) -> None:
        await self.backend.close()

    def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int,
                 bootstrap: tuple[str | None, int | None, int | None]) -> AsyncIterator[RequestOutput]:
        """This side's outputs for one prompt; a 400 for a request the router did not send, a 409 for a prefill
        request whose room another request holds."""
        host, port, room = bootstrap
        if host is None or port is None or room is None:
            raise ApiError(400, f"this is a {self.mode} instance: send requests through sglang_router "
                                "--pd-disaggregation (bootstrap_host, bootstrap_port or bootstrap_room is missing).")
        timeout = self.options.request_timeout
        if self.mode == "prefill":
            try:
                return roles.prefill(self.engine, self.outbox, request_id, prompt, params, priority, timeout, room)
            except RoomInUse as e:
                raise ApiError(409, str(e), "bootstrap_room") from e
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return roles.decode(self.engine, self.backend, request_id, ids, params, priority, timeout,
                            self.options.disaggregation_timeout, roles.Bootstrap(host, port, room))
