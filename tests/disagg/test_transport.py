"""The TCP transfer backend on loopback: a handoff arrives bitwise equal (every dtype the caches use), in either
arrival order; a flipped byte, a peer that hangs up, and a handoff nobody fetches fail that transfer on both sides
and leave the outbox empty. Then the engine hook through it: a random K3.1 model's handoff, moved over TCP and
continued by a second engine, answers as one engine does, and zeroing the KDA state, the latent pages or the indexer
keys changes the answer (so the comparison would catch a zeroed or stale half); the same for a random Kimi-Linear
model (no indexer)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from kestrel.config import parse_config
from kestrel.disagg.outbox import Outbox
from kestrel.disagg.tcp import TcpBackend
from kestrel.disagg.wire import IntegrityError, TransferError, read_frame, read_handoff, write_frame, write_handoff
from kestrel.engine.args import EngineArgs
from kestrel.engine.outputs import Logprob
from kestrel.engine.async_engine import AsyncEngine
from kestrel.engine.engine import LLMEngine
from kestrel.engine.handoff import Handoff
from kestrel.engine.sampling import SamplingParams
from kestrel.models.checkpoint import build_model, save_model
from kestrel.models.init import init_weights
from kestrel.models.presets import tiny_config
from server_helpers import free_port


def sample_handoff() -> Handoff:
    g = torch.Generator().manual_seed(0)
    tensors = {"0.kda.0.conv": torch.randn(3, 24, generator=g),
               "0.kda.0.recurrent": torch.randn(2, 64, 64, generator=g),
               "1.mla.0.latent": torch.randn(4, 16, generator=g).to(torch.bfloat16),
               "1.mla.0.index_k": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
               "1.mla.0.scale": torch.rand(4, 1, generator=g)}
    return Handoff([5, 6, 7], 9, tensors, 1, {9: Logprob(-0.25, 1, "ab"), 4: Logprob(-1.5, 2, None)},
                   torch.Generator().manual_seed(3).get_state(),
                   [None, {6: Logprob(-0.5, 1, "c")}, {7: Logprob(-3.0, 4, None), 1: Logprob(-0.1, 1, "d")}])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


@contextlib.asynccontextmanager
async def prefill_side(timeout: float = 30.0):
    outbox, backend, port = Outbox(asyncio.get_running_loop(), timeout), TcpBackend(), free_port()
    await backend.serve(outbox, "127.0.0.1", port)
    try:
        yield outbox, backend, port
    finally:
        await backend.close()


def test_handoff_arrives_bitwise_equal_in_either_order():
    async def main():
        sent = sample_handoff()
        async with prefill_side() as (outbox, backend, port):
            outcome = outbox.open((1, 0))
            outbox.publish((1, 0), sent)                                   # published first
            got = await backend.fetch("127.0.0.1", port, (1, 0), 10)
            assert await outcome is None
            outcome = outbox.open((2, 0))
            fetch = asyncio.create_task(backend.fetch("127.0.0.1", port, (2, 0), 10))   # fetched first
            await asyncio.sleep(0)
            outbox.publish((2, 0), sent)
            got2 = await fetch
            assert await outcome is None and len(outbox) == 0
        for received in (got, got2):
            assert (received.prompt_ids, received.first_token, received.num_pages) == ([5, 6, 7], 9, 1)
            assert received.first_logprobs == sent.first_logprobs
            assert received.prompt_logprobs == sent.prompt_logprobs
            assert same_bits(received.generator_state, sent.generator_state)
            assert received.tensors.keys() == sent.tensors.keys()
            assert all(same_bits(received.tensors[k], t) for k, t in sent.tensors.items())
    asyncio.run(main())


async def corrupting_proxy(target_port: int, flip_at: int) -> tuple[asyncio.Server, int]:
    """A relay to target_port that flips one byte, flip_at bytes into what the prefill side sends."""
    async def relay(client_reader, client_writer):
        reader, writer = await asyncio.open_connection("127.0.0.1", target_port)

        async def pipe(src, dst, flip):
            seen = 0
            try:
                while data := await src.read(65536):
                    if flip and seen <= flip_at < seen + len(data):
                        data = bytearray(data)
                        data[flip_at - seen] ^= 0x01
                    seen += len(data)
                    dst.write(bytes(data))
                    await dst.drain()
            finally:
                dst.close()                          # an end or a reset on one side ends the other side too
        await asyncio.gather(pipe(client_reader, writer, False), pipe(reader, client_writer, True),
                             return_exceptions=True)
    port = free_port()
    return await asyncio.start_server(relay, "127.0.0.1", port), port


def test_a_flipped_byte_fails_that_transfer_on_both_sides():
    async def main():
        sent = sample_handoff()
        async with prefill_side() as (outbox, backend, port):
            proxy, proxy_port = await corrupting_proxy(port, flip_at=20_000)   # inside the recurrent state
            outcome = outbox.open((3, 0))
            outbox.publish((3, 0), sent)
            with pytest.raises(IntegrityError, match="arrived corrupted"):
                await backend.fetch("127.0.0.1", proxy_port, (3, 0), 10)
            with pytest.raises(TransferError, match="arrived corrupted"):
                await outcome
            assert len(outbox) == 0
            proxy.close()
    asyncio.run(main())


class _Bytes:
    """A stream writer that keeps what is written."""
    def __init__(self):
        self.data = bytearray()

    def write(self, data) -> None:
        self.data += data

    async def drain(self) -> None:
        """Nothing to wait for: every byte is kept as soon as it is written."""


def test_a_corrupted_transfer_is_read_to_its_end_before_the_verdict():
    """The decode side reads every byte of a corrupted handoff before it answers, so its close cannot reset the
    connection over unread bytes and lose the answer (the prefill side then waited out its timeout)."""
    async def main():
        sent = _Bytes()
        await write_handoff(sent, sample_handoff())
        await write_frame(sent, {"next": True})
        first_tensor = 4 + int.from_bytes(sent.data[:4], "big")   # after the header frame
        sent.data[first_tensor + 10] ^= 0x01                 # inside the conv state, the first of five tensors
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(sent.data))
        reader.feed_eof()
        header = await read_frame(reader)
        with pytest.raises(IntegrityError, match="tensor 0.kda.0.conv arrived corrupted"):
            await read_handoff(reader, header)
        assert await read_frame(reader) == {"next": True}    # what follows the handoff is next, nothing in between
    asyncio.run(main())


def test_a_decode_side_that_hangs_up_or_never_comes_fails_the_prefill_side():
    async def main():
        async with prefill_side() as (outbox, backend, port):
            outcome = outbox.open((4, 0))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await write_frame(writer, {"room": 4, "index": 0})
            writer.close()                                    # the decode side goes away before the prompt is done
            with pytest.raises(TransferError, match="hung up"):
                await outcome
            outbox.publish((4, 0), sample_handoff())          # the prefill side finishing later leaves nothing
            await asyncio.sleep(0)
            assert len(outbox) == 0
        async with prefill_side(timeout=0.3) as (outbox, backend, port):
            unfetched = outbox.open((5, 0))
            outbox.publish((5, 0), sample_handoff())
            with pytest.raises(TransferError, match="did not arrive"):
                await unfetched                               # nobody fetched it within the timeout
            assert len(outbox) == 0
    asyncio.run(main())


def test_a_prefill_side_that_dies_mid_transfer_fails_the_fetch():
    async def truncated(reader, writer):
        await reader.read(100)
        writer.write(b"\x00\x00\x01\x00{")                   # a frame header promising 256 bytes, then nothing
        await writer.drain()
        writer.close()

    async def main():
        port = free_port()
        server = await asyncio.start_server(truncated, "127.0.0.1", port)
        with pytest.raises(TransferError, match="closed the connection"):
            await TcpBackend().fetch("127.0.0.1", port, (6, 0), 10)
        server.close()
        with pytest.raises(TransferError, match="cannot reach"):
            await TcpBackend().fetch("127.0.0.1", port, (6, 0), 10)
    asyncio.run(main())


@pytest.fixture(scope="module", params=["k3.1-tiny", "kimi-linear-tiny"])
def engines(request, tmp_path_factory):
    """Prefill, decode and unified engines of one random model: random weights make every half of the state move
    its greedy tokens (the bundled model's are robust to a zeroed MLA half, and its indexer keeps every token)."""
    folder = tmp_path_factory.mktemp(request.param)
    raw = tiny_config(request.param)
    raw.get("text_config", raw)["vocab_size"] = 400
    save_model(init_weights(build_model(parse_config(raw), torch.float32), seed=0, std=0.1), folder, config_json=raw)
    made = [AsyncEngine(LLMEngine(EngineArgs(model=str(folder), page_size=4, chunked_prefill_size=8)))
            for _ in range(3)]
    yield made
    for engine in made:
        engine.shutdown()


def test_engine_handoff_over_tcp_continues_as_one_engine(engines):
    prefiller, decoder, unified = engines
    prompt = list(range(10, 60))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def last(stream):
        output = None
        async for output in stream:
            pass
        return output

    async def main():
        expected = (await last(unified.generate("u", prompt, params))).outputs[0].token_ids
        async with prefill_side() as (outbox, backend, port):
            handed: list[Handoff] = []

            def publish(handoff: Handoff) -> None:
                handed.append(handoff)
                outbox.publish((7, 0), handoff)
            outcome = outbox.open((7, 0))
            await last(prefiller.generate("p", prompt, params, handoff=publish))
            received = await backend.fetch("127.0.0.1", port, (7, 0), 10)
            assert await outcome is None
        sent = handed[0]
        assert received.tensors.keys() == sent.tensors.keys() and received.num_pages == sent.num_pages >= 2
        assert all(same_bits(received.tensors[k], t) for k, t in sent.tensors.items())
        continued = await last(decoder.generate_prefilled("d", received, params))
        assert continued.outputs[0].token_ids == expected
        halves = [h for h in (".kda.", ".latent", ".index_keys") if any(h in k for k in sent.tensors)]
        assert halves[:2] == [".kda.", ".latent"]
        for half in halves:                                # each half matters: zeroing it changes the continuation
            zeroed = {k: torch.zeros_like(t) if half in k else t for k, t in received.tensors.items()}
            broken = Handoff(received.prompt_ids, received.first_token, zeroed, received.num_pages)
            output = await last(decoder.generate_prefilled(f"z{half}", broken, params))
            assert output.outputs[0].token_ids != expected, half
        for engine in engines:
            assert engine.stats().kv_pages_used == 0 and engine.stats().state_slots_used == 0
    asyncio.run(main())
