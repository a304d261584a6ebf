"""AsyncEngine: streams on the event loop equal the engine's own outputs, and a step wakes the loop once; an engine
built from a function is built, stepped and shut down on the engine thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kestrel.engine.args import EngineArgs
from kestrel.engine.async_engine import AsyncEngine
from kestrel.engine.engine import LLMEngine
from kestrel.engine.sampling import SamplingParams

PROMPTS = ["the quick brown fox", "to be or not", "all the world's a stage", "héllo wörld"]


def _engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), page_size=4))


def test_concurrent_streams_equal_the_engines_outputs_with_one_wake_up_per_step(model_dir):
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True, logprobs=2) for i in range(4)]
    offline = _engine(model_dir)              # the oracle: the same requests stepped on this thread
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        offline.add_request(str(i), prompt, p)
    expected: dict[str, list] = {}
    while offline.has_unfinished_requests():
        for output in offline.step():
            expected.setdefault(output.request_id, []).append(output)

    engine = AsyncEngine(_engine(model_dir))
    steps = wake_ups = 0
    step = engine.engine.step

    def counted_step():
        nonlocal steps
        outputs = step()
        steps += bool(outputs)
        return outputs
    engine.engine.step = counted_step

    async def run() -> dict[str, list]:
        nonlocal wake_ups
        loop = asyncio.get_running_loop()
        wake = loop.call_soon_threadsafe

        def counted_wake(*args):
            nonlocal wake_ups
            wake_ups += 1
            return wake(*args)
        loop.call_soon_threadsafe = counted_wake

        async def collect(i: int) -> list:
            return [o async for o in engine.generate(str(i), PROMPTS[i], params[i])]
        streams = await asyncio.gather(*(collect(i) for i in range(4)))
        return {str(i): s for i, s in enumerate(streams)}
    try:
        streamed = asyncio.run(run())
    finally:
        engine.shutdown()
    for request_id, outputs in expected.items():
        got, want = streamed[request_id], outputs[-1].outputs[0]
        assert [len(o.outputs[0].token_ids) for o in got] == list(range(1, len(want.token_ids) + 1))
        final = got[-1].outputs[0]
        assert (final.token_ids, final.text, final.finish_reason) == (want.token_ids, want.text, "length")
        for entry, wanted in zip(final.logprobs, want.logprobs, strict=True):
            assert entry.keys() == wanted.keys()
            assert all(abs(entry[t].logprob - wanted[t].logprob) < 1e-4 for t in entry)
        assert got[-1].finished and all(not o.finished for o in got[:-1])
    assert wake_ups <= steps      # every step's outputs, for all four requests, in one wake-up


def test_an_engine_built_from_a_function_lives_on_the_engine_thread(model_dir):
    """Given a function, the engine thread builds the engine (so that one thread runs every torch op: the module
    docstring), serves from it, and shuts it down; an error building it is raised to the caller."""
    threads, shut = [], []

    def build() -> LLMEngine:
        threads.append(threading.current_thread())
        engine = _engine(model_dir)
        shutdown = engine.shutdown
        engine.shutdown = lambda: shut.append(threading.current_thread()) or shutdown()
        return engine

    engine = AsyncEngine(build)
    assert threads == [engine._thread] and threads[0] is not threading.current_thread()

    async def run() -> str:
        async for output in engine.generate("a", "to be or not", SamplingParams(max_tokens=3, ignore_eos=True)):
            last = output
        return last.outputs[0].text

    assert asyncio.run(run())
    engine.shutdown()
    assert shut == threads

    def broken() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(broken)
