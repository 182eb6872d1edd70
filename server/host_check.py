"""Refuse requests addressed to a name the server was not told it serves, where any name can be a trick.

A server on loopback without API keys is reachable by every web page its user opens, through DNS rebinding: a
page of ``evil.example`` points that name at 127.0.0.1 once loaded, and its later requests to ``evil.example:8000``
are same-origin to the browser (no CORS, and a WebSocket's Origin equals its Host) yet reach this server, which
would let the page read and delete sessions. The browser still sends ``Host: evil.example:8000``: a request that
arrived on a loopback socket must name a loopback host (``localhost``, ``*.localhost``: browsers keep those on
loopback), an IP address (a page cannot make the browser send one it does not connect to), or a name of
``--allowed-hosts``. Given, ``--allowed-hosts`` is checked on every socket, as Django's ``ALLOWED_HOSTS`` and
Starlette's ``TrustedHostMiddleware`` are; ``*`` turns the check off. Ollama and Vite's dev server check the same."""

from __future__ import annotations

import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from server.deps import request_fields
from server.errors import classify, send_error
from server.routes.ws import refuse
from txlserve.errors import HostNotAllowed


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def host_name(header: str) -> str:
    """The name a Host header carries, without its port and a final dot, lower-cased (``[::1]:8000`` → ``::1``)."""
    name = header.strip().lower()
    if name.startswith("["):
        name = name[1:name.index("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    return name.removesuffix(".")


def name_allowed(name: str, allowed: tuple[str, ...]) -> bool:
    """``allowed`` holds names and ``*.suffix`` patterns (a pattern matches a subdomain, not the suffix itself)."""
    if not name or _ip(name) is not None or name == "localhost" or name.endswith(".localhost"):
        return True  # no Host (HTTP/1.0, never a browser) is no name a page could have chosen
    return any(name == a or (a.startswith("*.") and name.endswith(a[1:])) for a in allowed)


def loopback_socket(scope: Scope) -> bool:
    """Whether the request arrived on a loopback address of this host (one bound to 0.0.0.0 included, when the
    client connected through 127.0.0.1); ASGI names it in ``server``. A Unix socket no browser reaches is not."""
    server = scope.get("server") or (None,)
    ip = _ip(str(server[0])) if server[0] else None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip is not None and ip.is_loopback


class HostCheck:
    """403 (``host_not_allowed``) for an HTTP request or WebSocket handshake whose Host this server must not
    answer; see the module's docstring for which. Plain ASGI, like the server's other middleware."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, tuple(a.lower().removesuffix(".") for a in allowed)

    def refusal(self, scope: Scope) -> HostNotAllowed | None:
        if scope["type"] not in ("http", "websocket") or "*" in self.allowed:
            return None
        if not self.allowed and not loopback_socket(scope):
            return None
        header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"), "")
        if name_allowed(host_name(header), self.allowed):
            return None
        where = "a loopback address" if loopback_socket(scope) else "this address"
        return HostNotAllowed(
            f"this server answers requests addressed to localhost, an IP address or a name of --allowed-hosts; this "
            f"one was addressed to {header[:100]!r} (its Host header) on {where}. A web page can point a name it "
            f"owns at 127.0.0.1 (DNS rebinding) to reach a server on your machine, so other names are refused. To "
            f"serve this name (a proxy that passes on its own Host), add it to --allowed-hosts / "
            f"TXLSERVE_ALLOWED_HOSTS")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (err := self.refusal(scope)) is None:
            return await self.app(scope, receive, send)
        request_fields(scope)["error"] = err.code  # on the request's log line, as every refusal's code
        if scope["type"] == "websocket":
            return await refuse(WebSocket(scope, receive, send), err)
        await send_error(send, *classify(err))
