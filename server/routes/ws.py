"""GET /v1/ws: completions over a WebSocket, many in turn on one connection, with cancel.

Client -> server: {"type": "completion.create", ...the /v1/completions fields} | {"type": "cancel", "id"?}
Server -> client: {"type": "completion.delta", "id", "text", "logprobs"?} ... (the tokens already waiting as one is
read leave with it, in one delta: :class:`Deltas`) then
{"type": "completion.done", "id", "text", "finish_reason", "usage", "session"?} or {"type": "error", "id", "error"}.
An error without an id answers the message just sent (refused before any request started, or while one runs) and
ends nothing that runs. After a cancel, messages wait until the cancelled request has ended. As the server drains
(SIGTERM), an idle socket closes at once with 1012 ("service restart"), one that streams once its completion ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from model.engine import TokenEvent
from server.completion import Completion, Deltas, choices, events, launch, off_loop, the_prompts
from server.deps import ws_owner, ws_subprotocol
from server.errors import classify, error_body, stream_error, unreadable_json, validation_message
from server.protocol import CompletionRequest
from server.scheduler import PromptScores
from txlserve.errors import InvalidRequestError, RouteNotFound, UpgradeRequired

router = APIRouter()


def _dumps(obj: object) -> str:
    """JSON as starlette's ``send_json`` writes it, for a message rendered off the event loop."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _delta(comp: Completion, *args: Any) -> str:
    """A ``completion.delta`` message (``Completion.delta``'s arguments), as ``send_json`` writes it."""
    return _dumps(comp.delta(*args).dump())


def _done(comp: Completion, *args: Any) -> str:
    """A ``completion.done`` message (``Completion.done``'s arguments), as ``send_json`` writes it."""
    return _dumps(comp.done(*args).dump())


async def send_deltas(ws: WebSocket, comp: Completion, unsent: Deltas) -> None:
    """One ``completion.delta`` of the tokens read and not yet sent (none for tokens that released no text yet)."""
    rows = comp.prompt_rows() + unsent.rows  # (logprobs, a first delta's prompt ids: rendered off the loop)
    if (taken := unsent.pop()) is not None:
        await ws.send_text(await off_loop(rows, _delta, comp, *taken))


def _invalid(message: str, param: str | None = None) -> dict:
    return {"type": "error", **error_body(message, "invalid_request_error", param, "invalid_value"), "status": 400}


INBOX_FRAMES = 16  # frames read ahead of the connection's handler; past them the socket is not read


class Inbox:
    """A connection's frames in the order they came; None once it ended. A frame that a request took from it
    as its stream ended, and did not answer, goes back in first (:meth:`put_back`): at the end it would follow
    frames the client sent after it, and be answered out of order. At most INBOX_FRAMES wait: a client that
    sent without reading grew the server's memory without bound (1 GB in 2.5 s, found by a helper); past them
    :meth:`put` waits, the socket is not read, and TCP holds the client back. The end always gets in."""

    def __init__(self) -> None:
        self._frames: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        self._back: deque[str | bytes | None] = deque()
        self._room = asyncio.Semaphore(INBOX_FRAMES)

    async def put(self, frame: str | bytes) -> None:
        await self._room.acquire()
        self._frames.put_nowait(frame)

    def end(self) -> None:
        self._frames.put_nowait(None)

    def put_back(self, frame: str | bytes | None) -> None:
        self._back.appendleft(frame)

    async def get(self) -> str | bytes | None:
        if self._back:
            return self._back.popleft()
        frame = await self._frames.get()
        if frame is not None:
            self._room.release()
        return frame


async def refuse(ws: WebSocket, err: Exception) -> None:
    """Refuse a handshake: an HTTP answer in OpenAI's shape where the server can send one."""
    status, body = classify(err)
    try:
        await ws.send_denial_response(JSONResponse(body, status_code=status))
    except RuntimeError:  # no denial-response extension: close with "policy violation"
        await ws.close(code=1008, reason=str(err)[:120])


