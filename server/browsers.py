"""What a web page in a user's browser must not make this server do, refused before any route runs.

Any page the user opens can send requests to a server on their machine or network, without API keys nothing
else stands in its way, and each check below closes one way:

- **DNS rebinding** (the Host check). A page of ``evil.example`` points that name at the server's address once
  loaded (127.0.0.1, or a LAN address); its later requests to ``evil.example:8000`` are same-origin to the browser
  (no CORS, and a WebSocket's Origin equals its Host), so it could read and delete sessions. The browser still
  sends ``Host: evil.example:8000``. A server without API keys answers only names no page can point anywhere: IP
  addresses (a page cannot make the browser send one it does not connect to), ``localhost`` and the names under
  it, this machine's own name, and the names of ``--allowed-hosts``; on an address other than loopback also names
  of one label (a Docker service's, a LAN host's) and names under ``.local``, ``.internal`` and ``.home.arpa``
  (reserved, never in public DNS; on loopback they are not taken, as a machine on the LAN can answer for them,
  through mDNS or LLMNR, and so reach a server that listens on loopback alone). A server given ``--allowed-hosts``
  checks them, keys or not, and takes no other name than those and the addresses, localhost and this machine's
  name (Django's ``ALLOWED_HOSTS``, Starlette's ``TrustedHostMiddleware``); ``*`` turns the check off. A proxy's
  ``X-Forwarded-Host`` is checked as its ``Host`` is: one that passes on the page's host there (the README's
  recipe) but connects by address had let a rebound name through. With keys, a page has none to send, and a
  tunnel's own Host (ngrok's) stays served. Ollama and Vite's dev server check alike.
- **Cross-site requests** (the origin check). A page of another origin may send a POST or DELETE that it cannot
  read the answer of (a form, a ``fetch`` with ``mode: "no-cors"``: no preflight), and open a WebSocket with no
  check at all (cross-site WebSocket hijacking). A request that changes something, and every WebSocket handshake,
  must come from no browser (no ``Origin``), from this server's own pages, or from an origin of ``--cors-origins``.
  Same-origin is the browser's word (``Sec-Fetch-Site``: ``same-origin``, or ``none`` for what the user typed),
  where it says it (a fetch over HTTPS or to localhost: browsers send it only to trustworthy origins, and Chromium
  none in a WebSocket's handshake), else the ``Origin`` header's host against ``Host`` (or ``X-Forwarded-Host``
  behind a proxy): Go's ``net/http.CrossOriginProtection``.
  GET, HEAD and OPTIONS change nothing here, and CORS keeps their answers from pages of other origins.
"""

from __future__ import annotations

import ipaddress
import socket
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
    if name.startswith("[") and "]" in name:
        bracketed, _, rest = name[1:].partition("]")
        name = bracketed if not rest or rest.startswith(":") else name  # "[::1]evil.example" names no address
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    return name.removesuffix(".")


PRIVATE_SUFFIXES = (".local", ".internal", ".home.arpa")  # mDNS's, ICANN's and RFC 8375's: never in public DNS


def name_allowed(name: str, allowed: tuple[str, ...], *, strict: bool = False) -> bool:
    """``allowed`` holds names and ``*.suffix`` patterns (a pattern matches a subdomain, not the suffix itself);
    ``strict``: names the LAN can answer for are not taken (on loopback, or where a list says which names are)."""
    if not name or _ip(name) is not None or _localhost(name) or name == _HOSTNAME:
        return True  # no Host (HTTP/1.0, never a browser) is no name a page could have chosen
    if not strict and ("." not in name or name.endswith(PRIVATE_SUFFIXES)):
        return True
    return any(name == a or (a.startswith("*.") and name.endswith(a[1:])) for a in allowed)


_HOSTNAME = socket.gethostname().lower()


def loopback_name(host: str) -> bool:
    """Whether a bind address or name reaches this host alone: any 127.x address, ``::1`` (bracketed or not),
    ``localhost`` and the names under it (what ``--host`` may be without the keyless warning)."""
    name = host_name(host)
    ip = _ip(name)
    return _localhost(name) if ip is None else ip.is_loopback


def _localhost(name: str) -> bool:
    return name == "localhost" or name.endswith(".localhost")  # RFC 6761: always this host


def loopback_socket(scope: Scope) -> bool:
    """Whether the request arrived on a loopback address of this host (one bound to 0.0.0.0 included, when the
    client connected through 127.0.0.1); ASGI names it in ``server``. An address it does not name, or names as no
    IP (a Unix socket, a test client's), counts as loopback: the stricter side."""
    server = scope.get("server") or (None,)
    ip = _ip(str(server[0])) if server[0] else None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip is None or ip.is_loopback


