"""POST /v1/completions: OpenAI's legacy completions, plain or streamed as SSE."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from model.engine import TokenEvent
from server.completion import Completion, cancel_on_disconnect, events, off_loop, open_run, prompt_text
from server.deps import owner, request_fields, runtime
from server.errors import stream_error
from server.protocol import CompletionRequest
from server.runtime import Runtime
from server.scheduler import PromptScores
from server.service import Final, Run
from txlserve.errors import RequestCancelled, UnsupportedEndpoint

router = APIRouter()


def _dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _sse(obj: object) -> str:
    return f"data: {_dumps(obj)}\n\n"


@router.api_route("/v1/chat/completions", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
async def chat_completions(_owner: str | None = Depends(owner)) -> None:  # a key first, as on every /v1 route
    raise UnsupportedEndpoint("this is not a chat model and thus not supported in the v1/chat/completions "
                              "endpoint: txlserve serves a base language model, use v1/completions with a prompt",
                              param="model")


@router.post("/v1/completions", response_model=None)
async def create_completion(req: CompletionRequest, request: Request, rt: Runtime = Depends(runtime),
                            who: str | None = Depends(owner)) -> Response:
    t0 = time.monotonic()
    comp = Completion.of(rt, req)
    if req.echo:
        comp.echoed = comp.text = await prompt_text(rt, req)
    left: list[bool] = []

    def disconnected() -> None:
        rt.metrics.disconnects.inc()
        left.append(True)

    async with cancel_on_disconnect(request.receive, disconnected) as attach:
        run, first = await open_run(rt, req, who, attach)
        comp.prev = run.ids[-1] if run.ids else None
        if not req.stream:
            async for item in events(run, first, t0):
                if isinstance(item, TokenEvent):
                    comp.add(item)
                elif isinstance(item, str):
                    comp.add_text(item)
                elif isinstance(item, PromptScores):
                    await off_loop(len(item), comp.add_prompt, run.ids, item)
                else:
                    _log_fields(run, item, request)
                    # a client that left got nothing: logged and counted as nginx counts it (it was a 200)
                    body = await off_loop(len(comp.tokens) if req.logprobs is not None else 0, comp.body_json, item,
                                          len(run.ids))
                    return Response(body, media_type="application/json",
                                    status_code=RequestCancelled.status if left else 200)
    return StreamingResponse(_stream(rt, run, first, comp, t0, request), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream(rt: Runtime, run: Run, first: object, comp: Completion, t0: float,
                  request: Request) -> AsyncIterator[str]:
    """The SSE body. Every token is its own event, but the events of tokens already waiting when one is read (a
    group of ``--stream-interval``, or a stream whose event loop fell behind) leave in one write, and the last
    token with the end: on a VM a socket write and its trip through the ASGI layers cost the event loop ~40 us."""
    options = comp.req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and options.continuous_usage_stats  # vLLM's: each chunk with the usage so far
    finished = False
    streamed = 0
    out: list[str] = []  # events not yet written: written once nothing else is waiting

    def so_far() -> dict[str, int] | None:
        return comp.usage_so_far(len(run.ids), streamed) if continuous else None
    try:
        try:
            if comp.req.echo and comp.echoed and run.prompt_logprobs is None:
                yield _sse(comp.piece(comp.echoed, usage=so_far()))
            async for item in events(run, first, t0):
                if isinstance(item, PromptScores):  # echo with logprobs: the prompt and its scores come first
                    event = await off_loop(len(item), comp.prompt_piece, run.ids, item, _dumps, usage=so_far())
                    yield f"data: {event}\n\n"
                    continue
                if isinstance(item, TokenEvent):
                    streamed += 1
                    logprobs = comp.add(item)
                    if logprobs is not None or (continuous and item.text):
                        out.append(_sse(comp.piece(item.text, None, logprobs, usage=so_far())))
                    elif item.text:
                        out.append(comp.text_event(item.text))
                    if out and item.finish_reason is None and run.events.empty():  # the last waits for the end
                        yield "".join(out)
                        out.clear()
                    continue
                if isinstance(item, str):  # held back until the run was cancelled
                    comp.add_text(item)
                    out.append(_sse(comp.piece(item, usage=so_far())) if continuous else comp.text_event(item))
                    continue
                usage = comp.usage(item, len(run.ids)).model_dump() if continuous else None
                out.append(_sse(comp.piece("", comp.finish(item), session=comp.session(item), usage=usage)))
                if include_usage:
                    out.append(_sse(comp.usage_chunk(item, len(run.ids)).dump()))
                _log_fields(run, item, request)
        except Exception as err:  # mid-stream: the tokens read so far, an error event, then [DONE]
            event = stream_error(err)
            out.append(_sse(event))
            finished = True
            # its log line (a 200: the stream had begun) says what the client got and how it ended
            request_fields(request.scope).update(prompt_tokens=len(run.ids), completion_tokens=streamed,
                                                 session_id=run.session_id, error=event["error"]["code"],
                                                 error_status=event["status"])
        yield "".join(out) + "data: [DONE]\n\n"  # a client that leaves before this write did not get the end
        finished = True
    finally:
        if not finished:  # the client went away (cancelled, or the generator closed at a yield)
            rt.metrics.disconnects.inc()
            run.cancel()  # its log line is written now, so it says what the client got
            request_fields(request.scope).update(prompt_tokens=len(run.ids), completion_tokens=streamed,
                                                 finish_reason="cancelled", session_id=run.session_id)


def _log_fields(run: Run, final: Final, request: Request) -> None:
    """What the request's log line says of it (its metrics are the run's and events')."""
    request_fields(request.scope).update(
        prompt_tokens=len(run.ids), completion_tokens=final.done.completion_tokens,
        cached_tokens=final.cached_tokens, finish_reason=final.done.finish_reason,
        session_id=final.info.session_id if final.info else None, restored_from=final.source)
