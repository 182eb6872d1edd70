"""Run the app under uvicorn with a graceful SIGTERM: /ready turns 503 at once, in-flight
requests get ``shutdown_timeout_s`` to finish, then are cancelled, commit what they
generated and end their streams normally before the connections close.

Start-up binds the port first and then loads the model and opens the store, both before
uvicorn runs, so a port in use or a bad checkpoint is one line on stderr, not a
traceback after a long load. The port takes connections only once the server can answer
them: before, a connection is refused (a probe fails at once, as vLLM's does)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import urllib.parse
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import uvicorn

from model.threads import set_threads
from server.app import build_app
from server.browsers import loopback_name
from server.http_protocol import MAX_HEAD_BYTES, SendDeadline, protocol_class, websocket_protocol_class
from server.listen import start_listening
from server.runtime import close_runtime, open_runtime
from server.settings import Settings
from server.workers import share_metrics
from txlserve.errors import ConfigError
from txlserve.signals import STOP_SIGNALS, HeldSignals

log = logging.getLogger("txlserve")
FORCED_CLOSE_S = 5.0  # a second Ctrl-C's bound on closing the engine and the store


def _cancelled_by_the_exit(record: logging.LogRecord) -> bool:
    """False for uvicorn's reports of a task the forced exit cancelled: a request's ("Exception in ASGI
    application", with the exception) and the lifespan's (its traceback as the message)."""
    if record.exc_info and isinstance(record.exc_info[1], (asyncio.CancelledError, KeyboardInterrupt)):
        return False
    text = str(record.msg)
    return not (text.startswith("Traceback") and text.rstrip().endswith("CancelledError"))


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, hold: HeldSignals | None) -> None:
        super().__init__(config)
        self.hold = hold

    def handle_exit(self, sig: int, frame: object) -> None:
        rt = getattr(self.config.app.state, "runtime", None)
        if rt is not None:  # start the one drain now: uvicorn waits for open connections before lifespan ends
            asyncio.get_event_loop().call_soon_threadsafe(rt.drain)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, with the WebSockets held back until the drain's runs end: uvicorn closes every WebSocket at
        once (1012, "service restart"), which cut a completion streaming over one where an SSE stream ran to its
        end. uvicorn's first steps run first, as it takes them: no new connection, and every HTTP connection
        closes once idle (a pooled one at once, so its client goes to another replica). Then the runs finish (or
        are cancelled past ``shutdown_timeout_s``), each WebSocket sends its completion's end and closes itself
        (server/routes/ws.py; an idle one closes as the drain starts), and uvicorn's shutdown goes on."""
        rt = getattr(self.config.app.state, "runtime", None)
        if rt is not None and rt.draining:
            for server in self.servers:  # closing twice (uvicorn's own turn) is harmless, as is a second shutdown
                server.close()
            for connection in list(self.server_state.connections):
                if not isinstance(connection, self.config.ws_protocol_class or ()):  # the WebSocket protocol
                    # uvicorn was given (ours, made of uvicorn's), as it loaded it: held
                    connection.shutdown()
            loop, drain = asyncio.get_running_loop(), rt.drain()
            deadline = loop.time() + rt.settings.shutdown_timeout_s + 11  # the drain's own bound, and its 10 s
            while not (drain.done() and not rt.ws_streams) and not self.force_exit and loop.time() < deadline:
                if drain.done():  # every run has ended: what a client reads nothing of will never be sent
                    self._abort_stalled()
                await asyncio.wait([drain, *rt.ws_streams], timeout=0.1)  # a second Ctrl-C (force_exit) ends it
            self._abort_stalled()
        await super().shutdown(sockets=sockets)
        if self.force_exit:  # a second Ctrl-C: uvicorn skips the app's shutdown, and the tasks left (the lifespan,
            # each request's) are cancelled as the loop closes, each logged as a failure with a traceback
            rt = getattr(self.config.app.state, "runtime", None)
            running = len(rt.runs) if rt is not None else 0
            log.info("stopped at once (a second signal)%s", f": {running} request(s) still running end without "
                     "committing what they generated" if running else "")
            logging.getLogger("uvicorn.error").addFilter(_cancelled_by_the_exit)  # (taken off as serve() returns)
            if rt is not None:  # the engine and the store closed still, within a bound: a wedged engine must not
                try:  # hold a forced exit
                    await asyncio.wait_for(close_runtime(rt, at_once=True), FORCED_CLOSE_S)
                except asyncio.TimeoutError:
                    log.warning("stopping at once: the engine and the store did not close within %g s",
                                FORCED_CLOSE_S)
                except Exception as err:  # noqa: BLE001 (leaving anyway: said in one line, not a traceback)
                    log.warning("stopping at once: closing the engine and the store failed: %s", err)

    def _abort_stalled(self) -> None:
        for connection in list(self.server_state.connections):
            if isinstance(connection, SendDeadline):
                connection.abort_if_stalled()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, except that it puts back the handlers ``_serve``'s hold found, not the holding ones, before
        it raises the signals it caught again, each kind once (uvicorn's: a drained Ctrl-C exits 130, a SIGTERM as
        SIGTERM)."""
        if self.hold is None:  # not the main thread: no signals to take
            with super().capture_signals():
                yield
            return
        for sig in STOP_SIGNALS:
            signal.signal(sig, self.handle_exit)
        try:
            yield
        finally:
            self.hold.release()  # nothing held: from its server's creation on, a signal went to the server
        for sig in dict.fromkeys(reversed(self._captured_signals)):  # each once: a second Ctrl-C (the force
            signal.raise_signal(sig)  # exit) raised again was a KeyboardInterrupt through the clean-up, 4 tracebacks
        if signal.SIGINT in self._captured_signals:  # asyncio's runner has it (it cancels the serving): leaving, a
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C more, as a worker's supervisor passes each on,
            # landed in the runner's or the interpreter's teardown, with tracebacks (and a worker's status 1)


class Redact(logging.Filter):
    """Masks secrets in log records: the values of query parameters named like a secret (``api_key``, ``key``,
    ``token``, ``password``), percent-encoded or not, since Starlette decodes ``api%5Fkey`` as ``api_key``; any
    query value that decodes to a configured key; and the configured keys wherever they appear. Arguments keep
    their places, since uvicorn's access formatter unpacks them."""

    # a value ends where the query does, or the quoted text it stands in: a " followed by a space, a line's end or
    # JSON's , } ] (uvicorn's request line, the request log's JSON). A wrong key holding a ', a # or a " (often a
    # near miss of the real one) was otherwise masked only up to that character
    _PAIR = re.compile(r"([?&])([^=&\s\"'#]+)=((?:[^&\s\"]|\"(?![\s,}\]]|$))*)")
    _SECRET_NAME = re.compile(r"(?i)(?:api[_-]?key|key|token|access[_-]?token|password|passwd|pass|auth)")

    def __init__(self, secrets: tuple[str, ...] = ()) -> None:
        super().__init__()
        # each key as it is, and as uvicorn's request line (percent-encoded) or a JSON log line (escaped) writes it
        # where it stands in a path: a key holding a " or a + showed whole in a 404's lines (found by a helper)
        forms = {form for s in secrets if s for form in (s, urllib.parse.quote(s), urllib.parse.quote(s, safe=""),
                                                          json.dumps(s)[1:-1], json.dumps(s, ensure_ascii=False)[1:-1])}
        self.secrets = tuple(sorted(forms, key=len, reverse=True))  # one inside another

    def _pair(self, m: re.Match) -> str:
        name, value = urllib.parse.unquote(m[2]), urllib.parse.unquote(m[3])
        if self._SECRET_NAME.fullmatch(name) or any(secret in value for secret in self.secrets):
            return f"{m[1]}{m[2]}=***"
        return m[0]

    def redact(self, text: str) -> str:
        for secret in self.secrets:  # first: a key holding a quote or '#' is cut short by the pattern below
            text = text.replace(secret, "***")
        return self._PAIR.sub(self._pair, text)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = self.redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(self.redact(a) if isinstance(a, str) else a for a in record.args)
        if record.exc_info and not record.exc_text:  # a traceback's text, which formatters take from here
            record.exc_text = self.redact(logging.Formatter().formatException(record.exc_info))
        return True


