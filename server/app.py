"""``build_app(settings) -> FastAPI``: the model and the store open in ``lifespan``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import errors
from server.errors import error_body
from server.routes import completions, health, sessions, ws
from server.runtime import Runtime, close_runtime, open_runtime
from server.settings import Settings


class BodyLimit:
    """413 for bodies over the limit, counted as they arrive (Content-Length may be absent or lie).

    Past the limit the client gets its 413 at once and the app sees the client gone, so no
    framework layer can turn the refusal into another status."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _too_large(send, self.limit)
        seen, started, refused = 0, False, False

        async def counted() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.limit and not started:
                refused = True
                await _too_large(send, self.limit)
                return {"type": "http.disconnect"}
            return msg

        async def guarded(msg: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 has been sent; whatever the app says next goes nowhere
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        await self.app(scope, counted, guarded)


async def _too_large(send: Send, limit: int) -> None:
    import json

    body = json.dumps(error_body(f"request body exceeds {limit} bytes", "invalid_request_error", None,
                                 "payload_too_large")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


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

    app = FastAPI(title="txlserve", version="0.1.0", lifespan=lifespan,
                  description="Transformer-XL inference with persistent per-session segment memory")
    errors.install(app)
    for module in (health, completions, sessions, ws):
        app.include_router(module.router)

    @app.middleware("http")
    async def count_requests(request, call_next):
        t0 = time.monotonic()
        response = await call_next(request)
        route = request.scope.get("route")
        rt = getattr(app.state, "runtime", None)
        if rt is not None:
            rt.metrics.requests.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        response.headers.setdefault("x-process-time-ms", f"{1000 * (time.monotonic() - t0):.1f}")
        return response

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    return app