@router.websocket("/v1/ws")
async def completions_ws(ws: WebSocket) -> None:
    try:  # a page of another origin was refused before (server/browsers.py)
        who = ws_owner(ws)
    except Exception as err:  # a 401
        await refuse(ws, err)
        return
    await ws.accept(subprotocol=ws_subprotocol(ws))
    inbox = Inbox()

    async def reader() -> None:
        """Every frame goes to the inbox (binary ones as bytes); None, always, once the connection ends."""
        try:
            while (frame := await ws.receive())["type"] == "websocket.receive":
                await inbox.put(frame["text"] if frame.get("text") is not None else frame.get("bytes") or b"")
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            inbox.end()

    reading = asyncio.create_task(reader())
    rt = ws.app.state.runtime
    rt.metrics.websockets.inc()
    draining = asyncio.ensure_future(rt.drain_started.wait())
    frame: asyncio.Future | None = None
    try:
        while True:
            frame = asyncio.ensure_future(inbox.get())
            await asyncio.wait({frame, draining}, return_when=asyncio.FIRST_COMPLETED)
            if draining.done():  # the server drains: an idle socket closes now, one that streamed once its
                frame.cancel()  # completion has ended ("service restart"; the server's shutdown waits for those)
                with contextlib.suppress(RuntimeError, WebSocketDisconnect):  # the client closed it meanwhile
                    await ws.close(code=1012)
                break
            if (raw := frame.result()) is None:
                break
            try:
                await _handle(ws, raw, inbox, who)
            except WebSocketDisconnect:  # the client left as its message was answered (a send raises it)
                break
    finally:
        for pending in (draining, frame, reading):
            if pending is not None:
                pending.cancel()
        rt.metrics.websockets.dec()


def _parse(raw: str | bytes) -> tuple[dict | None, dict | None]:
    """(message, None), or (None, the error event that answers a frame that is no JSON object)."""
    if isinstance(raw, bytes):
        return None, _invalid("binary frames are not supported: send each message as a JSON text frame")
    try:
        msg = json.loads(raw)
    except (ValueError, RecursionError) as err:  # a syntax error, an integer past 4,300 digits, nesting too deep
        return None, _invalid(f"messages must be JSON objects, and this one could not be read: {unreadable_json(err)}")
    if not isinstance(msg, dict):
        return None, _invalid("messages must be JSON objects")
    return msg, None


