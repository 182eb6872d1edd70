"""POST /v1/completions: OpenAI's legacy completions, plain or streamed as SSE."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse

from model.engine import TokenEvent
from server.completion import (
    Completion,
    Deltas,
    Interleaved,
    body_rows,
    cancel_on_disconnect,
    choices,
    collect,
    completion_json,
    off_loop,
    open_runs,
    prompt_tokens,
)
from server.deps import owner, request_fields, runtime
from server.errors import stream_error
from server.protocol import CompletionObject, CompletionRequest
from server.runtime import Runtime
from server.scheduler import PromptScores
from server.service import Final
from txlserve.errors import RequestCancelled, UnsupportedEndpoint

router = APIRouter()


def _dumps(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _piece(comp: Completion, *args: Any, **kwargs: Any) -> str:
    """A chunk's SSE event (``Completion.piece``'s arguments)."""
    return _sse(comp.piece(*args, **kwargs))


def _sse(obj: object) -> str:
    return f"data: {_dumps(obj)}\n\n"


@router.api_route("/v1/chat/completions", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
async def chat_completions(_owner: str | None = Depends(owner)) -> None:  # a key first, as on every /v1 route
    raise UnsupportedEndpoint("this is not a chat model and thus not supported in the v1/chat/completions "
                              "endpoint: txlserve serves a base language model, use v1/completions with a prompt",
                              param="model")


@router.post("/v1/completions", response_model=None, responses={200: {
    "model": CompletionObject,  # the document had none: a generated client (and the docs' example) read "string"
    "description": "the completion; with stream, server-sent events: `data: ` and a chunk of this shape (its "
                   "choices' text the new text alone), then `data: [DONE]`",
    "content": {"text/event-stream": {"schema": {"type": "string"}}}}})
async def create_completion(req: CompletionRequest, request: Request, rt: Runtime = Depends(runtime),
                            who: str | None = Depends(owner)) -> Response:
    t0 = time.monotonic()
    chosen = await choices(rt, req)
    prompted = prompt_tokens(chosen)
    if len(chosen) > 1:
        request_fields(request.scope)["choices"] = len(chosen)
    comps = [Completion.of(rt, req, chosen[0])]
    comps += [Completion.of(rt, req, choice, comps[0]) for choice in chosen[1:]]
    left: list[bool] = []

    def disconnected() -> None:
        rt.metrics.disconnects.inc()
        left.append(True)

    async with cancel_on_disconnect(request.receive, disconnected) as attach:
        opened = await open_runs(rt, req, chosen, who, attach)
        if not req.stream:
            runs = [run for run, _ in opened]
            if len(runs) == 1:
                finals = [await collect(comps[0], runs[0], opened[0][1], t0)]
            else:
                tasks = [asyncio.create_task(collect(comp, run, first, t0))
                         for comp, (run, first) in zip(comps, opened)]
                try:
                    finals = await asyncio.gather(*tasks)
                except BaseException:  # one failed (or the handler was cancelled): the others end with it
                    for run, task in zip(runs, tasks):
                        run.cancel()
                        task.cancel()
                    raise
            _log_fields(request, prompted, finals)
            # a client that left got nothing: logged and counted as nginx counts it (it was a 200)
            body = await off_loop(body_rows(req, comps, chosen), completion_json, comps, finals, prompted)
            return Response(body, media_type="application/json",
                            status_code=RequestCancelled.status if left else 200)
    return StreamingResponse(_stream(rt, comps, Interleaved(opened, t0), prompted, request),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream(rt: Runtime, comps: list[Completion], interleaved: Interleaved, prompted: int,
                  request: Request) -> AsyncIterator[str]:
    """The SSE body: each choice's chunks (``index`` tells them apart), in the order their tokens came. The
    tokens of a choice already waiting when one is read (a group of ``--stream-interval``, or a client or event
    loop that fell behind) leave in one chunk (:class:`Deltas`), every choice's waiting chunk in one write, and
    the last token with its end: on a VM a socket write and its trip through the ASGI layers cost the event loop
    ~40 us, and a chunk is ~270 bytes whatever its text."""
    runs, options = interleaved.runs, comps[0].req.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = include_usage and options.continuous_usage_stats  # vLLM's: each chunk with the usage so far
    finished = False
    streamed = [0] * len(comps)
    finals: list[Final | None] = [None] * len(comps)
    unsent = [Deltas(bool(comp.req.return_token_ids)) for comp in comps]
    out: list[str] = []  # events not yet written: written once nothing else is waiting

    def so_far(i: int) -> dict[str, int] | None:
        return comps[i].usage_so_far(len(runs[i].ids), streamed[i]) if continuous else None

    async def chunk(i: int) -> None:
        """Choice ``i``'s waiting tokens, as one event, to ``out``."""
        comp, rows = comps[i], comps[i].prompt_rows() + unsent[i].rows
        if (taken := unsent[i].pop()) is None:  # (a write of another choice's token had sent this one, with none
            return  # yet, an empty chunk of its prompt's ids alone)
        text, logprobs, ids = taken
        if logprobs is not None or (continuous and text) or rows:  # (logprobs, a first chunk's prompt ids: long)
            out.append(await off_loop(rows, _piece, comp, text, None, logprobs, usage=so_far(i), token_ids=ids))
        else:
            out.append(comp.text_event(text, ids))

    async def written() -> str:
        """Every choice's waiting tokens and the events before them, for one write."""
        for i in range(len(comps)):
            await chunk(i)
        text = "".join(out)
        out.clear()
        return text
    try:
        try:
            for i, comp in enumerate(comps):
                if comp.req.echo and comp.echoed and runs[i].prompt_logprobs is None:
                    out.append(await off_loop(comp.prompt_rows(), _piece, comp, comp.echoed, usage=so_far(i)))
            if out:
                yield await written()
            async for i, item in interleaved:
                comp, run = comps[i], runs[i]
                if isinstance(item, PromptScores):  # echo with logprobs: the prompt and its scores come first
                    event = await off_loop(len(item), comp.prompt_piece, run.ids, item, _dumps, usage=so_far(i))
                    yield await written() + f"data: {event}\n\n"  # after the other choices' events read before it
                    continue
                if isinstance(item, TokenEvent):
                    streamed[i] += 1
                    unsent[i].add(item, comp.add(item))
                    if item.finish_reason is not None or unsent[i].full():  # the last waits for the end
                        await chunk(i)
                    elif interleaved.idle() and (text := await written()):
                        yield text
                    continue
                if isinstance(item, str):  # held back until the run was cancelled: it leaves with the end
                    comp.add_text(item)
                    unsent[i].add_text(item)
                    continue
                finals[i] = item
                await chunk(i)
                usage = comp.usage(item, len(run.ids)).model_dump() if continuous else None
                out.append(_sse(comp.piece("", comp.finish(item), session=comp.session(item), usage=usage)))
                if None in finals:  # another choice goes on: this one's end leaves now (the last's with [DONE])
                    if interleaved.idle():
                        yield await written()
                    continue
                ended = [f for f in finals if f is not None]
                if include_usage:
                    out.append(_sse(comps[0].usage_chunk(ended, prompted).dump()))
                _log_fields(request, prompted, ended)
        except Exception as err:  # mid-stream: the tokens read so far, an error event, then [DONE]
            for i in range(len(comps)):
                await chunk(i)
            event = stream_error(err)
            out.append(_sse(event))
            finished = True
            for run in runs:  # the other choices' runs: their client is told the request failed
                run.cancel()
            # its log line (a 200: the stream had begun) says what the client got and how it ended
            request_fields(request.scope).update(prompt_tokens=prompted, completion_tokens=sum(streamed),
                                                 session_id=runs[0].session_id, error=event["error"]["code"],
                                                 error_status=event["status"])
        yield "".join(out) + "data: [DONE]\n\n"  # a client that leaves before this write did not get the end
        finished = True
    finally:
        interleaved.close()
        if not finished:  # the client went away (cancelled, or the generator closed at a yield)
            rt.metrics.disconnects.inc()
            for run in runs:
                run.cancel()  # its log line is written now, so it says what the client got
            request_fields(request.scope).update(prompt_tokens=prompted, completion_tokens=sum(streamed),
                                                 finish_reason="cancelled", session_id=runs[0].session_id)


def _log_fields(request: Request, prompted: int, finals: list[Final]) -> None:
    """What the request's log line says of it (its metrics are the runs' and events'): its first choice's end."""
    first = finals[0]
    request_fields(request.scope).update(
        prompt_tokens=prompted, completion_tokens=sum(f.done.completion_tokens for f in finals),
        cached_tokens=sum(f.cached_tokens for f in finals), finish_reason=first.done.finish_reason,
        session_id=first.info.session_id if first.info else None, restored_from=first.source)