def _header(scope: Scope, name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == name), None)


def _named(scope: Scope, names: tuple[bytes, ...]) -> list[tuple[bytes, str]]:
    """Every value of these headers, a comma-separated list's items each (X-Forwarded-Host as proxies chain it)."""
    return [(k, item) for k, v in scope.get("headers", ()) if k in names
            for item in v.decode("latin-1").split(",")]


class BrowserChecks:
    """403 for an HTTP request or WebSocket handshake a web page must not make (see the module's docstring):
    ``host_not_allowed`` or ``origin_not_allowed``. Plain ASGI, like the server's other middleware."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...], cors_origins: tuple[str, ...], *,
                 keyed: bool) -> None:
        self.app, self.cors_origins = app, cors_origins
        self.allowed_hosts = tuple(a.lower().removesuffix(".") for a in allowed_hosts)
        self.checks_hosts = "*" not in self.allowed_hosts and (bool(self.allowed_hosts) or not keyed)

    def host_refusal(self, scope: Scope) -> HostNotAllowed | None:
        if not self.checks_hosts:
            return None
        loopback = loopback_socket(scope)
        for header, value in _named(scope, (b"host", b"x-forwarded-host")):  # every one: proxies append theirs
            if not name_allowed(host_name(value), self.allowed_hosts, strict=loopback or bool(self.allowed_hosts)):
                request_fields(scope)["refused"] = value[:200]
                where = f"its {header.decode().title()} header" + (", on loopback" if loopback else "")
                return HostNotAllowed(
                    "this server answers requests addressed to an IP address, localhost or a name under it, this "
                    "machine's name, a name of --allowed-hosts, or (beyond loopback, and without that list) a name "
                    "of one label or under .local, .internal or .home.arpa; this one was addressed to "
                    f"{value[:100]!r} ({where}). A web page can point a name it owns at this server's address (DNS "
                    "rebinding) and act on it from your browser, so other names are refused. To serve this name, "
                    "add it to --allowed-hosts / TXLSERVE_ALLOWED_HOSTS (a list, once given, is every name it "
                    "answers besides addresses, localhost and this machine's: list the one-label or .local names "
                    "you use too)")
        return None

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
        host, forwarded = _header(scope, b"host"), _header(scope, b"x-forwarded-host")
        http = origin is not None and origin.startswith(("http://", "https://"))
        if http and site is None:  # plain HTTP beyond localhost: the Origin's host against Host
            try:
                netloc = urlsplit(origin).netloc.lower()
            except ValueError:  # "http://[::1", say
                netloc = ""
            # a proxy's X-Forwarded-Host is the page's host, port included; its Host may have lost the port (nginx's
            # $host), which let a page of another port of that host in (found by a helper): where a proxy says
            # which host the page came from, that alone is compared
            page = forwarded.split(",")[0].strip() if forwarded else host  # proxies append theirs: the first is the
            if netloc and netloc == (page or "").lower():  # client's, set by the proxy it reached
                return None
        what = "a WebSocket" if websocket else f"a {scope.get('method')}"
        shown = (origin or "unknown")[:200]
        if site is not None:
            why = f"the browser says the page is of another origin (Sec-Fetch-Site: {site[:20]})"
        elif not http:
            why = "it is no http(s) origin, and not one of --cors-origins"
        else:
            why = (f"its host is not this request's X-Forwarded-Host, {forwarded[:100]!r}" if forwarded else
                   f"its host is not this request's Host, {(host or '')[:100]!r}, and it has no X-Forwarded-Host") + (
                " (a reverse proxy passes the page's host on, port included: nginx's proxy_set_header "
                "X-Forwarded-Host $http_host)")
        request_fields(scope)["refused"] = origin[:200] if origin is not None else f"Sec-Fetch-Site: {site[:20]}"
        return PermissionDenied(f"{what} from origin {shown!r} is not allowed: {why}. The server takes these from "
                                "its own pages and from the origins of --cors-origins / TXLSERVE_CORS_ORIGINS; a "
                                "page of another site could otherwise act on it through your browser")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if (err := self.host_refusal(scope) or self.origin_refusal(scope)) is None:
            return await self.app(scope, receive, send)
        request_fields(scope)["error"] = err.code  # on the request's log line, as every refusal's code
        if scope["type"] == "websocket":
            return await refuse(WebSocket(scope, receive, send), err)
        await send_error(send, *classify(err))
