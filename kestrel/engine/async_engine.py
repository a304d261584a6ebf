"""The engine on its own thread, for asyncio callers: the engine loop never runs on the server's event loop.

Coroutines hand requests and aborts to the engine thread through a queue; the thread applies them between steps,
runs steps while there is work it can schedule (otherwise it sleeps until the next command), delivers each
request's outputs to that request's asyncio queue (one wake-up of the event loop per step for all of them), and
publishes a snapshot of what it holds after each turn.

Built from a function that makes the engine (what `kestrel serve` does), the thread also builds the engine and shuts
it down: then every torch op of the process runs on that one thread. libgomp gives each thread that starts OpenMP
work its own team, and once the process holds more OpenMP threads than cores its idle workers stop spinning and
sleep between parallel regions: with the model loaded on the main thread and stepped on this one, the 437M K3's
decode step on two cores took 45-52 ms against 27-30 with both on one thread (a single thread's speed).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from .engine import LLMEngine
from .handoff import Handoff
from .outputs import RequestOutput
from .sampling import SamplingParams

log = logging.getLogger("kestrel")


@dataclass(frozen=True)
class EngineStats:
    """What the engine holds right now (read by /metrics and the admission limit)."""

    running: int                # sequences holding a state slot
    waiting: int                # sequences queued or preempted
    running_requests: int       # requests with at least one running sequence
    kv_pages_used: int          # held by sequences (not counting pages only the prefix cache holds)
    kv_pages_total: int
    state_slots_used: int       # held by sequences (not counting prefix-cache snapshots)
    state_slots_total: int
    cache_prompt_tokens: int = 0     # prefix cache: prompt tokens looked up since start
    cache_hit_tokens: int = 0        # of those, served from the cache
    cache_pages: int = 0             # pages in the tree
    cache_snapshots: int = 0         # KDA state snapshots held
    spec_verifications: int = 0      # speculative decoding: verification steps, draft tokens, accepted ones
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_histogram: tuple[int, ...] = ()    # [j]: verifications that accepted j draft tokens
    spec_draft_seconds: float = 0.0
    spec_verify_seconds: float = 0.0
    expert_rank_load: tuple[int, ...] = ()    # expert parallelism: token-expert pairs each EP rank computed in the
    expert_rank_imbalance: float = 1.0         # last window (rank 0's stage), and their max / mean
    eplb_rebalances: int = 0


class RequestFailed(RuntimeError):
    """The engine could not finish this request (the others carry on)."""


class RequestTimedOut(RuntimeError):
    """The request ran past its deadline and was aborted."""


class AsyncEngine:
    """Runs an LLMEngine on a daemon thread; `generate` streams a request's cumulative outputs.

    engine: the LLMEngine, or a function that builds it, called on the engine thread (which then owns it: `shutdown`
    shuts it down there too; the module docstring says why). An exception building it is raised here."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]):
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        built: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._engine_thread, args=(engine, built), name="kestrel-engine",
                                        daemon=True)
        self._thread.start()
        outcome = built.get()
        if isinstance(outcome, BaseException):
            self._thread.join()
            raise outcome

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def sampling_defaults(self) -> dict[str, float]:
        return self.engine.sampling_defaults

    @property
    def grammars(self):
        """The engine's GrammarCompiler (thread-safe), or None without a tokenizer."""
        return self.engine.grammars

    def stats(self) -> EngineStats:
        """What the engine held after its last turn (published by the engine thread; safe from any thread)."""
        return self._stats

    def _snapshot(self) -> EngineStats:
        """Pools and prefix caches summed over the DP groups' schedulers (one without DP attention)."""
        groups = self.engine.scheduler.groups
        caches = [g.prefix_cache for g in groups if g.prefix_cache is not None]
        snapshots = sum(cache.num_snapshots for cache in caches)
        cached = {} if not caches else dict(
            cache_prompt_tokens=sum(c.stats.prompt_tokens for c in caches),
            cache_hit_tokens=sum(c.stats.cached_tokens for c in caches),
            cache_pages=sum(c.num_pages for c in caches), cache_snapshots=snapshots)
        spec = self.engine.spec_stats
        states = [g.state_pool for g in groups]
        balancer = self.engine.runner.balancer
        if balancer is not None:
            cached |= dict(expert_rank_load=tuple(balancer.rank_load), expert_rank_imbalance=balancer.imbalance,
                           eplb_rebalances=balancer.rebalances)
        return EngineStats(spec_verifications=spec.verifications, spec_draft_tokens=spec.draft_tokens,
                           spec_accepted_tokens=spec.accepted_tokens,
                           spec_accepted_histogram=tuple(spec.accepted_histogram),
                           spec_draft_seconds=spec.draft_seconds, spec_verify_seconds=spec.verify_seconds,
                           running=sum(len(g.running) for g in groups), waiting=sum(len(g.waiting) for g in groups),
                           running_requests=self.engine.num_running_requests(),
                           kv_pages_used=sum(g.kv_pool.num_used for g in groups),
                           kv_pages_total=sum(g.kv_pool.num_pages for g in groups),
                           state_slots_used=sum(p.num_slots - p.num_free for p in states) - snapshots,
                           state_slots_total=sum(p.num_slots for p in states), **cached)

    @property
    def num_requests(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._streams)

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0, timeout: float | None = None,
                       handoff: Callable[[Handoff], None] | None = None,
                       cache_point: int | None = None) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its cumulative outputs until it finishes. A ValueError (bad request),
        RequestFailed, or RequestTimedOut (`timeout` seconds after submission) is raised here; leaving the
        iteration early aborts the request. handoff, cache_point: as LLMEngine.add_request's (handoff is called
        on the engine thread)."""
        command = ("add", request_id, prompt, params, priority, handoff, cache_point)
        async for output in self._run(request_id, command, timeout):
            yield output

    async def generate_prefilled(self, request_id: str, handoff: Handoff, params: SamplingParams,
                                 priority: int = 0, timeout: float | None = None) -> AsyncIterator[RequestOutput]:
        """As generate, for a request continued from a prefill instance's handoff (LLMEngine.add_prefilled_request)."""
        async for output in self._run(request_id, ("add_prefilled", request_id, handoff, params, priority), timeout):
            yield output

    async def _run(self, request_id: str, command: tuple, timeout: float | None) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, outputs)
        self._commands.put(command)
        finished = False
        try:
            while True:
                try:
                    item = await (outputs.get() if deadline is None
                                  else asyncio.wait_for(outputs.get(), deadline - loop.time()))
                except TimeoutError:
                    raise RequestTimedOut(f"the request ran longer than this server's limit of {timeout:g} s "
                                          "(--request-timeout) and was aborted.") from None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    async def flush_cache(self) -> bool:
        """Empty the prefix cache (SGLang's /flush_cache); False, with nothing done, while any request is queued or
        running."""
        loop = asyncio.get_running_loop()
        flushed = loop.create_future()
        self._commands.put(("flush", loop, flushed))
        return await flushed

    def abort_all(self, reason: str) -> None:
        """Abort every request; each stream ends with its output so far, finish_reason "abort" and `reason`."""
        self._commands.put(("abort_all", reason))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (requests still running are abandoned), and the engine with it when the thread
        built it."""
        self._stopped.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)

    def _engine_thread(self, engine: LLMEngine | Callable[[], LLMEngine], built: queue.Queue) -> None:
        """The engine thread: build the engine (when given a function), publish it, loop, and shut it down when
        this thread owns it."""
        owns = not isinstance(engine, LLMEngine)
        try:
            self.engine = engine() if owns else engine
            self._stats = self._snapshot()
        except BaseException as e:          # noqa: BLE001 - handed to the constructor, which raises it
            built.put(e)
            return
        built.put(self.engine)
        try:
            self._loop()
        finally:
            if owns:
                self.engine.shutdown()

    def _loop(self) -> None:
        while not self._stopped.is_set():
            idle = not self.engine.has_unfinished_requests() or self.engine.stalled
            self._apply_commands(block=idle)
            if self.engine.has_unfinished_requests():
                self._step()
            else:
                self._stats = self._snapshot()  # after the commands and aborts that emptied it

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind, *rest = command
        if kind in ("add", "add_prefilled"):
            add = self.engine.add_request if kind == "add" else self.engine.add_prefilled_request
            try:
                add(*rest)
            except ValueError as e:
                self._deliver(rest[0], e)
        elif kind == "abort":
            self.engine.abort_request(rest[0])
        elif kind == "flush":
            loop, flushed = rest
            idle = not self.engine.has_unfinished_requests()
            for group in self.engine.scheduler.groups if idle else []:
                if group.prefix_cache is not None:
                    group.prefix_cache.reset()
            loop.call_soon_threadsafe(flushed.set_result, idle)
        elif kind == "abort_all":
            self._deliver_all([(request_id, self.engine.abort_request(request_id, rest[0]))
                               for request_id in list(self.engine.requests)])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:   # an engine fault outside every request's guard fails the requests running
            log.exception("engine step failed")
            failed = self.engine.fail_running()
            self._stats = self._snapshot()
            error = f"the engine failed while running this request: {e}"
            self._deliver_all([(request_id, RequestFailed(error)) for request_id in failed])
            return
        self._stats = self._snapshot()      # before delivering: a client that saw its tokens is counted running
        self._deliver_all([(output.request_id, _failure(output) or output) for output in outputs])

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand each item to its request's stream, waking each event loop once for all of its requests (a wake-up
        costs the engine thread a system call and a turn of the GIL)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                loop, outputs = stream
                batches.setdefault(loop, []).append((outputs, item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)


def _failure(output: RequestOutput) -> RequestFailed | None:
    """The failure of a request whose sequence ended with finish_reason "error", else None."""
    failed = [c for c in output.outputs if c.finish_reason == "error"]
    return RequestFailed(failed[0].stop_reason) if failed else None


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    """On the event loop: put each item on its stream's queue."""
    for outputs, item in batch:
        outputs.put_nowait(item)
