"""torch.compile on a background thread, so that serving never waits for a compile.

The engine asks for a graph the first time it needs one (a decode step's batch size and page-table width, the KDA
prefill's chunk terms) and runs that step eagerly until the graph is ready; one daemon thread compiles the asked
graphs one at a time, in the order asked. Compiling is mostly Python (dynamo's tracing, inductor's lowering)
sharing the interpreter with the engine thread, whose eager step gives the interpreter up at every op and would
wait a whole switch interval (5 ms by default) to get it back; while a compile runs, the switch interval is
SWITCH_INTERVAL_S, so that an eager step slows by a fraction instead of stopping for seconds. The thread compiles
with no gradients, as the engine runs (a compile that failed is logged and its step stays eager).

One part of compiling is not thread-safe: while torch.fx traces a function (AOTAutograd's make_fx, 1.1-2.0 s at a
time on the bundled model), it replaces torch.nn.Module.__call__ for the whole process, and a module called on the
engine thread meanwhile would go to the tracer (NameError: module is not installed as a submodule). So fx's tracing
takes MODULE_CALLS, which the engine holds through each eager forward (`module_calls`; a compiled graph calls no
module): a forward waits for a trace under way (the longest waits the engine sees), and a trace for the forward
under way. The lock is not fair (a busy engine would take it back at once, step after step), so a forward first
lets a waiting trace have it. And torch.compiler.is_compiling() is one process-wide flag, True for the whole
compile: code that picks a traced path asks torch.compiler.is_dynamo_compiling() instead (dynamo folds it to True;
it is False at run time).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator

import torch
import torch.fx._symbolic_trace as fx_trace

log = logging.getLogger("kestrel")

SWITCH_INTERVAL_S = 1e-4
"""The interpreter's switch interval while a compile runs. On the bundled model, two cores: the engine thread's
eager decode step took 9.2 ms alone, and a median 10.8 ms (5 ms interval: seconds) while a decode graph compiled
beside it; 2e-5 s made the compile thread hog the interpreter instead."""

MODULE_CALLS = threading.RLock()
"""Held by torch.fx while it traces (it patches torch.nn.Module.__call__ process-wide), and by the engine through
each eager forward (module_calls)."""
_traces_waiting = [0]         # fx traces waiting for MODULE_CALLS (changed under _counting)
_counting = threading.Lock()


@contextlib.contextmanager
def module_calls() -> Iterator[None]:
    """Hold MODULE_CALLS, after any fx trace waiting for it has had it (see the module's docstring)."""
    while _traces_waiting[0]:
        time.sleep(1e-4)
    with MODULE_CALLS:
        yield


@functools.cache
def _lock_fx_tracing() -> None:
    """Make torch.fx's Tracer.trace (make_fx's tracers derive from it) hold MODULE_CALLS while it traces."""
    trace = fx_trace.Tracer.trace

    @functools.wraps(trace)
    def locked(self, *args, **kwargs):
        with _counting:
            _traces_waiting[0] += 1
        try:
            MODULE_CALLS.acquire()
        finally:
            with _counting:
                _traces_waiting[0] -= 1
        try:
            return trace(self, *args, **kwargs)
        finally:
            MODULE_CALLS.release()
    fx_trace.Tracer.trace = locked


class BackgroundCompiler:
    """Compiles the graphs asked for, on one thread, while the engine runs their steps eagerly."""

    def __init__(self):
        _lock_fx_tracing()
        self._asked: set[Hashable] = set()
        self._ready: set[Hashable] = set()
        self._queue: queue.SimpleQueue[tuple[Hashable, Callable[[], object]] | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._pending = 0
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="kestrel-compile", daemon=True)
        self._thread.start()

    def ready(self, key: Hashable) -> bool:
        """Whether key's graph is compiled."""
        return key in self._ready

    def ask(self, key: Hashable, compile: Callable[[], object]) -> None:
        """Compile key's graph by calling compile() on the thread, unless asked before (a failed compile is never
        retried)."""
        if key in self._asked:
            return
        self._asked.add(key)
        with self._idle:
            self._pending += 1
        self._queue.put((key, compile))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every graph asked so far is compiled (or failed); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Compile nothing more (a compile under way finishes; the thread then ends)."""
        self._closed = True
        self._queue.put(None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None and not self._closed:
            key, compile = item
            interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            try:
                with torch.inference_mode():
                    compile()
                self._ready.add(key)
            except Exception as e:           # inductor failed (no C++ compiler, an op it cannot trace)
                log.warning("torch.compile of %s failed; that step stays eager: %s", key, e)
            finally:
                sys.setswitchinterval(interval)
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
