"""A server's part in a disaggregated request: what the prefill instance and the decode instance each run for one
prompt of an HTTP request, given the bootstrap fields the router added (host, port, room).

A prompt with n > 1 is n engine requests on each side (SGLang's router gives the prompt one room; sequence j is
key (room, j), seeded seed + j as the unified engine seeds it). Both sides yield cumulative RequestOutputs shaped
as the unified engine's, so the server's response code is the same for all three modes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from ..engine.async_engine import AsyncEngine
from ..engine.outputs import RequestOutput
from ..engine.sampling import SamplingParams
from .outbox import Key, Outbox, RoomInUse
from .transport import TransferBackend
from .wire import TransferError


@dataclass(frozen=True)
class Bootstrap:
    """Where the decode instance finds a prompt's handoff: the prefill instance's bootstrap address and the room."""

    host: str
    port: int
    room: int


def _sequence_params(params: SamplingParams, j: int) -> SamplingParams:
    return replace(params, n=1, seed=None if params.seed is None else params.seed + j)


def _combined(parts: list[RequestOutput], request_id: str) -> RequestOutput:
    """One RequestOutput with the n sequences that ran as separate engine requests."""
    first = parts[0]
    outputs = [replace(p.outputs[0], index=j) for j, p in enumerate(parts)]
    return RequestOutput(request_id, first.prompt, first.prompt_token_ids, first.prompt_logprobs, outputs,
                         all(p.finished for p in parts), first.num_cached_tokens)


async def _interleaved(streams: list[AsyncIterator[RequestOutput]], watched: list[asyncio.Future],
                       request_id: str) -> AsyncIterator[RequestOutput]:
    """The streams' outputs combined, until every stream has finished; an exception from a stream or from a
    watched future (a failed transfer) ends it. Leaving early closes the streams (aborting their requests)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(j: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((j, output))
        except Exception as e:
            queue.put_nowait((j, e))

    for future in watched:
        future.add_done_callback(lambda f: queue.put_nowait((-1, f.exception()))
                                 if not f.cancelled() and f.exception() else None)
    tasks = [asyncio.create_task(pump(j, s)) for j, s in enumerate(streams)]
    latest: list[RequestOutput | None] = [None] * len(streams)
    try:
        while not all(o is not None and o.finished for o in latest):
            j, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            latest[j] = item
            if all(o is not None for o in latest):
                yield _combined(latest, request_id)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def prefill(engine: AsyncEngine, outbox: Outbox, request_id: str, prompt: str | list[int], params: SamplingParams,
            priority: int, timeout: float | None, room: int) -> AsyncIterator[RequestOutput]:
    """Take the outbox's keys (room, j) for the n sequences (RoomInUse, keeping none, if another request holds
    one), then compute the prompt and first token of each, hand each to the outbox under its key, and end once every
    handoff reached its decode instance (TransferError if one did not)."""
    keys = [(room, j) for j in range(params.n)]
    outcomes = []
    try:
        for key in keys:
            outcomes.append(outbox.open(key))
    except RoomInUse:
        for key in keys[:len(outcomes)]:
            outbox.finish(key, TransferError(f"the prefill request for bootstrap_room {room} was refused."))
        raise
    return _prefill(engine, outbox, request_id, prompt, params, priority, timeout, keys, outcomes)


async def _prefill(engine: AsyncEngine, outbox: Outbox, request_id: str, prompt: str | list[int],
                   params: SamplingParams, priority: int, timeout: float | None, keys: list[Key],
                   outcomes: list[asyncio.Future]) -> AsyncIterator[RequestOutput]:
    streams = [engine.generate(f"{request_id}-{j}", prompt, _sequence_params(params, j), priority, timeout,
                               handoff=lambda handoff, key=key: outbox.publish(key, handoff))
               for j, key in enumerate(keys)]
    last = None
    try:
        async for output in _interleaved(streams, outcomes, request_id):
            if not output.finished:
                yield output
            last = output
        await asyncio.gather(*map(asyncio.shield, outcomes))
    except BaseException as e:
        for key in keys:
            outbox.finish(key, TransferError(f"the prefill instance did not finish this request ({_reason(e)})."))
        raise
    yield last


def _reason(error: BaseException) -> str:
    return str(error) or type(error).__name__


async def decode(engine: AsyncEngine, backend: TransferBackend, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, priority: int, timeout: float | None, transfer_timeout: float,
                 bootstrap: Bootstrap) -> AsyncIterator[RequestOutput]:
    """Fetch each sequence's handoff from the prefill instance, then continue them here."""
    fetches = [asyncio.create_task(backend.fetch(bootstrap.host, bootstrap.port, (bootstrap.room, j),
                                                 transfer_timeout)) for j in range(params.n)]
    try:
        handoffs = await asyncio.gather(*fetches)
    finally:
        for fetch in fetches:
            fetch.cancel()
    if any(h.prompt_ids != prompt_ids for h in handoffs):
        raise TransferError("the prefill instance computed another prompt than this request's (are both instances "
                            "serving the same model and tokenizer?).")
    streams = [engine.generate_prefilled(f"{request_id}-{j}", h, _sequence_params(params, j), priority, timeout)
               for j, h in enumerate(handoffs)]
    async for output in _interleaved(streams, [], request_id):
        yield output
