"""KV events in, the transport: ZMQ sockets to one event source, kept connected, and its replay socket.

`subscribe` receives one source's messages forever and tells its `Receiver` what happens: the socket opened, the
connection dropped (the publisher exited, was killed, or went silent past the heartbeat timeout), the connection
came back (the publisher may have restarted meanwhile), a message arrived. ZMQ reconnects by itself, with backoff;
a broken socket is re-created. What the messages mean is not this module's business.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvcore.kv_events import END_OF_REPLAY

log = logging.getLogger(__name__)

Batches = list[tuple[int, bytes]]  # (sequence number, payload), in order

HARD_MAX_MESSAGE_BYTES = 256 * 2**20  # libzmq drops a peer that sends a bigger message (a memory guard)
REPLAY_MAX_BYTES = 512 * 2**20  # a replay answer bigger than this is abandoned
REPLAY_BATCH_BYTES = 128  # what a replayed batch costs beyond its payload (its tuple, seq and bytes object)
MAX_SOCKETS = 65_536  # sockets of all subscriptions and replay requests of one gateway
YIELD_AFTER_S = 0.005  # draining the socket lets the event loop run at least this often
# messages libzmq keeps for a subscription that the gateway has not taken yet. Past them it stops reading the
# connection, and the backlog waits in the publisher, which keeps its own (vLLM: 100,000 messages, then drops for a
# slow subscriber: a gap, repaired from its replay buffer). It was 100,000 here too: a publisher sending valid
# batches faster than they are applied (400 of 838 KB in 0.7 s, 25 applied a second) held 340 MB in the gateway,
# 4 MiB batches up to 400 GB. Now at most this many times the largest batch decoded (MAX_BATCH_BYTES): 256 MiB
RCVHWM = 64


@dataclass(frozen=True, slots=True)
class EventSource:
    """One publisher of KV events about one worker: its engine ("engine") or its tier agent ("agent"). A
    data-parallel engine has a cache, and a publisher, per rank (`dp_rank`)."""

    worker: str
    endpoint: str
    replay: str | None = None
    name: str = "engine"
    dp_rank: int | None = None

    @property
    def cache(self) -> str:
        """The index's name for the cache these events describe: the worker's URL, `URL#dpN` for a DP rank."""
        return cache_name(self.worker, self.dp_rank)


def cache_name(worker: str, dp_rank: int | None) -> str:
    return worker if dp_rank is None else f"{worker}#dp{dp_rank}"


class ReplayError(Exception):
    """The replay socket did not answer in time."""


class Receiver(Protocol):
    async def opened(self) -> None:
        """The socket was (re)created and connected; the stream may have moved on meanwhile."""

    async def disconnected(self) -> None:
        """The connection dropped; every message that came before it has been passed on."""

    async def reconnected(self) -> None:
        """ZMQ re-established the connection; the publisher may have restarted meanwhile."""

    async def received(self, frames: list[bytes]) -> None:
        """One message, as its frames."""


class ZmqEventTransport:
    """Owns the ZMQ context of every subscription and replay request of one gateway."""

    def __init__(self) -> None:
        self._ctx = zmq.asyncio.Context()
        # a subscription takes three sockets (SUB, its monitor, the monitor's pair): libzmq's default of 1023
        # would end at ~340 sources; the process's file descriptor limit is the bound then
        self._ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)

    async def subscribe(self, endpoint: str, receiver: Receiver) -> None:
        """Receive from `endpoint` until cancelled; a bug or a broken socket never ends the subscription."""
        backoff = 0.1
        while True:
            try:
                sock, monitor = self._open()
            except zmq.ZMQError as exc:  # out of sockets or file descriptors: tried again, never given up
                log.error("kv event subscriber for %s cannot open its sockets (%s); retrying", endpoint, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
            poller = zmq.asyncio.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            try:
                sock.connect(endpoint)
                await receiver.opened()
                connections = 0
                while True:
                    ready = dict(await poller.poll())
                    if monitor in ready:
                        event = parse_monitor_message(await monitor.recv_multipart())["event"]
                        if event == zmq.EVENT_DISCONNECTED:
                            # what the publisher sent before it went comes first (ZMQ reconnects 100 ms later
                            # at the soonest, so nothing of a new connection is among it)
                            await _drain(raw, receiver)
                            await receiver.disconnected()
                        elif event == zmq.EVENT_CONNECTED:
                            connections += 1
                            if connections > 1:
                                await receiver.reconnected()
                    if sock in ready:
                        await _drain(raw, receiver)
                        backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kv event subscriber for %s failed; restarting", endpoint)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)

    def _open(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """A SUB socket for one subscription, and its monitor."""
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.IPV6, 1)  # endpoints of workers discovered by AAAA records are IPv6
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.MAXMSGSIZE, HARD_MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            return sock, sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        except BaseException:
            sock.close(linger=0)
            raise

    async def replay(self, endpoint: str, start: int, timeout_s: float) -> Batches:
        """The batches the publisher at `endpoint` still buffers with seq >= start; ReplayError on timeout."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, HARD_MAX_MESSAGE_BYTES)
        batches: Batches = []
        size = 0
        try:
            sock.connect(endpoint)
            async with asyncio.timeout(timeout_s):
                await sock.send_multipart((b"", start.to_bytes(8, "big")))
                yielded_at = time.monotonic()
                while True:
                    frames = await sock.recv_multipart()
                    # a message already queued is returned without a round through the event loop: a server that
                    # answers without end would hold the loop, and this timeout could never fire
                    if time.monotonic() - yielded_at > YIELD_AFTER_S:
                        await asyncio.sleep(0)
                        yielded_at = time.monotonic()
                    if len(frames) != 4:
                        continue
                    _, _topic, seq_bytes, payload = frames
                    if seq_bytes == END_OF_REPLAY:
                        break
                    if len(seq_bytes) == 8:
                        batches.append((int.from_bytes(seq_bytes, "big"), payload))
                        size += len(payload) + REPLAY_BATCH_BYTES  # empty payloads are not free either
                        if size > REPLAY_MAX_BYTES:
                            raise ReplayError(f"replay from {endpoint} exceeded {REPLAY_MAX_BYTES} bytes")
        except TimeoutError:
            raise ReplayError(f"replay from {endpoint} timed out") from None
        finally:
            sock.close(linger=0)
        return batches

    def close(self) -> None:
        self._ctx.destroy(linger=0)


async def _drain(sock: zmq.Socket[bytes], receiver: Receiver) -> None:
    """Pass on what has arrived without a round through the event loop per message, but let the loop run every
    few milliseconds: a flood must not starve everything else."""
    began = time.monotonic()
    while (frames := _recv_now(sock)) is not None:
        await receiver.received(frames)
        if time.monotonic() - began > YIELD_AFTER_S:
            await asyncio.sleep(0)
            began = time.monotonic()


def _recv_now(sock: zmq.Socket[bytes]) -> list[bytes] | None:
    try:
        return sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None
