"""OpenAI-style error responses: every failure at the edge becomes `{"error": {"message", "type", "code"}}`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcore.http_errors import error_response

if TYPE_CHECKING:
    from aiohttp import web


class GatewayError(Exception):
    """A failure to report to the client with an HTTP status and an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.headers = headers or {}

    def response(self) -> web.Response:
        return error_response(self.status, self.message, type=self.type, code=self.code, headers=self.headers)


def bad_request(message: str, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, code=code)


def no_worker(message: str, retry_after_s: int = 1) -> GatewayError:
    return GatewayError(
        503, message, type="service_unavailable", code="no_healthy_worker",
        headers={"Retry-After": str(retry_after_s)},
    )


def unknown_model(model: str) -> GatewayError:
    return GatewayError(
        404, f"The model `{model}` does not exist.", type="NotFoundError", code="model_not_found"
    )
