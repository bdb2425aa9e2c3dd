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
    return decode(decoder, body)


def decode(decoder: msgspec.msgpack.Decoder[T], body: bytes | memoryview) -> T:
    """A frame's message; FrameError if it is not one of `decoder`'s."""
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(str(exc)) from None


class FrameBuffer:
    """The frames of a stream parsed from its bytes as they come (an `asyncio.Protocol`'s `data_received`): no
    coroutine and no timer per frame, where `read_frame` costs a few of each (a frame a request, or more, between
    the gateway's processes). Whoever feeds it times a frame left partial (`partial`) against FRAME_TIMEOUT_S."""

    __slots__ = ("_buffer", "_need", "max_bytes")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._buffer = bytearray()
        self._need = 0  # bytes the buffer must hold before a frame in it is whole (its length's, then its own)

    @property
    def partial(self) -> bool:
        """Bytes of a frame not yet whole are buffered."""
        return bool(self._buffer)

    def feed(self, data: bytes) -> list[memoryview]:
        """The bodies of the frames `data` completes, in order (each valid until the next feed); FrameError for a
        length of none or over `max_bytes`. A frame that comes in many pieces is copied once when it is whole, not
        at every piece (an 8 MiB frame in 64 KiB reads was 350 ms of the event loop's CPU)."""
        if self._buffer:
            self._buffer += data
            if len(self._buffer) < self._need:
                return []
            view = memoryview(bytes(self._buffer))
            self._buffer.clear()
        else:
            view = memoryview(data)
        bodies = []
        pos, end = 0, len(view)
        self._need = LENGTH.size
        while end - pos >= LENGTH.size:
            (size,) = LENGTH.unpack_from(view, pos)
            if not 0 < size <= self.max_bytes:
                raise FrameError(f"a frame of {size} bytes")
            if end - pos - LENGTH.size < size:
                self._need = LENGTH.size + size
                break
            pos += LENGTH.size
            bodies.append(view[pos:pos + size])
            pos += size
        if pos < end:
            self._buffer += view[pos:]
        return bodies


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
