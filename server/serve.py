"""Run the app under uvicorn with a graceful SIGTERM: /ready turns 503 at once, in-flight
requests get ``shutdown_timeout_s`` to finish, then are cancelled, commit what they
generated and end their streams normally before the connections close."""

from __future__ import annotations

import asyncio

import uvicorn

from server.app import build_app
from server.settings import Settings


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: object) -> None:
        rt = getattr(self.config.app.state, "runtime", None)
        if rt is not None and not rt.draining:
            rt.ready, rt.draining = False, True
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(loop.call_later, rt.settings.shutdown_timeout_s, _cancel_runs, rt)
        super().handle_exit(sig, frame)


def _cancel_runs(rt) -> None:
    for run in list(rt.runs):
        run.cancel()


def serve(settings: Settings) -> int:
    app = build_app(settings)
    # uvicorn's own deadline comes after ours, so cancelled streams can still say goodbye
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 5)
    _Server(config).run()
    return 0
