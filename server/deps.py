"""Request dependencies: the runtime, and the caller's identity (the owner of its sessions)."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import MutableMapping
from typing import Any

from fastapi import Request, WebSocket

from server.runtime import Runtime
from txlserve.errors import AuthenticationError, InvalidRequestError


def request_fields(scope: MutableMapping[str, Any]) -> dict[str, Any]:
    """What a handler adds to its request's log line (token counts, session id): never a key, never text."""
    return scope.setdefault("state", {}).setdefault("log_fields", {})


# The dependencies are ``async def`` on purpose: FastAPI runs a plain ``def`` dependency in its thread pool, and
# two thread hops per request, each waiting for the GIL while the engine thread steps, cost a herd of 64
# requests ~600 ms before its handlers even start (BENCHMARKS.md, "Serving").
async def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def owner_for_key(rt: Runtime, key: str | None) -> str | None:
    """With API keys configured, sessions belong to the key that made them (stored as a hash)."""
    keys = rt.settings.api_keys
    if not keys:
        return None
    given = None if key is None else key.encode("utf-8", "surrogatepass")  # compare_digest refuses non-ASCII str
    if given is None or not any(hmac.compare_digest(given, k.encode("utf-8", "surrogatepass")) for k in keys):
        raise AuthenticationError("invalid or missing API key (send 'Authorization: Bearer <key>')")
    return "key:" + hashlib.sha256(given).hexdigest()[:24]


def _bearer(header: str | None) -> str | None:
    if header and header.lower().startswith("bearer "):
        return header[7:].strip()
    return None


async def owner(request: Request) -> str | None:
    return owner_for_key(request.app.state.runtime, _bearer(request.headers.get("authorization")))


def takes_key(route: object) -> bool:
    """Whether a route checks an API key (its dependencies include :func:`owner`)."""
    dependant = getattr(route, "dependant", None)
    return dependant is not None and any(d.call is owner for d in dependant.dependencies)


# A browser's WebSocket can send no header of its own, but it can offer subprotocols: the playground offers
# ``txlserve`` and ``txlserve.api-key.<the key, base64url>`` (Kubernetes' way for its bearer tokens), which a proxy
# logs nowhere, where ``?api_key=`` went into nginx's error log with every upstream failure (found by a helper).
SUBPROTOCOL = "txlserve"
KEY_SUBPROTOCOL = "txlserve.api-key."


def _subprotocol_key(ws: WebSocket) -> str | None:
    offered = ws.scope.get("subprotocols") or ()
    for protocol in offered:
        if protocol.startswith(KEY_SUBPROTOCOL):
            if SUBPROTOCOL not in offered:  # none could be chosen: a browser fails the socket without a word
                raise InvalidRequestError(f"a WebSocket that offers its key as a subprotocol offers {SUBPROTOCOL!r} "
                                          f"too, for the server to choose: new WebSocket(url, [{SUBPROTOCOL!r}, "
                                          f"'{KEY_SUBPROTOCOL}' + key])")
            encoded = protocol[len(KEY_SUBPROTOCOL):]
            try:  # strictly: urlsafe_b64decode dropped what is not of its alphabet, and "%%%" was an empty key
                return base64.b64decode(encoded + "=" * (-len(encoded) % 4), altchars=b"-_",
                                        validate=True).decode("utf-8")
            except (ValueError, UnicodeDecodeError):  # binascii.Error is a ValueError
                raise AuthenticationError(f"the API key in the WebSocket's subprotocol ({KEY_SUBPROTOCOL}...) is "
                                          "not base64url of UTF-8 text") from None
    return None


def ws_owner(ws: WebSocket) -> str | None:
    """The key from ``Authorization``, the ``txlserve.api-key.`` subprotocol, or ``?api_key=`` (kept for clients
    that send it so; a proxy may log it). A server without keys reads none, as it ignores a header's."""
    rt = ws.app.state.runtime
    if not rt.settings.api_keys:
        return None
    key = _bearer(ws.headers.get("authorization")) or _subprotocol_key(ws) or ws.query_params.get("api_key")
    return owner_for_key(rt, key)


def ws_subprotocol(ws: WebSocket) -> str | None:
    """The subprotocol to accept: ``txlserve`` where offered (a browser fails a connection that offered some and
    had none chosen; the key's own is never echoed back)."""
    return SUBPROTOCOL if SUBPROTOCOL in (ws.scope.get("subprotocols") or ()) else None
