"""The framing of the gateway's own Unix-socket protocols between its processes (the prefill turns,
router/turn_broker.py; the routes each tells its siblings, router/sibling_routes.py): a 4-byte big-endian length and
a msgpack body, each protocol's frames bounded by its own largest, and written without ever waiting for the other
side (one that stops reading has its connection dropped)."""

from __future__ import annotations

import asyncio
import struct
from typing import TypeVar

import msgspec

T = TypeVar("T")

FRAME_TIMEOUT_S = 1.0  # the rest of a frame whose length has come
LENGTH = struct.Struct(">I")

_ENCODER = msgspec.msgpack.Encoder()


class FrameError(Exception):
    """A frame that breaks the protocol: its connection is closed."""


def frame(message: object) -> bytes:
    body = _ENCODER.encode(message)
    return LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, decoder: msgspec.msgpack.Decoder[T], max_bytes: int) -> T:
    """The next message; IncompleteReadError at the end of the stream, FrameError for anything unreadable (a frame
    of more than `max_bytes`, or none, or not whole within FRAME_TIMEOUT_S, or not a message of `decoder`'s)."""
    (size,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if not 0 < size <= max_bytes:
        raise FrameError(f"a frame of {size} bytes")
    try:
        body = await asyncio.wait_for(reader.readexactly(size), FRAME_TIMEOUT_S)
    except TimeoutError:
        raise FrameError(f"a frame of {size} bytes not whole after {FRAME_TIMEOUT_S:g} s") from None
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(str(exc)) from None


def send(writer: asyncio.StreamWriter, data: bytes, max_buffered: int) -> bool:
    """Write framed `data` without waiting; False (and the connection aborted) if it is closed or the other side
    has left more than `max_buffered` bytes unread (it stopped reading)."""
    if writer.is_closing():
        return False
    if writer.transport.get_write_buffer_size() > max_buffered:
        writer.transport.abort()
        return False
    writer.write(data)
    return True
