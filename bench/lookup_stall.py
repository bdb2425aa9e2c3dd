"""How long one client's big Lookups (or Stores, Loads) hold the tier agent's event loop from everyone else: a real
agent (`kvgate agent`, 1 GiB of DRAM), one process sending a pre-encoded request of N blocks in a loop, another timing
1-hash Lookups every 2 ms; both print one JSON line. Run from the root of the checkout under test (the agent runs its
code):

    python -m bench.lookup_stall N KIND SECONDS    # KIND: u64 (random 64-bit hashes, none held), bytes64
                                                   # (random 64-byte hashes), held (1..N, every block held);
                                                   # store (a shared-memory Store of N 16-byte blocks, 1..N),
                                                   # load (a shared-memory Load of N 16-byte blocks, none
                                                   # held: the decode alone), loadheld (the same, all held)
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec

LAYOUT = 7
BLOCK = 16  # bytes of a block in the store and load kinds
PIECE = 2**15  # blocks per Store when the load kind's blocks are put in first (what any agent accepts)


def call(sock: socket.socket, message: dict[str, Any] | bytes) -> dict[str, Any]:
    body = message if isinstance(message, bytes) else msgspec.msgpack.encode(message)
    sock.sendall(len(body).to_bytes(4, "little") + body)
    size = int.from_bytes(receive(sock, 4), "little")
    reply: dict[str, Any] = msgspec.msgpack.decode(receive(sock, size))
    return reply


def receive(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ConnectionError("the agent closed the connection")
        buf += chunk
    return bytes(buf)


def connect(path: str, shm_bytes: int = 0) -> socket.socket:
    """A connection; with `shm_bytes`, one that passes shared memory of that size (a sealed memfd) in its Hello."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(path)
    if not shm_bytes:
        assert call(sock, {"op": "hello"})["op"] == "hello"
        return sock
    fd = os.memfd_create("lookup-stall", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, shm_bytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        body = msgspec.msgpack.encode({"op": "hello", "shm_bytes": shm_bytes})
        socket.send_fds(sock, [len(body).to_bytes(4, "little") + body], [fd])
    finally:
        os.close(fd)
    size = int.from_bytes(receive(sock, 4), "little")
    reply = msgspec.msgpack.decode(receive(sock, size))
    assert reply["op"] == "hello", reply
    return sock


def request_of(n: int, kind: str, start: int = 0) -> dict[str, Any]:
    """The request the hammer sends (blocks start+1..start+n, at offset 0 on, for the store and load kinds)."""
    hashes = (list(range(start + 1, start + n + 1)) if kind in ("store", "loadheld") else
              hashes_of(n, "u64" if kind == "load" else kind))
    offsets = [i * BLOCK for i in range(n)]
    if kind == "store":
        return {"op": "store", "layout": LAYOUT, "hashes": hashes, "offsets": offsets, "lengths": [BLOCK] * n,
                "parent": start or None}
    if kind in ("load", "loadheld"):
        return {"op": "load", "layout": LAYOUT, "hashes": hashes, "block_bytes": BLOCK, "offsets": offsets}
    return {"op": "lookup", "layout": LAYOUT, "hashes": hashes}


def hashes_of(n: int, kind: str) -> list[Any]:
    rnd = random.Random(1)
    if kind == "u64":
        return [rnd.getrandbits(64) for _ in range(n)]
    if kind == "held":
        return list(range(1, n + 1))
    return [rnd.randbytes(64) for _ in range(n)]


def hammer(path: str, n: int, kind: str, seconds: float) -> None:
    sock = connect(path, n * BLOCK if kind in ("store", "load", "loadheld") else 0)
    body = msgspec.msgpack.encode(request_of(n, kind))
    end, sent, replies = time.monotonic() + seconds, 0, dict[str, int]()
    while time.monotonic() < end:
        reply = call(sock, body)
        sent += 1
        key = ("error: " + reply.get("message", "")[:90] if reply["op"] == "error" else
               f"count {reply['count']}" if reply["op"] == "lookup" else
               f"stored {reply['stored']}" if reply["op"] == "store" else f"loaded {len(reply['lengths'])}")
        replies[key] = replies.get(key, 0) + 1
    print(json.dumps({"big_requests": sent, "frame_MiB": round(len(body) / 2**20, 2), "replies": replies}),
          flush=True)


def timer(path: str, seconds: float) -> None:
    sock = connect(path)
    body = msgspec.msgpack.encode({"op": "lookup", "layout": LAYOUT, "hashes": [10**12]})
    waits: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        asked = time.monotonic()
        call(sock, body)
        waits.append(time.monotonic() - asked)
        time.sleep(0.002)
    waits.sort()

    def ms(q: float) -> float:
        return round(waits[min(len(waits) - 1, int(q * len(waits)))] * 1000, 2)

    print(json.dumps({"small_lookups": len(waits), "p50_ms": ms(0.5), "p99_ms": ms(0.99), "max_ms": ms(1.0),
                      "over_20ms": sum(w > 0.02 for w in waits)}), flush=True)


def main(argv: list[str]) -> None:
    if argv[0] == "hammer":
        return hammer(argv[1], int(argv[2]), argv[3], float(argv[4]))
    if argv[0] == "timer":
        return timer(argv[1], float(argv[2]))
    n, kind, seconds = int(argv[0]), argv[1], float(argv[2])
    path = os.path.join(tempfile.mkdtemp(prefix="lookup-stall-"), "agent.sock")
    agent = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "agent", "--socket-path", path, "--metrics-port",
                              "0", "--dram-capacity", "1GiB"], env=dict(os.environ, PYTHONPATH=os.getcwd()),
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                connect(path).close()
                break
            except OSError:
                assert agent.poll() is None and time.monotonic() < deadline, "the agent did not start"
                time.sleep(0.05)
        if kind == "held":  # empty blocks, inline, PIECE a store
            with connect(path) as sock:
                held = hashes_of(n, kind)
                for start in range(0, n, PIECE):
                    chain = held[start: start + PIECE]
                    reply = call(sock, {"op": "store", "layout": LAYOUT, "hashes": chain, "data": [b""] * len(chain),
                                        "parent": held[start - 1] if start else None})
                    assert reply.get("stored") == len(chain), reply
        if kind == "loadheld":  # N 16-byte blocks, PIECE a store
            with connect(path, PIECE * BLOCK) as sock:
                for start in range(0, n, PIECE):
                    reply = call(sock, request_of(min(PIECE, n - start), "store", start))
                    assert reply.get("stored") == min(PIECE, n - start), reply
        me = [sys.executable, "-m", "bench.lookup_stall"]
        procs = [subprocess.Popen([*me, "hammer", path, str(n), kind, str(seconds)]),
                 subprocess.Popen([*me, "timer", path, str(seconds)])]
        for proc in procs:
            proc.wait()
    finally:
        agent.terminate()
        agent.wait(30)


if __name__ == "__main__":
    main(sys.argv[1:])
