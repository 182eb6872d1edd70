"""The client as a distribution: light, with a deliberate public API and error tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import txlserve_client
from txlserve_client import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    RequestCancelledError,
    ServiceUnavailableError,
    SessionBusyError,
    UnprocessableEntityError,
)
from txlserve_client._exceptions import error_from_body
from txlserve_client._streaming import SSEDecoder, SSELines, chunk_from_event

from tests.clients.conftest import CLIENT_SRC

PUBLIC = {
    "Client", "AsyncClient", "Timeout", "__version__",
    "RequestOptions", "BodyRequestOptions", "ClientOptions",
    "Completions", "Sessions", "Models", "WebSocket", "AsyncCompletions", "AsyncSessions", "AsyncModels",
    "AsyncWebSocket",
    "Completion", "Choice", "CompletionChunk", "Usage", "Logprobs", "SessionRef", "Session", "AppendResult",
    "SessionDeleted", "SessionPage", "AsyncSessionPage", "AsyncSessionPager", "Model",
    "Stream", "AsyncStream", "WebSocketConnection", "WebSocketStream", "AsyncWebSocketConnection",
    "AsyncWebSocketStream",
    "APIError", "APIConnectionError", "APITimeoutError", "APIStatusError", "BadRequestError", "AuthenticationError",
    "PermissionDeniedError", "NotFoundError", "ConflictError", "SessionBusyError", "PayloadTooLargeError",
    "UnprocessableEntityError", "RateLimitError", "RequestCancelledError", "ServiceUnavailableError",
    "InternalServerError",
}


def test_all_is_the_public_api() -> None:
    assert set(txlserve_client.__all__) == PUBLIC
    assert len(txlserve_client.__all__) == len(PUBLIC)
    for name in txlserve_client.__all__:
        assert getattr(txlserve_client, name) is not None
    public_module_names = {n for n in vars(txlserve_client) if not n.startswith("_") and n != "chat"}
    assert public_module_names <= PUBLIC | {"annotations"}


def test_importing_the_client_loads_neither_torch_nor_the_server() -> None:
    code = ("import sys, json, txlserve_client, txlserve_client.chat; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    env = {**os.environ, "PYTHONPATH": str(CLIENT_SRC)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=CLIENT_SRC, capture_output=True, text=True,
                         check=True).stdout
    loaded = set(json.loads(out))
    assert {"httpx", "websockets", "txlserve_client"} <= loaded
    assert not loaded & {"torch", "numpy", "server", "model", "memory_store", "fastapi", "redis", "pydantic"}


def test_distribution_metadata() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((CLIENT_SRC / "pyproject.toml").read_text())
    project = meta["project"]
    assert project["name"] == "txlserve-client"
    assert sorted(d.split(">")[0].split("=")[0] for d in project["dependencies"]) == ["httpx", "websockets"]
    assert project["scripts"] == {"txlserve-chat": "txlserve_client.chat:main"}
    assert (CLIENT_SRC / "txlserve_client" / "py.typed").is_file()
    assert (CLIENT_SRC / "README.md").is_file()


def test_error_tree() -> None:
    for cls in (APIConnectionError, BadRequestError, AuthenticationError, NotFoundError, ConflictError,
                PayloadTooLargeError, UnprocessableEntityError, RateLimitError, ServiceUnavailableError,
                InternalServerError):
        assert issubclass(cls, APIError)
    assert issubclass(APITimeoutError, APIConnectionError)
    assert issubclass(SessionBusyError, ConflictError)
    for cls in (BadRequestError, AuthenticationError, PermissionDeniedError, NotFoundError, ConflictError,
                PayloadTooLargeError, UnprocessableEntityError, RateLimitError, RequestCancelledError,
                ServiceUnavailableError, InternalServerError):  # as OpenAI's SDK's: one base for an error answer
        assert issubclass(cls, APIStatusError) and issubclass(APIStatusError, APIError)
    assert not issubclass(APIConnectionError, APIStatusError)


def _body(type_: str, code: str | None, message: str = "m", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@pytest.mark.parametrize(("status", "type_", "code", "cls"), [
    (400, "invalid_request_error", "invalid_value", BadRequestError),
    (401, "authentication_error", "invalid_api_key", AuthenticationError),
    (403, "permission_error", "origin_not_allowed", PermissionDeniedError),
    (404, "not_found_error", "model_not_found", NotFoundError),
    (409, "conflict_error", "session_busy", SessionBusyError),
    (409, "conflict_error", "session_conflict", ConflictError),
    (413, "invalid_request_error", "payload_too_large", PayloadTooLargeError),
    (422, "invalid_request_error", "session_incompatible", UnprocessableEntityError),
    (429, "rate_limit_error", "overloaded", RateLimitError),
    (499, "invalid_request_error", "request_cancelled", RequestCancelledError),
    (503, "service_unavailable_error", "store_unavailable", ServiceUnavailableError),
    (500, "server_error", "internal_error", InternalServerError),
    (502, None, None, InternalServerError),
    (405, "invalid_request_error", None, APIStatusError),
])
def test_errors_are_named_for_what_happened(status: int, type_: str, code: str, cls: type[APIError]) -> None:
    err = error_from_body(_body(type_, code, "what went wrong", "p"), status)
    assert type(err) is cls
    assert (err.message, err.status, err.type, err.code, err.param) == ("what went wrong", status, type_, code, "p")
    # inside a stream there is no HTTP status: the server sends it with the error, and the class follows
    if code is not None:
        inner = error_from_body({**_body(type_, code, "what went wrong"), "status": status})
        assert type(inner) is cls and inner.status == status


@pytest.mark.parametrize(("type_", "cls"), [
    ("invalid_request_error", BadRequestError), ("not_found_error", NotFoundError),
    ("rate_limit_error", RateLimitError), ("service_unavailable_error", ServiceUnavailableError),
    ("server_error", InternalServerError), ("something_new", APIError),
])
def test_a_stream_error_without_a_status_is_named_by_its_type(type_: str, cls: type[APIError]) -> None:
    """An older server sends no ``status`` inside a stream: OpenAI's ``type`` still names the error."""
    err = error_from_body(_body(type_, "c", "what went wrong"))
    assert type(err) is cls


