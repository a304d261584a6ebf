"""`kestrel serve`: the engine on its thread, the app on uvicorn, and a graceful shutdown.

The first SIGTERM or SIGINT starts draining: new requests get 503 while running ones finish, then the server
exits. A second signal exits at once.
"""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

from ..engine.args import EngineArgs
from ..engine.async_engine import AsyncEngine
from ..engine.engine import LLMEngine
from .app import ServerState, create_app

log = logging.getLogger("kestrel")


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first exit signal drains the engine before the server stops."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        if self.state.draining:
            super().handle_exit(sig, frame)
            return
        log.info("draining: %d requests still running; new ones get 503", self.state.engine.num_requests)
        self.state.draining = True
        threading.Thread(target=self._exit_when_idle, daemon=True).start()

    def _exit_when_idle(self) -> None:
        while self.state.engine.num_requests > 0:
            time.sleep(0.05)
        self.should_exit = True


def serve(engine_args: EngineArgs, host: str, port: int, model_name: str | None, api_key: str | None,
          max_queued_requests: int | None) -> None:
    engine = AsyncEngine(LLMEngine(engine_args))
    app = create_app(engine, model_name or engine_args.model, api_key, max_queued_requests)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    server = DrainingServer(config, app.state.kestrel)
    try:
        server.run()
    finally:
        engine.shutdown()