def _not_a_denial(record: logging.LogRecord) -> bool:
    """Drops uvicorn's "ASGI callable returned without completing handshake." Our WebSocket route always
    answers the handshake, by accepting it or with an HTTP denial response (a refused key's 401), and
    uvicorn's sans-I/O implementation logs that error after every denial: one ERROR line per refused key."""
    return record.getMessage() != "ASGI callable returned without completing handshake."


def _no_frames(record: logging.LogRecord) -> bool:
    """Drops the websockets library's DEBUG lines: it logs every frame, a prompt's or a completion's text with
    it, through the logger uvicorn gives it (``uvicorn.error``), so ``--log-level debug`` wrote them all."""
    return record.levelno >= logging.INFO or f"{os.sep}websockets{os.sep}" not in record.pathname


def install_redaction(settings: Settings) -> None:
    redact = Redact(settings.api_keys)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "txlserve", "txlserve.requests", ""):
        logging.getLogger(name).addFilter(redact)
        for handler in logging.getLogger(name).handlers:  # a logger's filters pass over what its children
            handler.addFilter(redact)  # propagate (memory_store.*, redis, asyncio): its handlers' do not
    logging.getLogger("uvicorn.error").addFilter(_not_a_denial)
    logging.getLogger("uvicorn.error").addFilter(_no_frames)
    websockets = logging.getLogger("websockets")  # its own loggers, where it is given none: never below INFO
    websockets.setLevel(max(logging.INFO, logging.getLogger().getEffectiveLevel()))