def test_error_without_an_openai_body() -> None:
    err = error_from_body(None, 502, "<html>bad gateway</html>")
    assert isinstance(err, InternalServerError) and err.message == "<html>bad gateway</html>" and err.status == 502
    assert "502" in str(err) and "bad gateway" in str(err)


def test_sse_decoder() -> None:
    decoder = SSEDecoder()
    lines = [": comment", "event: x", "data: {\"a\":", "data: 1}", "", "", "data:[DONE]", ""]
    events = [e for e in map(decoder.feed, lines) if e is not None]
    assert events == ['{"a":\n1}', "[DONE]"]
    assert chunk_from_event("[DONE]") is None
    with pytest.raises(SessionBusyError) as info:
        chunk_from_event(json.dumps({**_body("conflict_error", "session_busy", "busy"), "status": 409}))
    assert info.value.status == 409 and info.value.message == "busy"


@pytest.mark.parametrize("key", ["sk-secret-KEY\n", "sk-secret\x00KEY", "sk-secret-K\u00c9Y", "sk secret"])
def test_a_key_no_header_can_carry_is_refused_without_quoting_it(key: str, monkeypatch, capsys) -> None:
    """A key read from a file keeps its newline: httpx and websockets refused the header in a message that
    quoted it whole, key and all, and txlserve chat printed it (found by a helper)."""
    from txlserve_client import AsyncClient, Client
    from txlserve_client.chat import main

    for make in (Client, AsyncClient):
        with pytest.raises(ValueError) as info:
            make(base_url="http://127.0.0.1:9", api_key=key)
        assert "secret" not in str(info.value) and "api_key" in str(info.value)
    if "\x00" in key:  # no environment variable can hold it
        return
    monkeypatch.setenv("TXLSERVE_API_KEY", key)
    assert main(["--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "secret" not in err and err.count("\n") == 1, err


def test_an_answer_that_is_not_the_servers_is_an_api_error() -> None:
    """A captive portal's 200 page, JSON cut short or of another shape, an event or a WebSocket message that is
    not JSON: each raised JSONDecodeError, KeyError or UnicodeDecodeError (found by a helper), where every failure
    a call meets is to be an APIError."""
    import httpx
    from txlserve_client._base import Call
    from txlserve_client._websocket import _message

    call = Call("GET", "/v1/models", parse=lambda body: [m["id"] for m in body["data"]])
    for content, kind in ((b"<html>log in</html>", "text/html"), (b'{"data": [', "application/json"),
                          (b'{"object": "list"}', "application/json"), (b"[1, 2]", "application/json")):
        with pytest.raises(APIError, match="is not a txlserve server's") as info:
            call.answer(httpx.Response(200, content=content, headers={"content-type": kind}))
        assert type(info.value) is APIError and info.value.status == 200
    assert call.answer(httpx.Response(200, json={"data": [{"id": "m"}]})) == ["m"]
    for data in ("not json", '{"choices": 3}'):
        with pytest.raises(APIError, match="is not a txlserve server's"):
            chunk_from_event(data)
    for raw in ("not json", b"\xff\xfe\x00"):
        with pytest.raises(APIError, match="unexpected WebSocket message"):
            _message(raw)


def test_sse_lines_end_only_where_sse_ends_them() -> None:
    """U+2028, U+2029 and U+0085 are raw inside JSON strings: httpx's iter_lines cut the event there (found by a
    helper). CR, LF and CRLF end lines, a CRLF split between two reads too; a last line with no end is held."""
    lines = SSELines()
    got = lines.feed('data: {"t": "a\u2028b\u2029c\x85d"}\r') + lines.feed("\n\ndata: x\ry\n") + lines.feed("z")
    assert got == ['data: {"t": "a\u2028b\u2029c\x85d"}', "", "data: x", "y"]
    assert lines.feed("\r\n") == ["z"]


def test_a_refused_websocket_handshake_is_named_by_its_body() -> None:
    """A 403 with an error body (a page of another origin) is PermissionDeniedError, not a bad key; a bare
    401 or 403 stays AuthenticationError."""
    import json

    from txlserve_client._websocket import connect_error
    from websockets.datastructures import Headers
    from websockets.exceptions import InvalidStatus
    from websockets.http11 import Response

    body = json.dumps(_body("permission_error", "origin_not_allowed", "from origin 'x' not allowed", None)).encode()
    refused = connect_error(InvalidStatus(Response(403, "Forbidden", Headers(), body)))
    assert type(refused) is PermissionDeniedError and refused.code == "origin_not_allowed"
    assert type(connect_error(InvalidStatus(Response(403, "Forbidden", Headers(), b"")))) is AuthenticationError



def test_a_stream_dropped_unread_closes_its_response() -> None:
    """A stream never iterated: its generator never started, so no ``finally`` of it closes the response; the
    stream's own ``__del__`` does, with the cyclic collector off (nothing may wait for it)."""
    import gc

    import httpx
    from txlserve_client import Stream

    closed: list[bool] = []

    class Body(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield b"data: [DONE]\n\n"

        def close(self) -> None:
            closed.append(True)

    gc.disable()
    try:
        Stream(httpx.Response(200, stream=Body(), request=httpx.Request("POST", "http://x/v1/completions")))
        assert closed == [True]
    finally:
        gc.enable()


def test_create_has_an_overload_for_a_stream_flag_known_at_run_time() -> None:
    """``create(..., stream=flag)`` with ``flag: bool`` matched no overload for a type checker (openai-python has
    a third, returning either)."""
    import inspect
    import typing

    if not hasattr(typing, "get_overloads"):
        pytest.skip("typing.get_overloads is Python 3.11's")
    for create, stream in ((txlserve_client.Completions.create, "Stream"),
                           (txlserve_client.AsyncCompletions.create, "AsyncStream")):
        signatures = [inspect.signature(f) for f in typing.get_overloads(create)]
        shapes = {(str(s.parameters["stream"].annotation), str(s.return_annotation)) for s in signatures}
        assert shapes == {("Literal[False]", "Completion"), ("Literal[True]", stream),
                          ("bool", f"Completion | {stream}")}, shapes


def test_a_status_errors_status_code_is_typed_int() -> None:
    """As openai-python's ``APIStatusError.status_code``; ``APIError``'s (a connection error's) may be None."""
    import typing

    assert typing.get_type_hints(APIStatusError.status_code.fget)["return"] is int
    assert error_from_body({"error": {"message": "no"}}, 404).status_code == 404
