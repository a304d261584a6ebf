"""`kestrel router`: SGLang's router (sglang-router) in front of kestrel servers, started with kestrel's defaults
(loopback, cache-aware routing, health checks every 10 s); every other flag goes to the router unchanged."""

from __future__ import annotations

import importlib.util
import os
import sys

DEFAULTS = {"--host": "127.0.0.1", "--policy": "cache_aware", "--health-check-interval-secs": "10"}


def router_command(args: list[str]) -> list[str]:
    """The sglang_router command line for `kestrel router ARGS`."""
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    defaults = [part for flag, value in DEFAULTS.items() if flag not in given for part in (flag, value)]
    return [sys.executable, "-m", "sglang_router.launch_router", *defaults, *args]


def run_router(args: list[str]) -> None:
    """Replace this process with the router; a ValueError if sglang-router is not installed."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError("SGLang's router is not installed; run: pip install sglang-router==0.3.2")
    command = router_command(args)
    os.execv(command[0], command)
