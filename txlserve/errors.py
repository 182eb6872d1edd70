"""The one error hierarchy of txlserve, and the one table from each error to its HTTP status and OpenAI type.

Every error a user can cause or meet derives from ``TxlError``. Each class carries its
``status``, OpenAI error ``type`` and a stable ``code``: the server answers HTTP and WebSocket
errors from these attributes alone (``server/errors.py``), errors inside a stream carry the
same status, and the CLI prints ``str(err)`` as one line. Infrastructure errors (Redis, OS)
are translated into these at the package boundary that meets them. This module is neutral:
``model/``, ``memory_store/`` and ``server/`` all import it, it imports none of them.

    TxlError                                                     status  type
    ├── ConfigError                 invalid model config or settings    400  invalid_request_error
    ├── CheckpointError             missing / damaged checkpoint        400  invalid_request_error
    ├── DataError                   unreadable corpus or bad split      400  invalid_request_error
    ├── InvalidRequestError         bad generation/scoring parameters   400  invalid_request_error
    │   └── StateIncompatible       a state built by another model      400  invalid_request_error
    │       └── SessionIncompatible stored session of another model     422  invalid_request_error
    ├── AuthenticationError         missing or wrong API key            401  authentication_error
    ├── PermissionDenied            a page of another origin: its       403  permission_error
    │   │                           POST, DELETE or WebSocket
    │   └── HostNotAllowed          a Host this server must not answer  403  permission_error
    │                               (DNS rebinding; --allowed-hosts)
    ├── SessionNotFound             no such session (or not yours)      404  not_found_error
    ├── ModelNotFound               a model this server does not serve  404  not_found_error
    ├── UnsupportedEndpoint         an OpenAI route a base model lacks  404  invalid_request_error
    ├── RouteNotFound               no such path (HTTP or WebSocket)    404  not_found_error
    ├── SessionBusy                 session leased by another request   409  conflict_error
    ├── SessionConflict             commit lost a compare-and-set race  409  conflict_error
    ├── PayloadTooLarge             state/body over a configured limit  413  invalid_request_error
    ├── UpgradeRequired             plain HTTP to the WebSocket route   426  invalid_request_error
    ├── SessionCorrupt              stored payload fails validation     422  invalid_request_error
    ├── Overloaded                  queue full                          429  rate_limit_error
    ├── RequestCancelled            left or cancelled before its text   499  invalid_request_error
    │                               was read (nginx's status; over
    │                               HTTP only logs and metrics see it)
    ├── StoreUnavailable            Redis unreachable / timed out       503  service_unavailable_error
    │   ├── StoreOverloaded         every pooled connection busy        429  rate_limit_error
    │   └── CommitUnknown           a commit's reply lost: it may have  503  service_unavailable_error
    │                               landed (not to be retried blindly)
    └── Unavailable                 starting, draining, or shut down    503  service_unavailable_error
        └── EngineDead              the engine's process died           503  service_unavailable_error

Anything else that escapes is a bug: 500 ``server_error``, logged, never shown.
A stored session that exists but cannot be used (another model, damaged) is a 422: the
request was well-formed, the stored data is not usable by this server.
"""

from __future__ import annotations

INTERNAL_STATUS, INTERNAL_TYPE, INTERNAL_CODE = 500, "server_error", "internal_error"


class TxlError(Exception):
    """Base of every txlserve error; ``code`` is a stable machine-readable name."""

    status: int = 400
    type: str = "invalid_request_error"
    code: str = "txlserve_error"
    headers: dict[str, str] | None = None  # its answer's own headers; None: its status's (a 429's or 503's Retry-After)

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ConfigError(TxlError, ValueError):
    code = "invalid_config"


class CheckpointError(TxlError):
    code = "invalid_checkpoint"


class DataError(TxlError):
    code = "invalid_data"


class InvalidRequestError(TxlError, ValueError):
    code = "invalid_request"


class StateIncompatible(InvalidRequestError):
    code = "state_incompatible"


class SessionIncompatible(StateIncompatible):
    status, code = 422, "session_incompatible"


class AuthenticationError(TxlError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class PermissionDenied(TxlError):
    status, type, code = 403, "permission_error", "origin_not_allowed"


class HostNotAllowed(PermissionDenied):
    code = "host_not_allowed"


class SessionNotFound(TxlError, KeyError):
    status, type, code = 404, "not_found_error", "session_not_found"

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class ModelNotFound(TxlError):
    status, type, code = 404, "not_found_error", "model_not_found"


class UnsupportedEndpoint(TxlError):
    status, code = 404, "unsupported_endpoint"


class RouteNotFound(TxlError):
    status, type, code = 404, "not_found_error", "unknown_route"


class SessionBusy(TxlError):
    """``ending``: its holder's client has left and it is committing what it made, so the session is free in
    milliseconds (a replica's request waits for that rather than answering 409)."""

    status, type, code = 409, "conflict_error", "session_busy"

    def __init__(self, message: str, *, param: str | None = None, ending: bool = False) -> None:
        super().__init__(message, param=param)
        self.ending = ending


class SessionConflict(TxlError):
    status, type, code = 409, "conflict_error", "session_conflict"


class PayloadTooLarge(TxlError):
    status, code = 413, "payload_too_large"


class UpgradeRequired(TxlError):
    status, code = 426, "websocket_required"


class SessionCorrupt(TxlError):
    status, code = 422, "session_corrupt"


class Overloaded(TxlError):
    status, type, code = 429, "rate_limit_error", "overloaded"


class RequestCancelled(TxlError):
    """The client left (or cancelled) while its prompt was read, so nothing was stored. Not a server error:
    counted as 499, as nginx counts a client that closed its request, so that 5xx dashboards stay quiet."""

    status, code = 499, "request_cancelled"


class StoreUnavailable(TxlError):
    status, type, code = 503, "service_unavailable_error", "store_unavailable"


class StoreOverloaded(StoreUnavailable):
    """A burst held every pooled connection to Redis past the store's timeout: Redis answers, this server has
    more requests at once than connections (a 503 "Redis is unavailable" said otherwise). A StoreUnavailable, so
    that what retries an unreachable Redis (a lease's renewal, its release) retries this too."""

    status, type, code = 429, "rate_limit_error", "store_overloaded"


class CommitUnknown(StoreUnavailable):
    """Redis stopped answering as a commit went out, and had not answered again: the commit may have landed. A
    retry of a completion whose commit landed would continue its session twice, so this 503 says not to retry
    blindly (no Retry-After, and OpenAI's SDKs' ``x-should-retry: false``): read the session's tokens_seen."""

    code = "commit_outcome_unknown"
    headers = {"x-should-retry": "false"}


class Unavailable(TxlError):
    status, type, code = 503, "service_unavailable_error", "service_unavailable"


class EngineDead(Unavailable):
    """The engine's process died: this server answers nothing until it is restarted, so its 503 carries no
    Retry-After (a client told to retry in a second retried a dead server every second; found by a helper)."""

    code = "engine_dead"
    headers: dict[str, str] = {}

    @classmethod
    def because(cls, why: str) -> EngineDead:
        return cls(f"{why}; the server cannot serve until it is restarted")
