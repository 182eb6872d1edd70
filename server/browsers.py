"""What a web page in a user's browser must not make this server do, refused before any route runs.

Any page the user opens can send requests to a server on their machine or network, without API keys nothing
else stands in its way, and each check below closes one way:

- **DNS rebinding** (the Host check). A page of ``evil.example`` points that name at 127.0.0.1 once loaded; its
  later requests to ``evil.example:8000`` are same-origin to the browser (no CORS, and a WebSocket's Origin equals
  its Host), so it could read and delete sessions. The browser still sends ``Host: evil.example:8000``: a request
  that arrived on a loopback socket must name a loopback host (``localhost``, ``*.localhost``: browsers keep those
  on loopback), an IP address (a page cannot make the browser send one it does not connect to), or a name of
  ``--allowed-hosts``. Given, ``--allowed-hosts`` is checked on every socket, as Django's ``ALLOWED_HOSTS`` and
  Starlette's ``TrustedHostMiddleware`` are; ``*`` turns it off. Ollama and Vite's dev server check the same.
- **Cross-site requests** (the origin check). A page of another origin may send a POST or DELETE that it cannot
  read the answer of (a form, a ``fetch`` with ``mode: "no-cors"``: no preflight), and open a WebSocket with no
  check at all (cross-site WebSocket hijacking). A request that changes something, and every WebSocket handshake,
  must come from no browser (no ``Origin``), from this server's own pages, or from an origin of ``--cors-origins``.
  Same-origin is the browser's word (``Sec-Fetch-Site``: ``same-origin``, or ``none`` for what the user typed),
  else the ``Origin`` header's host against ``Host`` (or ``X-Forwarded-Host`` behind a proxy): Go's
  ``net/http.CrossOriginProtection``. GET, HEAD and OPTIONS change nothing here, and CORS keeps their answers from
  pages of other origins.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from server.deps import request_fields
from server.errors import classify, send_error
from server.routes.ws import refuse
from txlserve.errors import HostNotAllowed, PermissionDenied

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # the routes that change something take none of these


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


def _header(scope: Scope, name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == name), None)


class BrowserChecks:
    """403 for an HTTP request or WebSocket handshake a web page must not make (see the module's docstring):
    ``host_not_allowed`` or ``origin_not_allowed``. Plain ASGI, like the server's other middleware."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...], cors_origins: tuple[str, ...]) -> None:
        self.app, self.cors_origins = app, cors_origins
        self.allowed_hosts = tuple(a.lower().removesuffix(".") for a in allowed_hosts)

    def host_refusal(self, scope: Scope) -> HostNotAllowed | None:
        if "*" in self.allowed_hosts or (not self.allowed_hosts and not loopback_socket(scope)):
            return None
        header = _header(scope, b"host") or ""
        if name_allowed(host_name(header), self.allowed_hosts):
            return None
        where = "a loopback address" if loopback_socket(scope) else "this address"
        return HostNotAllowed(
            f"this server answers requests addressed to localhost, an IP address or a name of --allowed-hosts; this "
            f"one was addressed to {header[:100]!r} (its Host header) on {where}. A web page can point a name it "
            f"owns at 127.0.0.1 (DNS rebinding) to reach a server on your machine, so other names are refused. To "
            f"serve this name (a proxy that passes on its own Host), add it to --allowed-hosts / "
            f"TXLSERVE_ALLOWED_HOSTS")

    def origin_refusal(self, scope: Scope) -> PermissionDenied | None:
        websocket = scope["type"] == "websocket"
        if not websocket and scope.get("method") in SAFE_METHODS:
            return None
        site = _header(scope, b"sec-fetch-site")
        if site in ("same-origin", "none"):  # the browser's own word, whatever a proxy did to Host
            return None
        origin = _header(scope, b"origin")
        if origin is None and site is None:  # not a browser (or one that sent neither, same-origin then)
            return None
        if origin is not None and ("*" in self.cors_origins or origin in self.cors_origins):
            return None
        if origin is not None and site is None:  # an older browser: the Origin's host against the Host
            try:
                netloc = urlsplit(origin).netloc.lower() if origin.startswith(("http://", "https://")) else ""
            except ValueError:  # "http://[::1", say
                netloc = ""
            if netloc and netloc in {h.lower() for h in (_header(scope, b"host"), _header(scope, b"x-forwarded-host"))
                                     if h}:
                return None
        what = "WebSocket connections" if websocket else f"{scope.get('method')} requests"
        return PermissionDenied(f"{what} from a page of origin {(origin or 'unknown')[:200]!r} are not allowed: the "
                                "server takes them from its own pages and those of the origins of --cors-origins / "
                                "TXLSERVE_CORS_ORIGINS (a page of another site could otherwise act on it through "
                                "your browser)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if (err := self.host_refusal(scope) or self.origin_refusal(scope)) is None:
            return await self.app(scope, receive, send)
        request_fields(scope)["error"] = err.code  # on the request's log line, as every refusal's code
        if scope["type"] == "websocket":
            return await refuse(WebSocket(scope, receive, send), err)
        await send_error(send, *classify(err))
