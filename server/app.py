"""``build_app(settings) -> FastAPI``: the model and the store open in ``lifespan``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Container, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import swagger_ui_bundle
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import Headers
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import errors, logs
from server.browsers import BrowserChecks
from server.deps import request_fields
from server.errors import error_body, send_error
from server.http_protocol import SENT_STATUS
from server.openapi import describe_errors
from server.routes import completions, health, sessions, tokenize, ws
from server.runtime import Runtime, close_runtime, open_runtime
from server.settings import Settings


class BodyLimit:
    """413 for bodies over the limit, counted as they arrive (Content-Length may be absent or lie), and 408
    for a body that stops arriving for ``timeout_s``, so a slow sender cannot pin a request forever; 415 for a
    body with a Content-Encoding (RFC 9110's answer to a coding the server does not decode).

    A body whose Content-Length is over the limit is refused before it is read. One found too large as it
    arrives is read and discarded to its end first (up to ``DRAIN_FACTOR`` times the limit), so that a client
    still uploading reads its answer instead of a reset connection. Past either limit the
    app sees the client gone, so no framework layer can turn the refusal into another status. Once the
    body is complete, reads (the app waiting for a disconnect) are no longer timed."""

    DRAIN_FACTOR = 4

    def __init__(self, app: ASGIApp, limit: int, timeout_s: float) -> None:
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def _drain(self, receive: Receive, seen: int) -> None:
        """Discard what is left of the body, within a byte budget and the read timeout."""
        with contextlib.suppress(asyncio.TimeoutError):
            while seen <= self.DRAIN_FACTOR * self.limit:
                msg = await asyncio.wait_for(receive(), self.timeout_s)
                seen += len(msg.get("body", b""))
                if msg["type"] != "http.request" or not msg.get("more_body", False):
                    return

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body exceeds {self.limit} bytes"
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            # at once: a client whose Content-Length lies (a short body, or none) must not wait out the body
            # timeout for its answer; the HTTP protocol reads and drops whatever of the body still comes, so a
            # client still uploading reads this answer, not a reset connection
            return await _refuse(send, 413, too_large, "payload_too_large")
        coding = dict(scope["headers"]).get(b"content-encoding", b"").decode("latin-1").strip()
        if coding.lower() not in ("", "identity"):  # a body read as it was not sent: a br body was taken for JSON
            return await _refuse(send, 415, f"the request body is sent with Content-Encoding {coding[:40]!r}: this "
                                 f"server reads bodies as they are, so send it uncompressed, without that header",
                                 "unsupported_content_encoding", headers=[(b"accept-encoding", b"identity")])
        seen, started, refused, complete = 0, False, False, False

        async def counted() -> Message:
            nonlocal seen, refused, complete
            if refused:
                return {"type": "http.disconnect"}
            if complete:
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                refused = True
                if not started:
                    await _refuse(send, 408, f"the request body did not arrive within {self.timeout_s:g} s",
                                  "request_timeout", close=True)
                return {"type": "http.disconnect"}
            seen += len(msg.get("body", b""))
            complete = msg["type"] != "http.request" or not msg.get("more_body", False)
            if seen > self.limit and not started:
                refused = True
                if not complete:
                    await self._drain(receive, seen)
                await _refuse(send, 413, too_large, "payload_too_large")
                return {"type": "http.disconnect"}
            return msg

        async def guarded(msg: Message) -> None:
            nonlocal started
            if refused:
                return  # the refusal has been sent; whatever the app says next goes nowhere
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        await self.app(scope, counted, guarded)


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
access_log = logging.getLogger(logs.REQUESTS)


class HeadAsGet:
    """HEAD on every GET route (RFC 9110: a general-purpose server supports both), answered as the GET is,
    without its body; FastAPI's routes answer only the methods they declare. Plain ASGI, like the others."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        def matched() -> None:  # the router records the route it matched (FastAPI's route, or Starlette's endpoint
            # and mount paths) in the scope it was given: the log line and the requests metric read it from ours
            for key in _ROUTE_KEYS:
                if key in inner:
                    scope[key] = inner[key]

        async def headers_only(msg: Message) -> None:
            matched()
            if msg["type"] == "http.response.body":
                if msg.get("more_body"):
                    return
                msg = {"type": "http.response.body", "body": b""}
            await send(msg)

        inner = {**scope, "method": "GET", "txlserve.head": True}  # errors name the method the client sent
        try:
            await self.app(inner, receive, headers_only)
        finally:
            matched()  # a route that sent nothing (it raised) is still named


_ROUTE_KEYS = ("route", "endpoint", "app_root_path", "root_path")  # what _route_label reads


def _client(scope: Scope) -> str | None:
    """Who sent it: the peer's address, or behind a proxy uvicorn trusts (on this host, or FORWARDED_ALLOW_IPS) the
    one X-Forwarded-For names, as its ProxyHeadersMiddleware leaves it. Without it a log could not say who sent a
    run of bad keys."""
    client = scope.get("client")
    return client[0] if client else None


def _route_label(scope: Scope) -> str | None:
    """The route a request matched, as the metric and the log line name it: FastAPI's routes leave themselves in
    the scope; Starlette's own leave only their endpoint: the OpenAPI schema (its one path), and static mounts
    (their prefix, never the file: one series per mount). None where no route ran."""
    if (route := scope.get("route")) is not None:
        return route.path
    if "endpoint" not in scope:
        return None
    if "app_root_path" in scope:  # a mount
        return scope.get("root_path", "") + "/{path}"
    return scope.get("path")


class RequestLog:
    """Every HTTP request gets an id (the client's ``x-request-id`` when it sends a sane one), echoed in the
    ``x-request-id`` response header, and one structured (JSON) log line when it ends: id, method, route,
    status, timings, and what the handler added (prompt and completion tokens, session id). It also counts
    requests by route and status and adds ``x-process-time-ms`` (time to the response start). Plain ASGI:
    Starlette's ``BaseHTTPMiddleware`` re-wraps every chunk of a streamed body, which cost the event loop a
    large share of its time at 64 concurrent streams."""

    def __init__(self, app: ASGIApp, runtime_of: Callable[[], Runtime | None],
                 paths: Callable[[], Mapping[str, Mapping[str, Any]]] = dict) -> None:
        self.app, self.runtime_of, self.paths = app, runtime_of, paths
        self._templates: list[tuple[re.Pattern[str], str, Container[str]]] | None = None

    def _unrouted(self, scope: Scope) -> str:
        """A request refused before the router ran (a body declared too large: 413) is named by the API route its
        method and path would have reached (``paths``: the OpenAPI schema's), else ``unmatched``."""
        if self._templates is None:
            self._templates = [(compile_path(template)[0], template, methods)
                               for template, methods in self.paths().items()]
        path, method = scope.get("path", ""), scope.get("method", "").lower()
        return next((template for regex, template, methods in self._templates
                     if method in methods and regex.match(path)), "unmatched")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status, started_ms, counted = time.monotonic(), 500, None, False
        request_id = _request_id(scope)

        def count() -> None:
            """Once, as the body's last byte is handed over: a client that has its answer finds it in /metrics. After
            the app returned it was too late: a static file's close, on a thread, let the client's next request
            (a scrape) run first (CI saw ``/static/{path}`` missing)."""
            nonlocal counted
            if not counted and (rt := self.runtime_of()) is not None:
                route = _route_label(scope) or self._unrouted(scope)
                rt.metrics.requests.labels(route, str(scope.get(SENT_STATUS, status))).inc()
            counted = True

        async def timed(msg: Message) -> None:
            nonlocal status, started_ms
            if msg["type"] == "http.response.start":
                status, started_ms = msg["status"], 1000 * (time.monotonic() - t0)
                extra = [(b"x-process-time-ms", f"{started_ms:.1f}".encode()), (b"x-request-id", request_id.encode())]
                msg = {**msg, "headers": [*msg.get("headers", []), *extra]}
            elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
                count()
            await send(msg)

        try:
            await self.app(scope, receive, timed)
        finally:
            status = scope.get(SENT_STATUS, status)
            route = _route_label(scope) or self._unrouted(scope)
            count()
            _log_line(request_id=request_id, method=scope.get("method"), route=route, status=status,
                      client=_client(scope), start_ms=None if started_ms is None else round(started_ms, 1),
                      total_ms=round(1000 * (time.monotonic() - t0), 1), **request_fields(scope))

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One line per WebSocket connection when it closes (its id in the handshake's ``x-request-id``), its
        ``status`` a number as every other line's: 101 once accepted, the refusal's HTTP status (a denial response;
        403 for a close before accepting, which is what the server then answers), or 500 where the app failed
        before answering the handshake (as uvicorn then does); ``close_code`` the WebSocket's, where the server
        closed it (1011 for a failure after accepting; 1009 where uvicorn closed it for a message too big, which
        the app hears of as a disconnect). The handshake is counted in ``txlserve_requests_total`` with that status
        as it is answered (a connection may last hours)."""
        t0, status, close_code = time.monotonic(), None, None
        request_id = _request_id(scope)

        def count(answered: int) -> None:
            nonlocal status
            if status is None and (rt := self.runtime_of()) is not None:
                rt.metrics.requests.labels(_route_label(scope) or "unmatched", str(answered)).inc()
            status = answered if status is None else status

        async def tagged(msg: Message) -> None:
            nonlocal close_code
            if msg["type"] == "websocket.accept":
                count(101)
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", request_id.encode())]}
            elif msg["type"] == "websocket.http.response.start":  # refused with an HTTP answer
                count(msg["status"])
            elif msg["type"] == "websocket.close":
                count(403)
                close_code = msg.get("code", 1000)
            await send(msg)

        async def heard() -> Message:
            nonlocal close_code
            msg = await receive()
            if msg["type"] == "websocket.disconnect" and msg.get("code") == 1009 and close_code is None:
                close_code = 1009  # a message over --max-body-bytes: the server's protocol layer closed it
            return msg

        try:
            await self.app(scope, heard, tagged)
        except Exception:
            if status == 101 and close_code is None:
                close_code = 1011  # the server closes a connection whose app failed with "internal error"
            raise
        finally:
            count(500)  # unanswered: the app failed first
            fields = {} if close_code is None else {"close_code": close_code}
            _log_line(request_id=request_id, method="WEBSOCKET", route=_route_label(scope) or "unmatched",
                      status=status, client=_client(scope),
                      total_ms=round(1000 * (time.monotonic() - t0), 1), **fields, **request_fields(scope))


def _request_id(scope: Scope) -> str:
    sent = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
    request_id = sent if _REQUEST_ID.fullmatch(sent) else secrets.token_hex(12)
    scope.setdefault("state", {})["request_id"] = request_id
    return request_id


def _log_line(**fields: object) -> None:
    if access_log.isEnabledFor(logging.INFO):
        access_log.info(json.dumps(fields, separators=(",", ":"), default=str))


class Cors(CORSMiddleware):
    """Starlette's CORS, with a refused preflight in OpenAI's error shape like every other error (Starlette
    answers it in plain text)."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        refused = bytes(response.body).decode().removeprefix("Disallowed CORS ")  # e.g. "origin, headers"
        headers = {k: v for k, v in response.headers.items() if k not in ("content-type", "content-length")}
        return JSONResponse(error_body(f"CORS preflight refused: this server does not allow the request's "
                                       f"{refused} (the origins it allows are its --cors-origins)",
                                       "invalid_request_error", None, "cors_not_allowed"),
                            status_code=response.status_code, headers=headers)


async def _refuse(send: Send, status: int, message: str, code: str, *, close: bool = False,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_error(send, status, error_body(message, "invalid_request_error", None, code), close=close,
                     headers=headers)


# Every URL in it is relative to the page, and its document's server is the page's directory, so that behind a proxy
# that serves the server under a prefix (/txl/docs) the assets, the document and "Try it out" keep the prefix: with
# FastAPI's page (absolute URLs, and OpenAPI's default server "/") it was blank there, and its calls went to the
# proxy's root. The newest offline Swagger UI (swagger-ui-bundle 1.1: Swagger UI 4.15) renders OpenAPI 3.0, not the
# 3.1 that FastAPI writes, and said only "Unable to render this definition": the page shows the document as 3.0
# (its schemas read the same there; /openapi.json itself stays 3.1).
_DOCS_PAGE = """<!DOCTYPE html>
<html>
<head>
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<link type="text/css" rel="stylesheet" href="docs/static/swagger-ui.css">
<link rel="shortcut icon" href="docs/static/favicon-32x32.png">
<title>txlserve API</title>
</head>
<body>
<div id="swagger-ui"></div>
<script src="docs/static/swagger-ui-bundle.js"></script>
<script>
fetch("openapi.json").then((r) => r.json()).then((spec) => {
  spec.openapi = "3.0.3";  // what Swagger UI 4 renders (it refused FastAPI's 3.1.0: "Unable to render this definition")
  spec.servers = [{ url: new URL(".", location.href).href.replace(/\\/$/, "") }];
  window.ui = SwaggerUIBundle({ spec, dom_id: "#swagger-ui", layout: "BaseLayout", deepLinking: true,
    showExtensions: true, showCommonExtensions: true,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset] });
});
</script>
</body>
</html>
"""


def _offline_docs(app: FastAPI) -> None:
    """Swagger UI at /docs from the installed swagger-ui-bundle, not a CDN, so it works offline."""
    app.mount("/docs/static", ws.http_only(StaticFiles(directory=swagger_ui_bundle.swagger_ui_path)),
              name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        # framed by another site, its Execute buttons could be clicked for a keyless server, as the playground's
        return HTMLResponse(_DOCS_PAGE, headers={"content-security-policy": "frame-ancestors 'none'",
                                                 "x-frame-options": "DENY"})

    @app.get("/docs/", include_in_schema=False)
    async def docs_slash() -> RedirectResponse:
        """Relative, so that it stays under a proxy's prefix (/txl/docs/ → /txl/docs)."""
        return RedirectResponse("../docs", status_code=307)


STATIC = Path(__file__).resolve().parent / "static"
# The playground's files only (the API's answers are JSON that no browser renders): another site could frame the
# page and trick a click onto its Delete buttons. The page has no inline script or style, so 'self' is all it needs
# ('self' covers its WebSocket, same-origin ws: or wss:); the favicon is a data: URL.
PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'none'",
    "x-frame-options": "DENY",  # frame-ancestors for browsers without CSP 2
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def _with_page_headers(app: ASGIApp) -> ASGIApp:
    """``PAGE_HEADERS`` on every answer of a mount (StaticFiles takes no headers)."""
    extra = [(name.encode(), value.encode()) for name, value in PAGE_HEADERS.items()]

    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)
        await app(scope, receive, sending)
    return serve


def _playground(app: FastAPI) -> None:
    """The web playground at /: static files in the package, no build step, no CDN (works offline)."""
    app.mount("/static", ws.http_only(_with_page_headers(StaticFiles(directory=STATIC))), name="static")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)


def build_app(settings: Settings, runtime: Runtime | None = None) -> FastAPI:
    """With ``runtime`` given (tests), lifespan uses it instead of opening one."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = runtime or await open_runtime(settings)
        app.state.runtime = rt
        try:
            yield
        finally:
            await close_runtime(rt)

    app = FastAPI(title="txlserve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  redirect_slashes=False,  # /v1/completions/ is a 404 in OpenAI's shape, not a bare 307
                  description="Transformer-XL inference with persistent per-session segment memory")
    _offline_docs(app)
    _playground(app)
    errors.install(app)
    routers = [module.router for module in (health, completions, sessions, tokenize, ws)]
    for router in routers:
        app.include_router(router)
    describe_errors(app, routers, model=settings.model_name)

    app.add_middleware(HeadAsGet)  # innermost: the log and the limits still see HEAD
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    if settings.cors_origins:  # off by default: browsers on other origins may call the API only when allowed
        # outside the limits: a page on an allowed origin reads their 413 and 408, not a bare network error
        app.add_middleware(Cors, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id", "x-process-time-ms"])
    # outside CORS: what a page must not do is refused whatever CORS would answer (DNS rebinding's requests are
    # same-origin anyway, and a cross-site POST needs no preflight)
    app.add_middleware(BrowserChecks, allowed_hosts=settings.allowed_hosts, cors_origins=settings.cors_origins,
                       keyed=bool(settings.api_keys))
    # outermost: the log line and the requests metric carry the status the client got, a 408 or 413 included
    # (inside the limits, they saw the app's answer to a body cut short, which the limits drop)
    app.add_middleware(RequestLog, runtime_of=lambda: getattr(app.state, "runtime", None),
                       paths=lambda: app.openapi()["paths"])
    return app
