"""One error hierarchy for the whole fleet, mapped to wire formats in one table.

::

    StreamfleetError            (code, status, message, retry_after_ms, param)
    ├── RequestError            a single request fails; the connection lives on
    │   ├── ValidationError     400: bad input, one code per rule
    │   ├── NotFoundError       404: unknown model
    │   ├── AuthError           401
    │   ├── RefusedError        429: rate_limited / overloaded (with retry hint)
    │   ├── UnavailableError    503: broker_unavailable / no_workers
    │   └── GenerationError     500: engine_error / delivery_failed / timeout
    └── FatalError              the process cannot go on (bad config, missing model files)

``to_frame`` renders the WebSocket ``error`` frame; ``to_openai`` the OpenAI-style body.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

__all__ = [
    "OPENAI_CODE",
    "ErrorCode",
    "StreamfleetError",
    "RequestError",
    "ValidationError",
    "NotFoundError",
    "AuthError",
    "RefusedError",
    "UnavailableError",
    "GenerationError",
    "FatalError",
    "STATUS_BY_CODE",
    "error_from_code",
]


class ErrorCode(StrEnum):
    invalid_json = "invalid_json"
    invalid_frame = "invalid_frame"
    unknown_type = "unknown_type"
    invalid_request = "invalid_request"
    missing_field = "missing_field"
    invalid_type = "invalid_type"
    out_of_range = "out_of_range"
    duplicate_id = "duplicate_id"
    unknown_id = "unknown_id"
    prompt_too_long = "prompt_too_long"
    frame_too_large = "frame_too_large"
    binary_frame = "binary_frame"
    too_many_requests = "too_many_requests"
    unknown_model = "unknown_model"
    unknown_request = "unknown_request"
    unauthorized = "unauthorized"
    forbidden = "forbidden"
    rate_limited = "rate_limited"
    overloaded = "overloaded"
    broker_unavailable = "broker_unavailable"
    no_workers = "no_workers"
    shutting_down = "shutting_down"
    engine_error = "engine_error"
    delivery_failed = "delivery_failed"
    timeout = "timeout"
    internal = "internal"


#: HTTP status for each code (the one table both adapters use)
STATUS_BY_CODE: dict[ErrorCode, int] = {
    ErrorCode.invalid_json: 400,
    ErrorCode.invalid_frame: 400,
    ErrorCode.unknown_type: 400,
    ErrorCode.invalid_request: 400,
    ErrorCode.missing_field: 400,
    ErrorCode.invalid_type: 400,
    ErrorCode.out_of_range: 400,
    ErrorCode.duplicate_id: 400,
    ErrorCode.unknown_id: 400,
    ErrorCode.prompt_too_long: 400,
    ErrorCode.frame_too_large: 413,
    ErrorCode.binary_frame: 400,
    ErrorCode.too_many_requests: 429,
    ErrorCode.unknown_model: 404,
    ErrorCode.unknown_request: 404,
    ErrorCode.unauthorized: 401,
    ErrorCode.forbidden: 403,
    ErrorCode.rate_limited: 429,
    ErrorCode.overloaded: 429,
    ErrorCode.broker_unavailable: 503,
    ErrorCode.no_workers: 503,
    ErrorCode.shutting_down: 503,
    ErrorCode.engine_error: 500,
    ErrorCode.delivery_failed: 500,
    ErrorCode.timeout: 504,
    ErrorCode.internal: 500,
}

#: OpenAI error ``type`` for each status class
#: the codes OpenAI has its own words for, as the OpenAI door says them (every other code
#: is the same on every door)
OPENAI_CODE: dict[str, str] = {
    "unknown_model": "model_not_found",
    "prompt_too_long": "context_length_exceeded",
}

_OPENAI_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class StreamfleetError(Exception):
    """Base of every error that carries a wire code.

    Args:
        message: text a user can act on.
        code: the machine-readable code; defaults to the class's.
        param: the request field at fault, when there is one.
        retry_after_ms: hint for 429/503 refusals.
    """

    code: ErrorCode = ErrorCode.internal

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode | str | None = None,
        param: str | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = ErrorCode(code)
        self.param = param
        self.retry_after_ms = retry_after_ms

    @property
    def status(self) -> int:
        return STATUS_BY_CODE.get(self.code, 500)

    def to_frame(self, client_id: str | None) -> dict[str, Any]:
        """The WebSocket ``error`` frame (``id`` is None for connection-level errors)."""
        frame: dict[str, Any] = {
            "type": "error",
            "id": client_id,
            "code": str(self.code),
            "status": self.status,
            "message": self.message,
        }
        if self.param is not None:
            frame["param"] = self.param
        if self.retry_after_ms is not None:
            frame["retry_after_ms"] = self.retry_after_ms
        return frame

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI error body ``{"error": {...}}``."""
        return {
            "error": {
                "message": self.message,
                "type": _OPENAI_TYPE.get(self.status, "server_error"),
                "param": self.param,
                "code": OPENAI_CODE.get(str(self.code), str(self.code)),
            }
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code}: {self.message})"


class RequestError(StreamfleetError):
    """Ends one request; the connection and the process carry on."""


class ValidationError(RequestError):
    code = ErrorCode.invalid_request


class NotFoundError(RequestError):
    code = ErrorCode.unknown_model


class AuthError(RequestError):
    code = ErrorCode.unauthorized


class RefusedError(RequestError):
    code = ErrorCode.overloaded


class UnavailableError(RequestError):
    code = ErrorCode.broker_unavailable


class GenerationError(RequestError):
    code = ErrorCode.engine_error


class FatalError(StreamfleetError):
    """The process cannot continue (bad configuration, missing model files)."""


_CLASS_BY_STATUS = {400: ValidationError, 401: AuthError, 404: NotFoundError, 413: ValidationError,
                    429: RefusedError, 503: UnavailableError}


def error_from_code(code: str, message: str, *, retry_after_ms: int | None = None,
                    param: str | None = None) -> RequestError:
    """Rebuild a typed error from a code that crossed Redis (worker → gateway) or rode an
    ``ErrorEvent`` (``shared.schema.ErrorEvent.error``)."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        ec = ErrorCode.internal
    cls = _CLASS_BY_STATUS.get(STATUS_BY_CODE.get(ec, 500), GenerationError)
    return cls(message, code=ec, param=param, retry_after_ms=retry_after_ms)
