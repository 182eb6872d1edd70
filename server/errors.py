"""The handlers that answer every error in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
from the one table in :mod:`txlserve.errors` (each class's ``status`` and ``type``), for HTTP and WebSocket alike."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Send

from server.deps import owner, request_fields, takes_key
from txlserve import errors as e

log = logging.getLogger("txlserve")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def classify(err: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and body for any exception; unknown ones are logged and answered without details."""
    if isinstance(err, e.TxlError):
        return err.status, error_body(err.message, err.type, err.param, err.code)
    log.exception("internal error", exc_info=err)
    return e.INTERNAL_STATUS, error_body("internal server error", e.INTERNAL_TYPE, None, e.INTERNAL_CODE)


async def send_error(send: Send, status: int, body: dict[str, Any], *, close: bool = False,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An error answered by plain ASGI middleware, before any route (and so any of the handlers below) ran."""
    data = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *(headers or []),
            *([(b"connection", b"close")] if close else [])]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data})


def stream_error(err: BaseException) -> dict[str, Any]:
    """An error inside a stream (an SSE event, a WebSocket message): the body plus the status the same error
    gets outside a stream, so a client needs no table of its own."""
    status, body = classify(err)
    return {**body, "status": status}


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "bytes"}


def validation_message(err: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """One wording for HTTP bodies and WebSocket messages: ``param: what is wrong``."""
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    while len(loc) > 1 and (loc[-1] in _TYPE_TAGS or "[" in loc[-1]):  # pydantic names union members by type
        loc.pop()
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        msg = f"unrecognized request argument: {param}"
    elif first.get("type") == "json_invalid":
        msg, param = "the request body is not valid JSON", None
    elif first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        msg = "the request body is empty: send a JSON object (with 'Content-Type: application/json')"
    elif param:
        msg = f"{param}: {msg}"
    return msg, param


def unreadable_json(err: BaseException | None) -> str:
    """Why a body or a message could not be read as JSON, from what ``json.loads`` raised: the one cause that
    applied, not a list of every possible one."""
    if isinstance(err, UnicodeDecodeError):
        return f"it is not UTF-8 text (byte {err.start} is not; a compressed body must be sent uncompressed)"
    if isinstance(err, RecursionError):
        return "it is nested too deeply (at most a few hundred levels of arrays and objects)"
    if isinstance(err, ValueError) and "digits" in str(err) and not hasattr(err, "pos"):  # Python's int limit
        return "it holds an integer longer than 4,300 digits"
    return str(err)[:200] if err is not None else "it is not JSON"


def _answer(request: Request, body: dict[str, Any], status: int, headers: dict[str, str] | None = None
            ) -> JSONResponse:
    """The error's response; its code goes on the request's log line, as an errored stream's does (a 503 said
    nothing there of which 503 it was)."""
    request_fields(request.scope)["error"] = body["error"]["code"] or body["error"]["type"]
    return JSONResponse(body, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    @app.exception_handler(e.TxlError)
    async def _txl(request: Request, err: e.TxlError) -> JSONResponse:
        status, body = classify(err)
        headers = err.headers if err.headers is not None else {"Retry-After": "1"} if status in (429, 503) else None
        if status == 401:  # RFC 9110: a 401 names the scheme it wants
            headers = {"WWW-Authenticate": 'Bearer realm="txlserve"'}
        if status == 426:  # and a 426 the protocol
            headers = {"Upgrade": "websocket", "Connection": "Upgrade"}
        if status == 409:  # the OpenAI SDKs retry a 409 unless told not to: a busy session's writes were made
            headers = {"x-should-retry": "false"}  # one after the other, in an order nobody chose (found by a helper)
        return _answer(request, body, status, headers)

    async def _key_first(request: Request) -> JSONResponse | None:
        """The 401 of a caller without a valid key, where the route takes one: FastAPI reads the body before it
        runs the route's dependencies, so a body that did not read was answered 400 before the key was checked,
        telling a caller without a key what the route accepts."""
        if not takes_key(request.scope.get("route")):
            return None
        try:
            await owner(request)
        except e.AuthenticationError as err:
            return await _txl(request, err)
        return None

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        if (refused := await _key_first(request)) is not None:
            return refused
        msg, param = validation_message(err)
        content_type = request.headers.get("content-type", "")
        not_json = "json" not in content_type.split(";")[0].lower()  # curl -d's form type, or none at all
        if param is None and not_json and "body is empty" not in msg:  # the body was never parsed as JSON
            msg = ("send the body as JSON with 'Content-Type: application/json' "
                   + (f"(this request's is {content_type!r})" if content_type else "(this request has none)"))
        return _answer(request, error_body(msg, "invalid_request_error", param, "invalid_value"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
        if isinstance(err.__cause__, ClientDisconnect):  # FastAPI's 400 for a body the client left before it was
            # read (uvicorn reports a closed connection before the body once the connection is gone): a 499
            return await _txl(request, e.RequestCancelled("the client closed the connection before its request "
                                                          "body was read; nothing was done"))
        if err.status_code == 400 and (refused := await _key_first(request)) is not None:
            return refused
        where = f"{'HEAD' if request.scope.get('txlserve.head') else request.method} {request.url.path}"
        if err.status_code == 404:
            return await _txl(request, e.RouteNotFound(f"no such route: {where} (the API is described at /docs)"))
        message, type_, code = {
            405: (f"method not allowed: {where}", "invalid_request_error", "method_not_allowed"),
            # FastAPI's own 400: json.loads raised something other than a JSON syntax error (bytes that are not
            # UTF-8, nesting deeper than the parser goes, an integer longer than Python converts), kept as the cause
            400: (f"the request body could not be read as JSON: {unreadable_json(err.__cause__)}",
                  "invalid_request_error", "invalid_value"),
        }.get(err.status_code, (str(err.detail), "invalid_request_error", None))
        return _answer(request, error_body(message, type_, None, code), err.status_code,
                       getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def _other(request: Request, err: Exception) -> JSONResponse:
        status, body = classify(err)
        return _answer(request, body, status)
