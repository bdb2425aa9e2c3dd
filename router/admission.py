"""Admission: the gateway-wide caps on requests in flight and on the request-body bytes they hold. A request over
either cap is answered at once — 503, `Retry-After`, an OpenAI-style error — instead of queueing behind the
others until a timeout."""

from __future__ import annotations

from types import TracebackType

from router.errors import GatewayError
from router.metrics import GatewayMetrics

RETRY_AFTER_S = 1


def overloaded(message: str) -> GatewayError:
    return GatewayError(503, message, type="service_unavailable", code="overloaded",
                        headers={"Retry-After": str(RETRY_AFTER_S)})


class Admission:
    """Counts the proxied requests in flight and the body bytes they hold, against two caps."""

    def __init__(self, max_requests: int, max_bytes: int, metrics: GatewayMetrics) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.requests = 0
        self.bytes = 0
        # read when scraped: nothing per request
        metrics.requests_in_flight.set_function(lambda: self.requests)
        metrics.request_bytes_in_flight.set_function(lambda: self.bytes)

    def admit(self, declared_bytes: int) -> Admitted:
        """A slot for one request whose body declares `declared_bytes` (0 when unknown, as for chunked uploads:
        those are counted as they arrive). Raises the 503 when either cap is reached."""
        if self.requests >= self.max_requests:
            raise overloaded(f"the gateway is at its limit of {self.max_requests} requests in flight; retry shortly")
        self._check(declared_bytes)
        self.requests += 1
        return Admitted(self, declared_bytes)

    def _check(self, extra: int) -> None:
        if extra and self.bytes + extra > self.max_bytes:
            raise overloaded(f"the gateway holds {self.bytes} request bytes in flight, at its limit of "
                             f"{self.max_bytes}; retry shortly")

    def _hold(self, extra: int) -> None:
        self.bytes += extra

    def _leave(self, held: int) -> None:
        self.requests -= 1
        self._hold(-held)


class Admitted:
    """One admitted request: holds its bytes until it is done (use as a context manager)."""

    def __init__(self, admission: Admission, declared_bytes: int) -> None:
        self._admission = admission
        self._held = declared_bytes
        self._done = False
        admission._hold(declared_bytes)

    def hold(self, size: int) -> None:
        """The body has grown to `size` bytes (it may exceed what was declared only for chunked uploads)."""
        extra = size - self._held
        if extra > 0:
            self._admission._check(extra)
            self._admission._hold(extra)
            self._held = size

    def __enter__(self) -> Admitted:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self._done:
            self._done = True
            self._admission._leave(self._held)
