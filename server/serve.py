"""Run the app under uvicorn with a graceful SIGTERM: /ready turns 503 at once, in-flight
requests get ``shutdown_timeout_s`` to finish, then are cancelled and committed."""

from __future__ import annotations

import uvicorn

from server.app import build_app
from server.settings import Settings


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: object) -> None:
        rt = getattr(self.config.app.state, "runtime", None)
        if rt is not None:
            rt.ready, rt.draining = False, True
        super().handle_exit(sig, frame)


def serve(settings: Settings) -> int:
    app = build_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=int(settings.shutdown_timeout_s))
    _Server(config).run()
    return 0
