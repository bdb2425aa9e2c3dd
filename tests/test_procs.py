"""bench/procs.py's port picking: the ports handed out before any is bound are all different."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

from bench.procs import free_port


def test_free_ports_picked_together_are_all_different() -> None:
    """The kernel gives a just-released port back often (143 repeats in 2,000 calls when measured): the demo stack,
    which picks a port per service before starting any, once gave the gateway and a replica the same port, and the
    gateway's requests reached the replica (a fresh-clone CI run failed three deploy tests so)."""
    with ThreadPoolExecutor(4) as pool:  # from several threads too, as replicas started in parallel pick theirs
        ports = list(pool.map(lambda _: free_port(), range(2000)))
    assert len(set(ports)) == len(ports)
    for port in ports[-10:]:  # and each is free
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
