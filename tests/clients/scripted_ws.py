"""A small scripted WebSocket server on a real socket, for what the live server cannot be made to do on cue: answer
a cancel late, send a message of an earlier completion, or cut a connection after reading a request."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import websockets.asyncio.server
import websockets.exceptions

DONE = {"finish_reason": "length", "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

Handler = Callable[[websockets.asyncio.server.ServerConnection], Awaitable[None]]


class ScriptedWebSocket:
    """Runs ``handler`` for each connection, on its own event loop in a thread; counts the connections that ended
    (the client closed them, or the handler returned), so that a test can wait for one, bounded."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.ended = 0
        self._changed = threading.Condition()
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Future[None] | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)
        self.url = ""

    async def _serve(self) -> None:
        self._stop = self._loop.create_future()
        async with websockets.asyncio.server.serve(self._run, "127.0.0.1", 0) as server:
            self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            self._ready.set()
            await self._stop

    async def _run(self, ws: websockets.asyncio.server.ServerConnection) -> None:
        try:
            await self.handler(ws)
            await ws.wait_closed()
        except websockets.exceptions.ConnectionClosed:
            pass
        finally:
            with self._changed:
                self.ended += 1
                self._changed.notify_all()

    def wait_ended(self, count: int, timeout: float = 10) -> bool:
        """Whether ``count`` connections have ended within ``timeout`` s."""
        with self._changed:
            return self._changed.wait_for(lambda: self.ended >= count, timeout)

    def __enter__(self) -> ScriptedWebSocket:
        self._thread.start()
        assert self._ready.wait(10), "the scripted WebSocket server did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        self._loop.call_soon_threadsafe(self._stop.set_result, None)
        self._thread.join(10)
        assert not self._thread.is_alive(), "the scripted WebSocket server did not stop"
        self._loop.close()
