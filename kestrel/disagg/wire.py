"""The bytes of a transfer: length-prefixed JSON frames, and a handoff as one header frame (prompt, first token, and
each tensor's name, dtype, shape, size and CRC-32) followed by the tensors' raw bytes in header order."""

from __future__ import annotations

import asyncio
import json
import struct
import zlib

import torch

from ..engine.handoff import Handoff
from ..engine.outputs import Logprob, TokenLogprobs

GENERATOR = "generator"
"""The tensor name a seeded request's generator state travels under (no cache tensor is named so)."""

MAX_FRAME = 64 << 20
"""Largest JSON frame accepted (a header lists every tensor of a request: a few MB for a long K3 prompt)."""


class TransferError(RuntimeError):
    """A handoff could not be moved; the request it belongs to fails, the instances carry on."""


class IntegrityError(TransferError):
    """A tensor arrived with other bytes than were sent."""


async def write_frame(writer: asyncio.StreamWriter, message: dict) -> None:
    body = json.dumps(message).encode()
    writer.write(struct.pack(">I", len(body)) + body)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader) -> dict:
    """The next frame; TransferError if the peer closed the connection or sent something that is not a frame."""
    try:
        (size,) = struct.unpack(">I", await reader.readexactly(4))
        if size > MAX_FRAME:
            raise TransferError(f"the peer sent a {size}-byte frame, more than the {MAX_FRAME} allowed.")
        return json.loads(await reader.readexactly(size))
    except asyncio.IncompleteReadError:
        raise TransferError("the peer closed the connection mid-transfer.") from None
    except (ValueError, UnicodeDecodeError):
        raise TransferError("the peer sent a malformed frame.") from None


def _raw(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes (any dtype), without a copy when it is contiguous."""
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


async def write_handoff(writer: asyncio.StreamWriter, handoff: Handoff) -> int:
    """Send handoff; the number of tensor bytes sent."""
    tensors = handoff.tensors if handoff.generator_state is None else \
        {**handoff.tensors, GENERATOR: handoff.generator_state}
    raws = {name: _raw(t) for name, t in tensors.items()}
    prompt = None if handoff.prompt_logprobs is None else [_entry_out(e) for e in handoff.prompt_logprobs]
    header = {"prompt_ids": handoff.prompt_ids, "first_token": handoff.first_token, "num_pages": handoff.num_pages,
              "first_logprobs": _entry_out(handoff.first_logprobs), "prompt_logprobs": prompt,
              "tensors": [{"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                           "nbytes": raws[name].nbytes, "crc32": zlib.crc32(raws[name])}
                          for name, t in tensors.items()]}
    await write_frame(writer, header)
    for raw in raws.values():
        writer.write(raw)
        await writer.drain()
    return sum(raw.nbytes for raw in raws.values())


async def read_handoff(reader: asyncio.StreamReader, header: dict) -> Handoff:
    """The handoff whose header frame was just read: its tensors, each checked against its CRC-32 (IntegrityError
    naming the first that differs). Every byte is read before that verdict, so the connection holds nothing unread
    when the decode side answers and closes it (a close over unread bytes resets it, and the answer is lost)."""
    tensors, corrupted = {}, []
    for spec in header["tensors"]:
        try:
            dtype = getattr(torch, spec["dtype"])
            buffer = bytearray(await reader.readexactly(spec["nbytes"]))
        except asyncio.IncompleteReadError:
            raise TransferError("the prefill instance closed the connection mid-transfer.") from None
        except (AttributeError, TypeError, KeyError):
            raise TransferError("the prefill instance sent a malformed tensor header.") from None
        if zlib.crc32(buffer) != spec["crc32"]:
            corrupted.append(spec["name"])
        tensors[spec["name"]] = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(spec["shape"]) \
            if buffer else torch.empty(spec["shape"], dtype=dtype)
    if corrupted:
        raise IntegrityError(f"tensor {corrupted[0]} arrived corrupted (its CRC-32 does not match what the prefill "
                             "instance sent); the request was not continued.")
    try:
        logprobs = _entry_in(header.get("first_logprobs"))
        prompt = header.get("prompt_logprobs")
        prompt = None if prompt is None else [_entry_in(e) for e in prompt]
    except (TypeError, ValueError):
        raise TransferError("the prefill instance sent malformed logprobs.") from None
    generator = tensors.pop(GENERATOR, None)
    return Handoff(list(header["prompt_ids"]), int(header["first_token"]), tensors, int(header["num_pages"]),
                   logprobs, generator, prompt)


def _entry_out(entry: TokenLogprobs | None) -> list | None:
    """One position's logprob entry as JSON: [[token, logprob, rank, text], ...] (None stays None)."""
    return None if entry is None else [[token, e.logprob, e.rank, e.decoded_token] for token, e in entry.items()]


def _entry_in(entry: list | None) -> TokenLogprobs | None:
    return None if entry is None else {int(token): Logprob(float(value), rank, text)
                                       for token, value, rank, text in entry}
