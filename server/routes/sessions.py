"""The sessions API: create, inspect, list, update metadata, delete, append a document, fork."""

from __future__ import annotations

import logging
import math
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from memory_store import SessionInfo
from server.completion import (
    body_bytes,
    cancel_on_disconnect,
    check_logprobs_values,
    off_loop,
    prompt_ids,
    prompt_logprobs,
)
from server.deps import owner, request_fields, runtime
from server.protocol import (
    METADATA_KEYS,
    AppendResult,
    SessionAppend,
    SessionCreate,
    SessionExport,
    SessionFork,
    SessionList,
    SessionObject,
    SessionUpdate,
)
from server.runtime import Runtime
from server.scheduler import PromptScores
from server.service import Final, Run, first_item, settled
from txlserve.errors import InvalidRequestError, SessionIncompatible

router = APIRouter(prefix="/v1/sessions")
# The last tokens of an imported window a session keeps, at least this model's window: longer than any model's here
# (the published WikiText-103 model's is 28,801), so that the model that wrote a document can still rebuild it after
# it passed through a model that reads less; bounded (128 KB as stored), as a session's memory is.
IMPORT_WINDOW_TOKENS = 1 << 15
log = logging.getLogger("txlserve.sessions")


def session_object(rt: Runtime, info: SessionInfo) -> SessionObject:
    tier = "hot" if rt.hot.revision(info.session_id) == info.revision else "cold" if info.tier == "cold" else "redis"
    return SessionObject(id=info.session_id, model=rt.settings.model_name, tokens_seen=info.tokens_seen,
                         mem_len=info.mem_len, bytes=info.bytes, tier=tier, window_tokens=info.window_tokens,
                         created_at=int(info.created_at), last_used_at=int(info.updated_at),
                         metadata=info.metadata or {})


async def _final(request: Request, run: Run) -> Final:
    """The run's Final (its PromptScores, when asked for, kept on ``run.scores``)."""
    async with cancel_on_disconnect(request.receive) as attach:
        attach(run)
        item = await first_item(run)
        while not isinstance(item, Final):
            if isinstance(item, PromptScores):
                run.scores = item
            item = await first_item(run)
    request_fields(request.scope).update(prompt_tokens=len(run.ids), cached_tokens=item.cached_tokens,
                                         session_id=item.info.session_id if item.info else None,
                                         restored_from=item.source)
    return item


@router.post("", status_code=201, response_model=AppendResult)
async def create_session(request: Request, body: SessionCreate | None = None, rt: Runtime = Depends(runtime),
                         who: str | None = Depends(owner)) -> AppendResult:
    body = body or SessionCreate()
    ids = await prompt_ids(rt, body.text, rt.settings.max_append_bytes, param="text")
    final = await _final(request, Run(rt, ids=ids, params=None, owner=who, create=True,
                                      create_metadata=body.metadata))
    return _appended(rt, final, len(ids))


@router.get("", response_model=SessionList)
async def list_sessions(request: Request, limit: int = Query(20, ge=1, le=100),
                        after: str | None = Query(None, max_length=200),
                        order: Literal["asc", "desc"] = Query("asc", description="by creation: asc, oldest first "
                                                              "(the default), or desc, newest first, as OpenAI's "
                                                              "lists take it"),
                        rt: Runtime = Depends(runtime), who: str | None = Depends(owner)) -> SessionList:
    unknown = sorted(set(request.query_params) - {"limit", "after", "order"})
    if unknown:  # a pager that sends ?cursor= would get the first page for ever
        raise InvalidRequestError(f"unknown query parameter {unknown[0]!r}: pages are asked for with 'limit', "
                                  "'after' (the previous page's next_cursor) and 'order'", param=unknown[0])
    infos, cursor = await rt.store.list(owner=who, limit=limit, after=after, order=order)
    return SessionList(data=[session_object(rt, i) for i in infos], has_more=cursor is not None, next_cursor=cursor)


@router.api_route("/import", methods=["GET", "DELETE"], include_in_schema=False)
async def import_wrong_method() -> None:
    """``/import`` names no session (no id is that word): a GET or DELETE there matched ``/{session_id}``, a 404
    "session 'import' not found" where every other wrong method is a 405 (found by a helper)."""
    raise StarletteHTTPException(405, headers={"Allow": "POST"})


@router.get("/{session_id}", response_model=SessionObject)
async def get_session(session_id: str, rt: Runtime = Depends(runtime),
                      who: str | None = Depends(owner)) -> SessionObject:
    await settled(rt, session_id)
    return session_object(rt, await rt.store.info(session_id, owner=who))


@router.delete("/{session_id}")
async def delete_session(session_id: str, rt: Runtime = Depends(runtime), who: str | None = Depends(owner)) -> dict:
    await rt.store.delete(session_id, owner=who)
    rt.hot.deleted(session_id)
    for run in list(rt.runs):  # a request running on it here stops within a step, and ends with a 404
        if run.session_id == session_id and run.owner == who:
            run.lease_lost(deleted=True)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@router.post("/{session_id}/append", response_model=AppendResult)
