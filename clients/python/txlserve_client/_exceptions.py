"""The client's one error hierarchy. Every failure a call can meet is one of these:

    APIError                        base: message, status (status_code), type, code, param; response, body,
    │                               request, request_id where there was an HTTP exchange
    ├── APIConnectionError          the server could not be reached, or the connection broke
    │   └── APITimeoutError         no answer within the client's timeout
    └── APIStatusError              an error answer with a status (HTTP's, or the one a stream error carries)
        ├── BadRequestError             400  invalid parameters
        ├── AuthenticationError         401  missing or wrong API key (a refused WebSocket handshake too)
        ├── PermissionDeniedError       403  a page of another origin's request, or a Host not served
        ├── NotFoundError               404  unknown model or session
        ├── ConflictError               409
        │   └── SessionBusyError        409  code "session_busy": another request holds the session
        ├── PayloadTooLargeError        413
        ├── UnprocessableEntityError    422  a stored session that this model cannot use
        ├── RateLimitError              429  the server's queue is full
        ├── RequestCancelledError       499  cancelled while its prompt was read: nothing was made or stored
        ├── ServiceUnavailableError     503  starting, draining, or its store is down
        └── InternalServerError         other 5xx

The attributes are OpenAI's SDK's: ``status_code`` (``status`` too), ``response`` (the ``httpx.Response``),
``body`` (the answer's ``error`` object as JSON, else the JSON it held; None where it held none), ``request_id``
(its ``x-request-id``) and ``request``, so that code written for that SDK's errors reads these the same way.

An error that arrives inside a stream (an SSE ``error`` event or a WebSocket ``error``
message) has no HTTP status of its own: the server sends ``status`` with it, the one it
answers the same error with outside a stream. From a server that sends no ``status`` there,
the class follows OpenAI's error ``type`` (``invalid_request_error`` reads as 400). An SSE
stream's error keeps the stream's ``response`` (whose own status is 200).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx


class APIError(Exception):
    """Base of every client error; the server's OpenAI-shaped ``error`` object, unpacked."""

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 code: str | None = None, param: str | None = None, response: httpx.Response | None = None,
                 body: Any = None, request: httpx.Request | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.code, self.param = message, status, type, code, param
        self.response, self.body = response, body
        self.request = request if request is not None else request_of(response)
        self.request_id: str | None = response.headers.get("x-request-id") if response is not None else None

    @property
    def status_code(self) -> int | None:
        """OpenAI's SDK's name for ``status``."""
        return self.status

    def __str__(self) -> str:
        where = " ".join(str(x) for x in (self.status, self.code) if x is not None)
        return f"{where}: {self.message}" if where else self.message

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(message={self.message!r}, status={self.status!r}, type={self.type!r}, "
                f"code={self.code!r}, param={self.param!r})")


def request_of(response: httpx.Response | None) -> httpx.Request | None:
    try:
        return response.request if response is not None else None
    except RuntimeError:  # a Response built by hand has none, and httpx raises rather than answer None
        return None


class APIConnectionError(APIError):
    def __init__(self, message: str = "could not connect to the txlserve server", *,
                 request: httpx.Request | None = None) -> None:
        super().__init__(message, request=request)


class APITimeoutError(APIConnectionError):
    def __init__(self, message: str = "the request timed out", *, request: httpx.Request | None = None) -> None:
        super().__init__(message, request=request)


class APIStatusError(APIError):
    """An error answer that carries a status: the base of the classes named for one, and itself the class of a
    status none names (405, an unfollowed redirect), as OpenAI's SDK raises it."""

    status: int  # always one here (``error_from_body`` picks this class only for a status)

    @property
    def status_code(self) -> int:
        """OpenAI's SDK's, typed ``int`` as there (``APIError``'s may be None)."""
        return self.status


class BadRequestError(APIStatusError):
    pass


class AuthenticationError(APIStatusError):
    pass


class PermissionDeniedError(APIStatusError):
    """403: the server refused a request sent for a web page of another origin (``origin_not_allowed``), or one
    addressed to a name it does not answer to (``host_not_allowed``, see its --allowed-hosts). OpenAI's SDK's name."""


class NotFoundError(APIStatusError):
    pass


class ConflictError(APIStatusError):
    pass


class SessionBusyError(ConflictError):
    pass


class PayloadTooLargeError(APIStatusError):
    pass


class UnprocessableEntityError(APIStatusError):
    pass


class RateLimitError(APIStatusError):
    pass


class RequestCancelledError(APIStatusError):
    """499 (nginx's count of a client that left): a WebSocket completion cancelled before its first token, while
    its prompt was still being read. Nothing was generated and nothing was stored: a session is as it was, and
    the prompt is to be sent again to add it."""


class ServiceUnavailableError(APIStatusError):
    pass


class InternalServerError(APIStatusError):
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


def error_from_body(body: Any, status: int | None = None, fallback: str = "", *,
                    response: httpx.Response | None = None) -> APIError:
    """The exception for an error answer: ``status`` from HTTP, or None inside a stream; ``response`` is the HTTP
    answer it came in (an SSE stream's, for an error inside one)."""
    err = body.get("error") if isinstance(body, Mapping) else None
    detail = err if isinstance(err, Mapping) else body  # OpenAI's SDK's ``body``: the error object where one came
    if not isinstance(err, Mapping):
        err = {"message": fallback or f"the server answered HTTP {status}"}
    code, type_ = err.get("code"), err.get("type")
    if status is None and isinstance(body, Mapping) and isinstance(body.get("status"), int):  # inside a stream
        status = body["status"]
    elif status is None and isinstance(type_, str):
        status = _BY_TYPE.get(type_)
    cls = _BY_STATUS.get(status or 0) or (InternalServerError if (status or 0) >= 500 else
                                          APIStatusError if status is not None else APIError)
    if cls is ConflictError and code == "session_busy":
        cls = SessionBusyError
    return cls(str(err.get("message") or fallback or "unknown error"), status=status, type=type_, code=code,
               param=err.get("param"), response=response, body=detail)
