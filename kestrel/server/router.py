"""`kestrel router`: SGLang's router (sglang-router) in front of kestrel servers, started with kestrel's defaults
(loopback, cache-aware routing, health checks every 10 s; Prometheus metrics on the router's host, at its port
minus 1000 (plus 1000 below port 2024), so 29000 for the router's default 30000 and two routers on two ports do
not collide); every other flag goes to the router unchanged."""

from __future__ import annotations

import importlib.util
import os
import sys

DEFAULTS = {"--host": "127.0.0.1", "--policy": "cache_aware", "--health-check-interval-secs": "10"}


ROUTER_PORT = 30000
"""sglang-router's default --port."""
METRICS_BELOW = 1000
"""The Prometheus port's distance below the router's port."""


def router_command(args: list[str]) -> list[str]:
    """The sglang_router command line for `kestrel router ARGS`."""
    given = dict(_flag_values(args))
    port = int(given.get("--port", ROUTER_PORT))
    metrics_port = port - METRICS_BELOW if port - METRICS_BELOW >= 1024 else port + METRICS_BELOW
    defaults = {**DEFAULTS, "--prometheus-host": given.get("--host", DEFAULTS["--host"]),
                "--prometheus-port": str(metrics_port)}
    missing = [part for flag, value in defaults.items() if flag not in given for part in (flag, value)]
    return [sys.executable, "-m", "sglang_router.launch_router", *missing, *args]


def _flag_values(args: list[str]) -> list[tuple[str, str]]:
    """(flag, its first value or "") for every --flag in args, in `--flag value` or `--flag=value` form."""
    pairs = []
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            flag, _, value = arg.partition("=")
            if not value and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
            pairs.append((flag, value))
    return pairs


def run_router(args: list[str]) -> None:
    """Replace this process with the router; a ValueError if sglang-router is not installed."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError("SGLang's router is not installed; run: pip install sglang-router==0.3.2")
    command = router_command(args)
    os.execv(command[0], command)