async def append(session_id: str, body: SessionAppend, request: Request, rt: Runtime = Depends(runtime),
                 who: str | None = Depends(owner)) -> AppendResult:
    ids = await prompt_ids(rt, body.text, rt.settings.max_append_bytes, param="text")
    check_logprobs_values(rt, len(ids), body.logprobs)
    run = Run(rt, ids=ids, params=None, owner=who, session_id=session_id,
              prompt_logprobs=body.logprobs if ids else None)
    final = await _final(request, run)
    rows = len(ids) if body.logprobs is not None else 0
    return Response(await off_loop(rows, _appended_json, rt, final, len(ids), run, body.text),
                    media_type="application/json")


@router.get("/{session_id}/export", response_model=SessionExport)
async def export_session(session_id: str, rt: Runtime = Depends(runtime),
                         who: str | None = Depends(owner)) -> SessionExport:
    """llama.cpp's slot save, made portable: the session's last tokens, not its hidden states, so that any
    server with the same tokenizer (another replica, cluster or checkpoint) can recreate it."""
    await settled(rt, session_id)
    info, window = await rt.store.window(session_id, owner=who)
    if window is None:
        raise SessionIncompatible(f"session {session_id!r} was stored before sessions kept their token window; "
                                  "it cannot be exported until it has read another "
                                  f"{rt.engine.window_len} tokens", param="session_id")
    if not info.tokenizer and info.fingerprint != rt.engine.fingerprint:  # written before headers named it
        raise SessionIncompatible(f"session {session_id!r} was written by another model before sessions named "
                                  "their tokenizer: its window cannot be read here", param="session_id")
    return SessionExport(tokenizer=info.tokenizer or rt.engine.tokenizer_id, tokens_seen=info.tokens_seen,
                         window=window, metadata=info.metadata or {},
                         model=rt.settings.model_name, created_at=int(info.created_at))


@router.post("/import", status_code=201, response_model=AppendResult)
async def import_session(request: Request, body: SessionExport, rt: Runtime = Depends(runtime),
                         who: str | None = Depends(owner)) -> AppendResult:
    """A new session (new id, the caller's) rebuilt from an exported document."""
    if body.tokenizer != rt.engine.tokenizer_id:
        raise SessionIncompatible(f"the session was written under tokenizer {body.tokenizer!r}; this server reads "
                                  f"text with {rt.engine.tokenizer_id!r}", param="tokenizer")
    window = body.window[-max(rt.engine.window_len, IMPORT_WINDOW_TOKENS):]
    try:
        rt.engine.check_window(window, body.tokens_seen, every_id=True)  # why this model cannot rebuild it, if so
    except SessionIncompatible as err:  # a window too short for this model: the body's window, named
        raise SessionIncompatible(err.message, param=err.param or "window") from None
    if len(body.window) < min(body.tokens_seen, rt.engine.window_len):
        log.info("importing a session whose window (%d tokens) is shorter than this model's (%d): rebuilt from "
                 "what it holds", len(body.window), rt.engine.window_len)
    final = await _final(request, Run(rt, ids=[], params=None, owner=who, create=True,
                                      create_metadata=body.metadata, history=(window, body.tokens_seen)))
    return _appended(rt, final, 0)


@router.post("/{session_id}/fork", status_code=201, response_model=SessionObject)
async def fork(session_id: str, body: SessionFork | None = None, rt: Runtime = Depends(runtime),
               who: str | None = Depends(owner)) -> SessionObject:
    await settled(rt, session_id)
    info = await rt.store.fork(session_id, owner=who, metadata=(body.metadata if body else None))
    return session_object(rt, info)


@router.post("/{session_id}", response_model=SessionObject)
async def update_session(session_id: str, body: SessionUpdate | None = None, rt: Runtime = Depends(runtime),
                         who: str | None = Depends(owner)) -> SessionObject:
    """OpenAI's modify (``POST /v1/threads/{id}``): only the metadata changes, key by key (a null removes one);
    the memory is untouched. A request whose client has left is waited for while it commits, as a read waits; one
    still generating makes this a 409, since its commit writes back the metadata it started with."""
    await settled(rt, session_id)
    if body is None or body.metadata is None:
        info = await rt.store.info(session_id, owner=who)
    else:
        info = await rt.store.update_metadata(session_id, body.metadata, owner=who, max_keys=METADATA_KEYS)
    return session_object(rt, info)


def _appended(rt: Runtime, final: Final, n: int, run: Run | None = None, text: str | None = None) -> AppendResult:
    score = final.done.score
    scores = None if run is None else run.scores
    logprobs = None if scores is None else prompt_logprobs(rt.engine.tokenizer, run.ids, scores, text)
    base = session_object(rt, final.info).model_dump()
    has = score is not None and score.tokens > 0
    return AppendResult(**base, appended_tokens=n, rebuilt=final.source == "rebuild",
                        logprob=_finite(score.logprob) if has else None, bpc=_finite(score.bpc) if has else None,
                        perplexity=_finite(score.perplexity) if has else None, logprobs=logprobs)


def _appended_json(rt: Runtime, final: Final, n: int, run: Run, text: str) -> bytes:
    """An append's body (``body_bytes``: a long document's logprobs rendered in parts); call it through
    ``off_loop``."""
    result = _appended(rt, final, n, run, text)
    return body_bytes(lambda: result.model_dump_json().encode(), result.logprobs,
                      lambda empty: setattr(result, "logprobs", empty))


def _finite(x: float) -> float | None:
    """JSON has no infinity: a text the model finds impossible (perplexity past float range) reads as null."""
    return x if math.isfinite(x) else None