async def _handle(ws: WebSocket, raw: str | bytes, inbox: Inbox, who: str | None) -> None:
    since = time.monotonic()  # the request's arrival, for its time to first token
    msg, error = _parse(raw)
    if msg is None:
        await ws.send_json(error)
        return
    kind = msg.pop("type", None)
    if kind == "cancel":
        return  # nothing running: a late cancel is harmless
    if kind != "completion.create":
        said = "no \"type\"" if kind is None else f"unknown message type {json.dumps(kind)}"
        await ws.send_json(_invalid(f"{said}: a message's type is \"completion.create\" or \"cancel\"", "type"))
        return
    rt = ws.app.state.runtime
    try:
        req = CompletionRequest.model_validate({"stream": True, **msg})  # a bad ``stream`` is refused as over HTTP
        # refused as a request's own checks are over HTTP (InvalidRequestError: the same code), below
        if req.stream is not True:
            raise InvalidRequestError("a WebSocket completion always streams: leave stream out or set it true",
                                      param="stream")
        if req.request_id is not None:  # a reused one would let a late cancel stop the next completion
            raise InvalidRequestError("request_id names an HTTP completion; a WebSocket's completions are named by "
                                      "the server, as its cancels name them", param="request_id")
        options = req.stream_options  # include_usage alone changes nothing here: completion.done has the usage
        if options is not None and options.include_usage and options.continuous_usage_stats:
            raise InvalidRequestError("stream_options.continuous_usage_stats is for SSE streams; a WebSocket's "
                                      "completion.done carries the usage", param="stream_options")
        if (req.n or 1) > 1 or len(the_prompts(req)) > 1:  # n 0 and below: refused as over HTTP
            raise InvalidRequestError("a WebSocket completion has one choice: send one prompt with n 1 (a list of "
                                      "prompts, or n above 1, over HTTP)", param="n" if (req.n or 1) > 1 else "prompt")
        chosen = await choices(rt, req)
        comp = Completion.of(rt, req, chosen[0])
        run = launch(rt, req, chosen[0], who)
    except ValidationError as err:
        await ws.send_json(_invalid(*validation_message(err)))
        return
    except Exception as err:
        await ws.send_json({"type": "error", **stream_error(err)})
        return
    echo = req.echo and run.prompt_logprobs is None and bool(comp.echoed)  # sent with the first event, not before
    unsent = Deltas(bool(comp.req.return_token_ids))
    answered = False
    streaming = asyncio.get_running_loop().create_future()  # until its last message is sent: the drain waits
    rt.ws_streams.add(streaming)
    # the inbox is read from the start: a cancel (or a client that leaves) while the prompt is being read stops
    # it there, and nothing is stored, as over HTTP
    stream = events(run, None, since).__aiter__()  # from its first event on
    next_item = asyncio.ensure_future(stream.__anext__())
    next_msg: asyncio.Future | None = asyncio.ensure_future(inbox.get())
    try:
        while True:
            waiting = {next_item} if next_msg is None else {next_item, next_msg}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if next_msg in done:
                incoming = next_msg.result()
                if incoming is None:  # the client left: stop within a step, commit what was generated
                    rt.metrics.disconnects.inc()
                    run.cancel()
                    inbox.put_back(None)
                    next_msg = None
                    return
                msg, error = _parse(incoming)
                if msg is not None and msg.get("type") == "cancel" and msg.get("id") not in (None, comp.id):
                    next_msg = asyncio.ensure_future(inbox.get())  # a cancel of another (earlier) completion
                    continue
                if msg is not None and msg.get("type") == "cancel":
                    # it ends within a step; what the client sends next (its next request, sent at once) waits its
                    # turn in the inbox, where it was refused as "in progress" before
                    run.cancel()
                    next_msg = None
                    continue
                await send_deltas(ws, comp, unsent)  # the tokens read before the refused message came
                await ws.send_json(error or _invalid("a completion is in progress: send 'cancel' or wait", "type"))
                next_msg = asyncio.ensure_future(inbox.get())
                continue
            try:
                item = next_item.result()
            except StopAsyncIteration:
                return
            except Exception as err:  # it ends the request: its id tells it from a refusal of a message just sent
                await send_deltas(ws, comp, unsent)  # the tokens read before it
                await ws.send_json({"type": "error", "id": comp.id, **stream_error(err)})
                return
            if not isinstance(item, TokenEvent):
                await send_deltas(ws, comp, unsent)
            if echo:
                await ws.send_text(await off_loop(comp.prompt_rows(), _delta, comp, comp.echoed, None))
                echo = False
            if isinstance(item, PromptScores):  # echo with logprobs: the prompt and its scores first
                await ws.send_text(await off_loop(len(item), comp.prompt_piece, run.ids, item, _dumps,
                                                  delta=True))
            elif isinstance(item, TokenEvent):
                unsent.add(item, comp.add(item))
                if item.finish_reason is None and run.events.qsize() and not unsent.full():
                    next_item = asyncio.ensure_future(stream.__anext__())  # more are ready: they leave with it
                    continue
                await send_deltas(ws, comp, unsent)
            elif isinstance(item, str):  # held back until the run was cancelled: it leaves before the end
                comp.add_text(item)
                unsent.add_text(item)
            else:  # the Final is the run's last item: the next message is the next request's, never "in progress"
                await ws.send_text(await off_loop(comp.prompt_rows(), _done, comp, item, len(run.ids)))  # (a client
                # that sends it as soon as it
                answered = True  # reads this could otherwise be seen before the stream's end, and refused)
                return
            next_item = asyncio.ensure_future(stream.__anext__())
    finally:
        rt.ws_streams.discard(streaming)
        streaming.set_result(None)
        if not answered:  # cancelled, failed, or the socket broke under a send: stop within a step
            run.cancel()
        next_item.cancel()
        if next_msg is not None and not next_msg.done():
            next_msg.cancel()
        elif next_msg is not None and not next_msg.cancelled():
            inbox.put_back(next_msg.result())  # not ours to answer: the connection's next frame, as it came


@router.get("/v1/ws", include_in_schema=False)
async def ws_over_http() -> None:
    """Plain HTTP to the WebSocket route: a 426 that says so, not a 404 for a route that exists."""
    raise UpgradeRequired("/v1/ws is a WebSocket endpoint: open it with a WebSocket client (ws://host/v1/ws), "
                          "not a plain HTTP request")


@router.websocket("/{path:path}")  # the last route: Starlette refused any other path with a bare 403
async def no_such_ws_route(ws: WebSocket) -> None:
    await refuse(ws, RouteNotFound(f"no such WebSocket route: {ws.url.path} (completions stream over /v1/ws)"))


def http_only(app: ASGIApp) -> ASGIApp:
    """A mount (static files) that serves HTTP alone: a mount takes WebSockets to its paths too, and static files
    failed them (a bare 403)."""
    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            return await no_such_ws_route(WebSocket(scope, receive, send))
        await app(scope, receive, send)
    return serve
