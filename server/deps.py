"""Request dependencies: the runtime, and the caller's identity (the owner of its sessions)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import re
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


def _offered_key(ws: WebSocket) -> str | None:
    """The key subprotocol offered, if any; one offered without ``txlserve`` is refused, keys or not: none could
    be chosen, and a browser fails such a socket without a word."""
    offered = ws.scope.get("subprotocols") or ()
    protocol = next((p for p in offered if p.startswith(KEY_SUBPROTOCOL)), None)
    if protocol is not None and SUBPROTOCOL not in offered:
        raise InvalidRequestError(f"a WebSocket that offers its key as a subprotocol offers {SUBPROTOCOL!r} too, for "
                                  f"the server to choose: new WebSocket(url, [{SUBPROTOCOL!r}, '{KEY_SUBPROTOCOL}' "
                                  f"+ key])")
    return protocol


_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")


def _subprotocol_key(protocol: str | None) -> str | None:
    if protocol is None:
        return None
    encoded = protocol[len(KEY_SUBPROTOCOL):]
    # strictly base64url: urlsafe_b64decode dropped what is not of its alphabet, and "%%%" was an empty key
    if _BASE64URL.fullmatch(encoded):
        with contextlib.suppress(ValueError):  # binascii.Error and UnicodeDecodeError are ValueErrors
            return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode("utf-8")
    raise AuthenticationError(f"the API key in the WebSocket's subprotocol ({KEY_SUBPROTOCOL}...) is not base64url "
                              "of UTF-8 text")


def ws_owner(ws: WebSocket) -> str | None:
    """The key from ``Authorization``, the ``txlserve.api-key.`` subprotocol, or ``?api_key=`` (kept for clients
    that send it so; a proxy may log it). A server without keys reads none, as it ignores a header's."""
    rt = ws.app.state.runtime
    protocol = _offered_key(ws)
    if not rt.settings.api_keys:
        return None
    key = _bearer(ws.headers.get("authorization")) or _subprotocol_key(protocol) or ws.query_params.get("api_key")
    return owner_for_key(rt, key)


def ws_subprotocol(ws: WebSocket) -> str | None:
    """The subprotocol to accept: ``txlserve`` where offered (a browser fails a connection that offered some and
    had none chosen; the key's own is never echoed back)."""
    return SUBPROTOCOL if SUBPROTOCOL in (ws.scope.get("subprotocols") or ()) else None
