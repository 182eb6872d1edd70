"""The client's one error hierarchy. Every failure a call can meet is one of these:

    APIError                        base: message, status, type, code, param
    ├── APIConnectionError          the server could not be reached, or the connection broke
    │   └── APITimeoutError         no answer within the client's timeout
    ├── BadRequestError             400  invalid parameters
    ├── AuthenticationError         401  missing or wrong API key (a refused WebSocket handshake too)
    ├── NotFoundError               404  unknown model or session
    ├── ConflictError               409
    │   └── SessionBusyError        409  code "session_busy": another request holds the session
    ├── PayloadTooLargeError        413
    ├── UnprocessableEntityError    422  a stored session that this model cannot use
    ├── RateLimitError              429  the server's queue is full
    ├── RequestCancelledError       499  cancelled while its prompt was read: nothing was made or stored
    ├── ServiceUnavailableError     503  starting, draining, or its store is down
    └── InternalServerError         other 5xx

An error that arrives inside a stream (an SSE ``error`` event or a WebSocket ``error``
message) has no HTTP status of its own: the server sends ``status`` with it, the one it
answers the same error with outside a stream. From a server that sends no ``status`` there,
the class follows OpenAI's error ``type`` (``invalid_request_error`` reads as 400).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class APIError(Exception):
    """Base of every client error; the server's OpenAI-shaped ``error`` object, unpacked."""

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.code, self.param = message, status, type, code, param

    def __str__(self) -> str:
        where = " ".join(str(x) for x in (self.status, self.code) if x is not None)
        return f"{where}: {self.message}" if where else self.message

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(message={self.message!r}, status={self.status!r}, type={self.type!r}, "
                f"code={self.code!r}, param={self.param!r})")


class APIConnectionError(APIError):
    def __init__(self, message: str = "could not connect to the txlserve server") -> None:
        super().__init__(message)


class APITimeoutError(APIConnectionError):
    def __init__(self, message: str = "the request timed out") -> None:
        super().__init__(message)


class BadRequestError(APIError):
    pass


class AuthenticationError(APIError):
    pass


class PermissionDeniedError(APIError):
    """403: the server refused a WebSocket opened for a web page of another origin (OpenAI's SDK's name)."""


class NotFoundError(APIError):
    pass


class ConflictError(APIError):
    pass


class SessionBusyError(ConflictError):
    pass


class PayloadTooLargeError(APIError):
    pass


class UnprocessableEntityError(APIError):
    pass


class RateLimitError(APIError):
    pass


class RequestCancelledError(APIError):
    """499 (nginx's count of a client that left): a WebSocket completion cancelled before its first token, while
    its prompt was still being read. Nothing was generated and nothing was stored: a session is as it was, and
    the prompt is to be sent again to add it."""


class ServiceUnavailableError(APIError):
    pass


class InternalServerError(APIError):
    pass


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequestError, 401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError, 409: ConflictError,
    413: PayloadTooLargeError, 422: UnprocessableEntityError, 429: RateLimitError, 499: RequestCancelledError,
    503: ServiceUnavailableError,
}


_BY_TYPE: dict[str, int] = {  # OpenAI's error types, for a stream error that carries no status
    "invalid_request_error": 400, "authentication_error": 401, "permission_error": 403, "not_found_error": 404,
    "conflict_error": 409,
    "rate_limit_error": 429, "service_unavailable_error": 503, "server_error": 500,
}


def error_from_body(body: Any, status: int | None = None, fallback: str = "") -> APIError:
    """The exception for an error answer: ``status`` from HTTP, or None inside a stream."""
    err = body.get("error") if isinstance(body, Mapping) else None
    if not isinstance(err, Mapping):
        err = {"message": fallback or f"the server answered HTTP {status}"}
    code, type_ = err.get("code"), err.get("type")
    if status is None and isinstance(body, Mapping) and isinstance(body.get("status"), int):  # inside a stream
        status = body["status"]
    elif status is None and isinstance(type_, str):
        status = _BY_TYPE.get(type_)
    cls = _BY_STATUS.get(status or 0) or (InternalServerError if (status or 0) >= 500 else APIError)
    if cls is ConflictError and code == "session_busy":
        cls = SessionBusyError
    return cls(str(err.get("message") or fallback or "unknown error"), status=status, type=type_, code=code,
               param=err.get("param"))
