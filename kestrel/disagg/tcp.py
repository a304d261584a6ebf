"""The TCP transfer backend: the prefill instance's bootstrap port is also its data port (asyncio streams).

One connection per (room, index): the decode instance sends {"room", "index"}; the prefill instance answers, once
that handoff exists, with the handoff (wire.py) or {"error"}; the decode instance verifies every tensor and answers
{"ok": true} or {"error"}. A decode instance that hangs up before the handoff exists cancels it, so the prefill
request stops too; one that stalls is dropped after --disaggregation-timeout, and the handoff with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ..engine.handoff import Handoff
from .outbox import Key, Outbox
from .transport import TransferBackend
from .wire import TransferError, read_frame, read_handoff, write_frame, write_handoff

log = logging.getLogger("kestrel")


class TcpBackend(TransferBackend):
    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._outbox: Outbox | None = None

    async def serve(self, outbox: Outbox, host: str, port: int) -> None:
        self._outbox = outbox
        self._server = await asyncio.start_server(self._answer, host, port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_frame(reader)
            key = (int(request["room"]), int(request["index"]))
        except (TransferError, KeyError, TypeError, ValueError):
            writer.close()
            return
        try:
            await self._send(key, reader, writer)
        finally:
            writer.close()

    async def _send(self, key: Key, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        outbox = self._outbox
        take, hangup = asyncio.ensure_future(outbox.take(key)), asyncio.ensure_future(reader.read(1))
        await asyncio.wait({take, hangup}, return_when=asyncio.FIRST_COMPLETED)
        hangup.cancel()
        await asyncio.gather(hangup, return_exceptions=True)     # the reader is free again once it has ended
        if not take.done():
            take.cancel()
            outbox.finish(key, TransferError("the decode instance hung up before the prompt was computed."))
            return
        try:
            handoff = take.result()
        except TransferError as e:
            with contextlib.suppress(ConnectionError):
                await write_frame(writer, {"error": str(e)})
            return
        try:
            async with asyncio.timeout(outbox.timeout):       # a stalled decode instance holds no handoff for long
                await write_handoff(writer, handoff)
                ack = await read_frame(reader)
        except TimeoutError:
            outbox.finish(key, TransferError(f"the decode instance did not take this request's handoff within "
                                             f"{outbox.timeout:g} s (--disaggregation-timeout)."))
            return
        except (TransferError, ConnectionError) as e:
            outbox.finish(key, TransferError(f"the decode instance went away mid-transfer ({e})."))
            return
        outbox.finish(key, None if ack.get("ok") else TransferError(str(ack.get("error"))))

    async def fetch(self, host: str, port: int, key: Key, timeout: float) -> Handoff:
        try:
            async with asyncio.timeout(timeout):          # connecting, waiting for the prompt, and the transfer
                return await self._fetch(host, port, key)
        except TimeoutError:
            raise TransferError(f"the prefill instance at {host}:{port} did not hand this request over within "
                                f"{timeout:g} s (--disaggregation-timeout).") from None

    async def _fetch(self, host: str, port: int, key: Key) -> Handoff:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as e:
            raise TransferError(f"cannot reach the prefill instance's bootstrap port {host}:{port} ({e}).") from None
        try:
            await write_frame(writer, {"room": key[0], "index": key[1]})
            header = await read_frame(reader)
            if "error" in header:
                raise TransferError(f"the prefill instance failed this request: {header['error']}")
            try:
                handoff = await read_handoff(reader, header)
            except TransferError as e:
                with contextlib.suppress(ConnectionError):
                    await write_frame(writer, {"error": str(e)})
                raise
            await write_frame(writer, {"ok": True})
            return handoff
        except ConnectionError as e:
            raise TransferError(f"the connection to the prefill instance at {host}:{port} broke ({e}).") from None
        finally:
            writer.close()
