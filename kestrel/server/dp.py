"""`kestrel serve --dp-size N`: N `kestrel serve` processes (one engine each) on free loopback ports, and SGLang's
router (`kestrel router`'s defaults: cache-aware) in front of them on the user's --host and --port. SIGTERM or SIGINT
stops them all (exit 0); a process that exits on its own stops the others (exit 1)."""

from __future__ import annotations

import importlib.util
import logging
import signal
import socket
import subprocess
import sys
import time

import httpx

from .router import router_command

log = logging.getLogger("kestrel")
POLL_S = 0.5
OWN_FLAGS = ("--dp-size", "--host", "--port")
"""serve's flags that the launcher sets for each worker itself (removed from the arguments workers get)."""


def worker_args(serve_args: list[str]) -> list[str]:
    """The arguments after `kestrel serve`, without --dp-size, --host and --port (either spelling, with its value)."""
    out, skip = [], False
    for arg in serve_args:
        if skip:
            skip = False
        elif arg in OWN_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in OWN_FLAGS)):
            out.append(arg)
    return out


def run_dp(serve_args: list[str], dp_size: int, host: str, port: int) -> int:
    """Run the workers and the router until a signal (0) or until one of them exits (1); a ValueError if
    sglang-router is not installed."""
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError("--dp-size runs SGLang's router, which is not installed; run: pip install "
                         "sglang-router==0.3.2")
    ports = [_free_port() for _ in range(dp_size)]
    rest = worker_args(serve_args)
    procs = {f"worker {i} (port {p})": subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", *rest,
                                                       "--host", "127.0.0.1", "--port", str(p)])
             for i, p in enumerate(ports)}
    stopping: list[int] = []
    handlers = {sig: signal.signal(sig, lambda s, _: stopping.append(s)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        waiting = set(urls)
        while waiting and not stopping and _all_alive(procs):
            waiting = {url for url in waiting if not _healthy(url)}
            time.sleep(POLL_S)
        if not waiting and not stopping:
            log.info("%d workers up at %s; starting the router on %s:%d", dp_size, " ".join(urls), host, port)
            procs["the router"] = subprocess.Popen(router_command(["--worker-urls", *urls, "--host", host,
                                                                   "--port", str(port)]))
        while not stopping and _all_alive(procs):
            time.sleep(POLL_S)
        return 0 if stopping else 1
    finally:
        _stop(procs)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _all_alive(procs: dict[str, subprocess.Popen]) -> bool:
    for name, proc in procs.items():
        if proc.poll() is not None:
            log.error("%s exited with code %d; stopping the others", name, proc.returncode)
            return False
    return True


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM each process (workers drain), then wait; kill any still running after their shutdown timeout."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
