"""A PD handoff's failures end with a clear error: a prefill peer that stalls mid-transfer fails the fetch at its
deadline, a decode peer that never acknowledges is dropped at the prefill side's, and a second prefill request for a room another one holds is refused (through the server: a 409 in
OpenAI's shape) while the first is handed over and answered as if alone. And kestrel.disagg has no import circle."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import torch

from kestrel.disagg.outbox import Outbox, RoomInUse
from kestrel.engine.handoff import Handoff
from kestrel.disagg.tcp import TcpBackend
from kestrel.disagg.wire import TransferError, read_frame, write_frame
from kestrel.server.options import ServerOptions
from server_helpers import MODEL_NAME, LiveServer, free_port, write_model_folder
from test_import_graph import find_cycle, import_graph


def test_a_peer_that_stalls_mid_transfer_fails_the_fetch_at_its_deadline():
    """A valid header for one 1,000-byte tensor, then 10 bytes, then silence on an open connection."""
    async def stalling(reader, writer):
        await read_frame(reader)
        await write_frame(writer, {"prompt_ids": [5], "first_token": 6, "num_pages": 0, "tensors": [
            {"name": "0.kda.0.conv", "dtype": "uint8", "shape": [1000], "nbytes": 1000, "crc32": 0}]})
        writer.write(bytes(10))
        await writer.drain()
        await asyncio.sleep(60)

    async def main():
        port = free_port()
        server = await asyncio.start_server(stalling, "127.0.0.1", port)
        try:
            with pytest.raises(TransferError, match=r"did not hand this request over within 1 s"):
                await asyncio.wait_for(TcpBackend().fetch("127.0.0.1", port, (6, 0), 1.0), 10)
        finally:
            server.close()
    asyncio.run(main())


def test_a_decode_peer_that_never_acknowledges_is_dropped_at_the_deadline():
    """The prefill side sends the handoff to a peer that reads it and never answers: the transfer fails within
    --disaggregation-timeout and the prefill side closes the connection, releasing the handoff."""
    async def main():
        outbox, backend, port = Outbox(asyncio.get_running_loop(), 1.0), TcpBackend(), free_port()
        await backend.serve(outbox, "127.0.0.1", port)
        outcome = outbox.open((4, 0))
        outbox.publish((4, 0), Handoff([5], 6, {"0.kda.0.conv": torch.zeros(8, dtype=torch.uint8)}, 0))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await write_frame(writer, {"room": 4, "index": 0})
            assert "error" not in await read_frame(reader)
            assert await asyncio.wait_for(reader.read(), 10) == bytes(8)     # the tensor, then the close
            with pytest.raises(TransferError, match="within 1 s"):
                await outcome
        finally:
            writer.close()
            await backend.close()
    asyncio.run(main())


def test_a_room_is_opened_by_one_prefill_request_only():
    async def main():
        outbox = Outbox(asyncio.get_running_loop(), 30)
        first = outbox.open((3, 0))
        with pytest.raises(RoomInUse, match="bootstrap_room 3 is already in use"):
            outbox.open((3, 0))
        outbox.finish((3, 0))
        assert first.result() is None and len(outbox) == 0
        outbox.open((3, 0))                                  # free again once the first transfer ended
    asyncio.run(main())


@pytest.fixture(scope="module")
def prefill_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pd-prefill")
    write_model_folder(folder)
    options = ServerOptions(MODEL_NAME, disaggregation_mode="prefill", disaggregation_bootstrap_port=free_port(),
                            disaggregation_timeout=30)
    server = LiveServer(folder, options, page_size=4)
    yield server
    server.stop()


def test_a_second_request_for_a_held_room_is_refused_and_the_first_goes_on(prefill_server):
    server, options = prefill_server, prefill_server.app.state.kestrel.options
    body = {"model": MODEL_NAME, "prompt": "to be or not to be", "max_tokens": 4, "temperature": 0,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": options.disaggregation_bootstrap_port,
            "bootstrap_room": 11}
    answers = []
    first = threading.Thread(target=lambda: answers.append(server.client().post("/v1/completions", json=body)))
    first.start()
    outbox = server.app.state.kestrel.pd.outbox
    for _ in range(500):                                   # the first request holds the room
        if len(outbox):
            break
        threading.Event().wait(0.02)
    second = server.client().post("/v1/completions", json=body)
    assert second.status_code == 409
    assert second.json()["error"] == {"message": "bootstrap_room 11 is already in use by another request on this "
                                                 "prefill instance; give every request its own room.",
                                      "type": "invalid_request_error", "param": "bootstrap_room", "code": 409}
    handoff = asyncio.run(TcpBackend().fetch("127.0.0.1", options.disaggregation_bootstrap_port, (11, 0), 30))
    first.join(60)
    (answer,) = answers
    assert answer.status_code == 200
    alone = asyncio.run(_fetch_alone(server, {**body, "bootstrap_room": 12}))
    assert handoff.first_token == alone.first_token and handoff.prompt_ids == alone.prompt_ids
    assert len(outbox) == 0


async def _fetch_alone(server: LiveServer, body: dict):
    """The handoff of body's request, served with nothing else in flight."""
    port = server.app.state.kestrel.options.disaggregation_bootstrap_port
    fetch = asyncio.create_task(TcpBackend().fetch("127.0.0.1", port, (body["bootstrap_room"], 0), 30))
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    return await fetch


def test_kestrel_disagg_is_in_no_import_circle():
    graph = import_graph()
    for module in (m for m in graph if m.startswith("kestrel.disagg")):
        reachable, todo = set(), list(graph[module])
        while todo:
            name = todo.pop()
            if name not in reachable:
                reachable.add(name)
                todo.extend(graph[name])
        assert module not in reachable, find_cycle({m: graph[m] for m in reachable | {module}})
