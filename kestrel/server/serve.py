"""`kestrel serve`: the engine on its thread, the app on uvicorn, and a graceful shutdown.

The first SIGTERM or SIGINT starts draining: new requests get 503 while running ones finish, for at most
--shutdown-timeout seconds; requests still running then are aborted (their responses end with finish_reason
"abort") and the server exits. A second signal exits at once.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

import uvicorn

from ..engine.args import EngineArgs
from ..engine.async_engine import AsyncEngine
from ..engine.engine import LLMEngine
from .app import ServerState, create_app
from .options import ServerOptions

log = logging.getLogger("kestrel")
ABORT_GRACE_S = 5.0
"""How long aborted requests get, after the shutdown deadline, to send their last chunk."""
RANK_POLL_S = 0.5
"""How often a distributed instance's server checks that its ranks are alive."""


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
        engine = self.state.engine
        if not _wait_until_idle(engine, self.state.options.shutdown_timeout):
            log.warning("shutdown timeout: aborting %d requests still running", engine.num_requests)
            engine.abort_all("the server shut down before this request finished (--shutdown-timeout).")
            _wait_until_idle(engine, ABORT_GRACE_S)
        self.should_exit = True


def _wait_until_idle(engine: AsyncEngine, timeout: float) -> bool:
    """Wait up to `timeout` seconds for every request to finish; True if they did."""
    deadline = time.monotonic() + timeout
    while engine.num_requests > 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def serve(engine_args: EngineArgs, options: ServerOptions, host: str, port: int) -> int:
    """Serve until a signal stops the server (exit code 0) or a rank of a distributed instance fails (1)."""
    engine = AsyncEngine(functools.partial(LLMEngine, engine_args))     # built and stepped on one thread
    llm_engine = engine.engine
    app = create_app(engine, options)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    server = DrainingServer(config, app.state.kestrel)
    if llm_engine.ranks is not None:
        threading.Thread(target=_stop_when_a_rank_fails, args=(llm_engine, server), daemon=True).start()
    try:
        server.run()
    finally:
        engine.shutdown()           # the LLMEngine's too, on its thread
    return 1 if llm_engine.rank_failure() else 0


def _stop_when_a_rank_fails(engine: LLMEngine, server: uvicorn.Server) -> None:
    """Stop the server (no draining: no step can run) once a rank has failed, even while it is idle."""
    while not server.should_exit:
        failure = engine.rank_failure()
        if failure:
            log.error("%s; stopping the server", failure)
            server.should_exit = True
            return
        time.sleep(RANK_POLL_S)
