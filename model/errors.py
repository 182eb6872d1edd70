"""The one error hierarchy of txlserve.

Every error a user can cause or meet derives from ``TxlError``; the server maps
each class to one HTTP status and OpenAI error type (``server/errors.py``), the
CLI prints ``str(err)`` as one line. Infrastructure errors (Redis, OS) are
translated into these at the package boundary that meets them.

    TxlError
    ├── ConfigError                 invalid model config or settings
    ├── CheckpointError             missing / damaged / mismatched checkpoint
    ├── DataError                   unreadable corpus or bad split request
    ├── InvalidRequestError         bad generation/scoring parameters   (400)
    │   └── StateIncompatible       a state built by another model      (400)
    │       └── SessionIncompatible stored session of another model     (422)
    ├── SessionNotFound             no such session (or not yours)      (404)
    ├── SessionBusy                 session leased by another request   (409)
    ├── SessionConflict             commit lost a compare-and-set race  (409)
    ├── SessionCorrupt              stored payload fails validation     (422)
    ├── PayloadTooLarge             state/body over a configured limit  (413)
    ├── Overloaded                  queue full                          (429)
    ├── StoreUnavailable            Redis unreachable / timed out       (503)
    ├── AuthenticationError         missing or wrong API key            (401)
    ├── ModelNotFound               a model name this server does not serve (404)
    ├── UnsupportedEndpoint         an OpenAI route a base model cannot serve (404)
    └── Unavailable                 starting, draining, or cancelled by shutdown (503)

A stored session that exists but cannot be used (another model, damaged) is a
422: the request was well-formed, the stored data is not usable by this server.
"""

from __future__ import annotations


class TxlError(Exception):
    """Base of every txlserve error; ``code`` is a stable machine-readable name."""

    code: str = "txlserve_error"

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
    code = "session_incompatible"


class SessionNotFound(TxlError, KeyError):
    code = "session_not_found"

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class SessionBusy(TxlError):
    code = "session_busy"


class SessionConflict(TxlError):
    code = "session_conflict"


class SessionCorrupt(TxlError):
    code = "session_corrupt"


class PayloadTooLarge(TxlError):
    code = "payload_too_large"


class Overloaded(TxlError):
    code = "overloaded"


class StoreUnavailable(TxlError):
    code = "store_unavailable"


class AuthenticationError(TxlError):
    code = "invalid_api_key"


class ModelNotFound(TxlError):
    code = "model_not_found"


class UnsupportedEndpoint(TxlError):
    code = "unsupported_endpoint"


class Unavailable(TxlError):
    code = "service_unavailable"