def freeze_startup_objects() -> int:
    """Move everything start-up made (modules, the model's parameters, the app) out of the garbage collector's
    reach: they live as long as the process, yet every full collection walked them all, holding the GIL for
    160-180 ms on the bundled checkpoint while every stream waited (CPython's ``gc.freeze``, as Instagram's
    servers use it). Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve(settings: Settings, sock: socket.socket, worker: int | None = None, peers: str | None = None) -> int:
    """Run the server until it is stopped, on ``sock``, bound by the caller before anything heavy was imported
    (``server.listen``); the caller closes it. ``worker``: this process's index among ``--workers``; ``peers``:
    the directory where the workers share their metrics."""
    processes = settings.server_processes
    set_threads(settings.threads, processes=processes if processes > 1 else None)  # a worker's share
    # The engine thread, back from a decode step (which runs without the GIL), waits for the interpreter while
    # the event loop holds it, up to Python's 5 ms switch interval: 1.6-2.0 ms a step at 64 streams on the bundled
    # checkpoint, 0.5-1.1 ms at 0.5 (BENCHMARKS.md, "Where 64 streams lose now").
    sys.setswitchinterval(settings.switch_interval_ms / 1000)
    protocol = protocol_class(settings.body_timeout_s, settings.http,  # a missing parser fails before the load
                              send_timeout_s=settings.send_timeout_s)
    settings = dataclasses.replace(settings, port=sock.getsockname()[1])  # --port 0: the one the system chose
    main = threading.current_thread() is threading.main_thread()
    interrupt = signal.getsignal(signal.SIGINT) if main else None
    try:
        return runner(settings.loop)(_serve(settings, sock, protocol, worker, peers))
    finally:  # what a stop set for the process's last moments, put back for a program that runs serve() and goes on
        logging.getLogger("uvicorn.error").removeFilter(_cancelled_by_the_exit)
        if main and signal.getsignal(signal.SIGINT) is signal.SIG_IGN and interrupt is not None:
            signal.signal(signal.SIGINT, interrupt)


def runner(loop: str) -> Callable[[Coroutine[Any, Any, int]], int]:
    """What runs the server's event loop: uvloop's where installed (``auto``, as uvicorn's ``--loop auto``), else
    asyncio's. uvloop's loop is libuv's, in C: with a fast engine it and httptools together raised one stream's
    tokens/s by 22% and 64 streams' by 12% (BENCHMARKS.md, "The server's steps as CUDA graphs")."""
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise ConfigError("loop is uvloop, but uvloop is not installed (pip install uvloop)") from None
        else:
            return uvloop.run
    return asyncio.run


async def _serve(settings: Settings, sock: socket.socket, protocol: type, worker: int | None,
                 peers: str | None) -> int:
    rt = await open_runtime(settings)  # a bad checkpoint or unreachable Redis stops here, as one TxlError
    # From here until uvicorn takes them, SIGINT and SIGTERM are held. Left to asyncio's runner, a Ctrl-C cancelled
    # the task awaiting uvicorn's lifespan start-up, which uvicorn logged with its traceback; a SIGTERM killed the
    # process with the runtime open (its embedded Redis stayed up). Held, either skips the serving: the runtime
    # closes, then the signal acts (Ctrl-C exits 130, SIGTERM as SIGTERM). Once the server exists, it takes them.
    hold = HeldSignals() if threading.current_thread() is threading.main_thread() else None
    shared = None
    try:
        rt.worker, rt.peers = worker, peers
        rt.metrics.live.engine = settings.api_server_count == 1 or not worker  # a shared engine's, counted once
        shared = await share_metrics(rt, peers) if peers else None  # the other workers' /metrics read this one's
        app = build_app(settings, runtime=rt)
        freeze_startup_objects()
        # uvicorn's own deadline comes after ours, so cancelled streams can still say goodbye
        config = uvicorn.Config(app, log_level=settings.log_level, access_log=False,  # RequestLog: one JSON line
                                log_config=None,  # its loggers write through ours (server.logs): time, format
                                timeout_graceful_shutdown=int(settings.shutdown_timeout_s) + 5,
                                http=protocol,  # headers get the body's deadline
                                ws=websocket_protocol_class(settings.send_timeout_s),
                                # a client that pauses reads its pong no sooner than its messages: one paused past
                                # uvicorn's 20 s lost its WebSocket at 40 s, where an SSE stream waits for the send
                                # deadline (found by a helper); a vanished peer is still found within 20 s plus this
                                ws_ping_timeout=max(20.0, settings.send_timeout_s) if settings.send_timeout_s
                                else None,  # (0: never, as the send deadline)
                                h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                                ws_max_size=settings.max_body_bytes)  # a message's limit: a body's (uvicorn: 16 MiB)
        install_redaction(settings)  # after uvicorn configured its loggers
        log.info("event loop: %s; HTTP parser: %s", type(asyncio.get_running_loop()).__module__.split(".")[0],
                 protocol.parser_name)
        if not settings.api_keys and not loopback_name(settings.host):
            log.warning("listening on %s without API keys: anyone who reaches this port can read every session "
                        "(set TXLSERVE_API_KEYS)", settings.host)
        server = _Server(config, hold)
        if hold is not None:
            hold.forward = server.handle_exit  # from here a signal goes to the server; one before, in held, stops it
        if hold is not None and hold.held:
            log.info("stopping before serving (%s)", signal.Signals(hold.held[0]).name)
        else:
            start_listening(sock)  # connections are taken once the server can answer them (server.listen)
            await server.serve(sockets=[sock])
    finally:
        try:
            if shared is not None:
                shared.close()
            await close_runtime(rt)  # already closed by the app's lifespan, unless uvicorn never started it
        finally:
            if hold is not None:  # a second release (the server's capture_signals made one) does nothing
                hold.release()
    return 0
