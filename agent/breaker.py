"""Whether the tier agent is worth calling: a circuit breaker for the connector's agent client.

A call the agent does not answer (the connection refused, or no reply within the timeout) opens the circuit:
from then on the client fails at once, so the engine runs without the agent (vLLM recomputes) instead of waiting
a timeout on every lookup, load and save of every step. While it is open, a background thread probes the agent
(a fresh connection and its Hello, with the client's timeout) every `probe_interval_s`; the first answer closes
the circuit and the client reconnects on its next call. An error reply does not open it (the agent is there),
nor does a connection cut under a call (an agent restart: the client's reconnect decides).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from agent.protocol import AgentRefused
from kvcore.aio import name_native_thread

log = logging.getLogger("vllm.kvgate_connector")  # under "vllm" so vLLM's log handler prints it

THREAD_NAME = "kvgate-probe"  # the probing thread's OS name (at most 15 characters)


class AgentCircuit:
    def __init__(self, probe: Callable[[], object], probe_interval_s: float = 1.0, name: str = "tier agent") -> None:
        """`probe`: one call that raises unless the agent answered (run in the probing thread)."""
        self.probe = probe
        self.probe_interval_s = probe_interval_s
        self.name = name
        self.trips = 0  # how many times it opened
        self._lock = threading.Lock()
        self._opened_at: float | None = None
        self._stop = threading.Event()
        self._prober: threading.Thread | None = None

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None

    def trip(self, reason: object) -> None:
        """The agent did not answer: stop calling it until a probe gets an answer."""
        with self._lock:
            if self._opened_at is not None or self._stop.is_set():
                return
            self._opened_at = time.monotonic()
            self.trips += 1
            log.warning("kvgate connector: %s unavailable (%s): running WITHOUT it -- no lookups, loads or saves, "
                        "vLLM computes every block -- until it answers again (probed every %.1f s)",
                        self.name, reason, self.probe_interval_s)
            if self._prober is None:
                self._prober = threading.Thread(target=self._probe_until_back, name=THREAD_NAME,
                                                 daemon=True)
                self._prober.start()

    def _probe_until_back(self) -> None:
        name_native_thread(THREAD_NAME)
        refused = ""  # why the agent last refused a probe: said once, when it changes
        while not self._stop.wait(self.probe_interval_s):
            try:
                self.probe()
            except AgentRefused as exc:
                # it is there but will not talk to this client (another protocol: an upgrade of one side). The
                # circuit may have opened on something else (the agent away while it was replaced), so the trip
                # alone would never say this
                if str(exc) != refused:
                    refused = str(exc)
                    log.warning("kvgate connector: %s refuses this client: %s (still WITHOUT it; probed every "
                                "%.1f s)", self.name, exc, self.probe_interval_s)
                continue
            except Exception:
                continue
            with self._lock:
                opened, self._opened_at = self._opened_at, None
                self._prober = None  # with the circuit closed, under the lock: the next trip starts a new one
            if opened is not None:
                log.warning("kvgate connector: %s answers again after %.1f s; using it again", self.name,
                            time.monotonic() - opened)
            return

    def close(self) -> None:
        """Stop probing (for shutdown); the circuit stays as it is."""
        self._stop.set()
        prober = self._prober
        if prober is not None:
            prober.join(timeout=2 * self.probe_interval_s + 1)
