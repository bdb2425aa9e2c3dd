"""`python -m bench.health_probe URL [INTERVAL_S]`: `GET URL/health` every INTERVAL_S (10 ms) on one keep-alive
connection until stdin closes, then print what it saw as one JSON object: `waits`, each probe's time from when it
was due to its whole answer, in seconds, and `errors`, answers other than 200.

A process of its own, with nothing else to do, so what it times is the router: a probe in the client that sends the
load (as `bench overhead --stall-chars` had it) waits for that client's event loop too, busy writing 32,000-character
bodies. Standard library only, so it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time
from collections.abc import Callable
from urllib.parse import urlsplit


def _fill(sock: socket.socket, buffer: bytearray, done: Callable[[], bool]) -> None:
    """Read from `sock` into `buffer` until `done()`."""
    while not done():
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the router closed the connection")
        buffer += chunk


def _answer(sock: socket.socket, buffer: bytearray) -> int:
    """Read one HTTP/1.1 answer with a Content-Length from `sock` (what is read past it stays in `buffer`); its
    status."""
    _fill(sock, buffer, lambda: b"\r\n\r\n" in buffer)
    end = buffer.index(b"\r\n\r\n") + 4
    head = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    lengths = [line.split(":", 1)[1] for line in head[1:] if line.lower().startswith("content-length:")]
    if not lengths:
        raise ValueError(f"an answer without Content-Length: {head[0]!r}")
    total = end + int(lengths[0])
    _fill(sock, buffer, lambda: len(buffer) >= total)
    del buffer[:total]
    return status


def main(argv: list[str]) -> int:
    url = urlsplit(argv[0])
    interval = float(argv[1]) if len(argv) > 1 else 0.01
    host, port = url.hostname or "127.0.0.1", url.port or 80
    request = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    waits: list[float] = []
    errors = 0
    buffer = bytearray()
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        print("ready", flush=True)
        while True:
            due = time.perf_counter()
            sock.sendall(request)
            if _answer(sock, buffer) != 200:
                errors += 1
            waits.append(time.perf_counter() - due)
            if select.select([sys.stdin], [], [], interval)[0]:  # stdin closed (or written to): stop
                break
    print(json.dumps({"waits": waits, "errors": errors}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
