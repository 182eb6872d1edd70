"""``build_app(settings) -> FastAPI``: the model and the store open in ``lifespan``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import swagger_ui_bundle
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import errors
from server.errors import error_body
from server.routes import completions, health, sessions, ws
from server.runtime import Runtime, close_runtime, open_runtime
from server.settings import Settings


class BodyLimit:
    """413 for bodies over the limit, counted as they arrive (Content-Length may be absent or lie), and 408
    for a body that stops arriving for ``timeout_s``, so a slow sender cannot pin a request forever.

    Before a 413 the rest of the body is read and discarded (up to ``DRAIN_FACTOR`` times the limit), so
    that a client still uploading reads its answer instead of a reset connection. Past either limit the
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
            if int(declared) <= self.DRAIN_FACTOR * self.limit:
                await self._drain(receive, 0)
            return await _refuse(send, 413, too_large, "payload_too_large")
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


class CountRequests:
    """Counts every answered request by route and status, and adds ``x-process-time-ms`` (time to the response
    start). Plain ASGI: Starlette's ``BaseHTTPMiddleware`` re-wraps every chunk of a streamed body, which cost
    the event loop a large share of its time at 64 concurrent streams."""

    def __init__(self, app: ASGIApp, runtime_of: Callable[[], Runtime | None]) -> None:
        self.app, self.runtime_of = app, runtime_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.monotonic(), 500

        async def timed(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                took = f"{1000 * (time.monotonic() - t0):.1f}".encode()
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-process-time-ms", took)]}
            await send(msg)

        try:
            await self.app(scope, receive, timed)
        finally:
            if (rt := self.runtime_of()) is not None:
                route = scope.get("route")
                rt.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status)).inc()


async def _refuse(send: Send, status: int, message: str, code: str, *, close: bool = False) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + ([(b"connection", b"close")] if close else [])})
    await send({"type": "http.response.body", "body": body})


def _offline_docs(app: FastAPI) -> None:
    """Swagger UI at /docs from the installed swagger-ui-bundle, not a CDN, so it works offline."""
    app.mount("/docs/static", StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title="txlserve API",
                                   swagger_js_url="/docs/static/swagger-ui-bundle.js",
                                   swagger_css_url="/docs/static/swagger-ui.css",
                                   swagger_favicon_url="/docs/static/favicon-32x32.png")


STATIC = Path(__file__).resolve().parent / "static"


def _playground(app: FastAPI) -> None:
    """The web playground at /: static files in the package, no build step, no CDN (works offline)."""
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")


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
                  description="Transformer-XL inference with persistent per-session segment memory")
    _offline_docs(app)
    _playground(app)
    errors.install(app)
    for module in (health, completions, sessions, ws):
        app.include_router(module.router)

    app.add_middleware(CountRequests, runtime_of=lambda: getattr(app.state, "runtime", None))
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    return app
