"""Per-call options and client copies, as openai-python has them: ``extra_headers``, ``extra_query``,
``extra_body`` and ``timeout`` on every call, ``default_headers``/``default_query``/``http_client`` on the
client, and ``with_options()``. Checked on the wire: a scripted HTTP server and a scripted WebSocket server record
what each request carried; the live server checks that a copy with another key acts as that key."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from txlserve_client import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    AsyncClient,
    Client,
    ServiceUnavailableError,
)

from tests.clients.scripted_http import APPENDED, COMPLETION, SESSION, Reply, Scripted, sse, unavailable
from tests.clients.scripted_ws import DONE, ScriptedWebSocket
from tests.conftest import KeyedServer
from tests.live import API_KEYS, MODEL

EXPORTED = {"version": 3, "tokens": [1, 2]}
PAGE = {"object": "list", "data": [SESSION], "has_more": False, "next_cursor": None}
MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "created": 1, "owned_by": "txlserve"}]}
DELETED = {"id": "s1", "object": "session.deleted", "deleted": True}
CHUNK = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]}

# every HTTP call: its answer, and whether it sends a JSON body (only those take extra_body)
CALLS: dict[str, tuple[Callable[..., Any], dict[str, Any], bool]] = {
    "completion": (lambda c, **o: c.completions.create(model="m", prompt="x", **o), COMPLETION, True),
    "stream": (lambda c, **o: list(c.completions.create(model="m", prompt="x", stream=True, **o)), CHUNK, True),
    "create": (lambda c, **o: c.sessions.create(text="x", **o), APPENDED, True),
    "get": (lambda c, **o: c.sessions.get("s1", **o), SESSION, False),
    "list": (lambda c, **o: c.sessions.list(limit=5, **o), PAGE, False),
    "update": (lambda c, **o: c.sessions.update("s1", metadata={"a": "b"}, **o), SESSION, True),
    "delete": (lambda c, **o: c.sessions.delete("s1", **o), DELETED, False),
    "append": (lambda c, **o: c.sessions.append("s1", "more", **o), APPENDED, True),
    "fork": (lambda c, **o: c.sessions.fork("s1", **o), SESSION, True),
    "export": (lambda c, **o: c.sessions.export("s1", **o), EXPORTED, False),
    "import": (lambda c, **o: c.sessions.import_({"version": 3}, **o), APPENDED, True),
    "models": (lambda c, **o: c.models.list(**o), MODELS, False),
}


def _reply(name: str) -> Reply:
    answer = CALLS[name][1]
    return sse(answer, b"[DONE]") if name == "stream" else Reply(200, json.dumps(answer).encode())


def _query(path: str) -> dict[str, list[str]]:
    return parse_qs(urlsplit(path).query)


@pytest.mark.parametrize("name", CALLS)
def test_every_call_sends_its_extra_headers_query_and_body(scripted: Scripted, name: str) -> None:
    call, _, has_body = CALLS[name]
    extra = {"extra_body": {"min_tokens": 3}} if has_body else {}
    scripted.script(_reply(name))
    with Client(base_url=scripted.url, api_key="k1", default_headers={"X-Team": "blue"},
                default_query={"tenant": "t1"}) as client:
        call(client, extra_headers={"X-Trace": "abc", "user-agent": "mine/1", "Accept": None},
             extra_query={"trace": "1"}, **extra)
    [seen] = scripted.seen
    assert seen.header("x-trace") == ["abc"] and seen.header("x-team") == ["blue"]
    assert seen.header("user-agent") == ["mine/1"]  # replaced whatever the name's case: one, not two
    assert seen.header("accept") == []  # a header given None is not sent
    assert seen.header("authorization") == ["Bearer k1"]
    query = _query(seen.path)
    assert query["trace"] == ["1"] and query["tenant"] == ["t1"]
    if name == "list":
        assert query["limit"] == ["5"]  # the call's own query stays
    if has_body:
        body = json.loads(seen.body)
        assert body["min_tokens"] == 3
        assert seen.header("content-type") == ["application/json"]
    else:
        assert seen.body == b""


@pytest.mark.parametrize("name", ["get", "append", "stream"])
def test_extra_body_goes_only_to_a_call_that_sends_one_and_a_misspelt_option_is_refused(scripted: Scripted,
                                                                                        name: str) -> None:
    call, _, has_body = CALLS[name]
    scripted.script(_reply(name))
    with Client(base_url=scripted.url) as client:
        with pytest.raises(TypeError, match="'timout'"):
            call(client, timout=5)
        with pytest.raises(TypeError, match="extra_headers is a mapping"):
            call(client, extra_headers=[("X-A", "1")])
        with pytest.raises(TypeError, match="timeout is seconds or an httpx.Timeout"):
            call(client, timeout="5")
        for bad in ("secret\r\nX-Evil: 1", "Bearer secret ", "\tsecret"):  # h11 refuses a space at either end
            with pytest.raises(ValueError, match="cannot carry") as info:
                call(client, extra_headers={"Authorization": bad})
            assert "secret" not in str(info.value)  # a header's value may be a key: never quoted
        with pytest.raises(ValueError, match="the client's to set"):
            call(client, extra_headers={"Content-Length": "3"})  # h11's raw error as the body went
        for timeout in (0, -1, float("inf"), float("nan"), 10**20, httpx.Timeout(5, read=-1)):
            with pytest.raises(ValueError, match="seconds above 0"):
                call(client, timeout=timeout)
        if not has_body:
            with pytest.raises(TypeError, match="'extra_body' \\(it sends no body\\)"):
                call(client, extra_body={"a": 1})
    assert scripted.seen == []  # each refused before anything was sent
    with Client(base_url=scripted.url) as client:  # what h11 sends: a tab or space inside a value; None not given
        call(client, extra_headers={"X-A": "a\tb c"}, extra_body=None)
    assert scripted.seen[0].header("x-a") == ["a\tb c"]


def test_a_lists_later_pages_take_their_cursor_over_extra_query(scripted: Scripted) -> None:
    """An ``after`` in ``extra_query`` is the first page's: later pages had sent it again over their own cursor,
    and walked the same page without end (found by a helper). A query value given None is not sent."""
    second = {**SESSION, "id": "s2"}
    scripted.script(Reply(200, json.dumps({**PAGE, "has_more": True, "next_cursor": "s1"}).encode()),
                    Reply(200, json.dumps({**PAGE, "data": [second]}).encode()))
    with Client(base_url=scripted.url) as client:
        ids = [s.id for s in client.sessions.list(limit=1, extra_query={"after": "s0", "limit": None, "x": "1"})]
    assert ids == ["s1", "s2"]
    first, then = (_query(seen.path) for seen in scripted.seen)
    assert first == {"after": ["s0"], "x": ["1"]} and then == {"after": ["s1"], "x": ["1"]}  # no limit= at all


@pytest.mark.anyio
async def test_an_async_lists_later_pages_take_their_cursor_too(scripted: Scripted) -> None:
    second = {**SESSION, "id": "s2"}
    scripted.script(Reply(200, json.dumps({**PAGE, "has_more": True, "next_cursor": "s1"}).encode()),
                    Reply(200, json.dumps({**PAGE, "data": [second]}).encode()))
    async with AsyncClient(base_url=scripted.url) as client:
        ids = [s.id async for s in client.sessions.list(limit=1, extra_query={"after": "s0"})]
    assert ids == ["s1", "s2"]
    assert [_query(seen.path)["after"] for seen in scripted.seen] == [["s0"], ["s1"]]


def test_a_calls_timeout_replaces_the_clients_for_that_call(scripted: Scripted) -> None:
    stalled = Reply(200, json.dumps(SESSION).encode(), delay=1.5)
    scripted.script(stalled)
    with Client(base_url=scripted.url, timeout=60, max_retries=0) as client:
        started = time.monotonic()
        with pytest.raises(APITimeoutError):
            client.sessions.get("s1", timeout=0.2)
        assert time.monotonic() - started < 1.4  # the call's 0.2 s, not the client's 60 s, nor the full reply
    scripted.script(Reply(200, json.dumps(SESSION).encode(), delay=0.5))
    with Client(base_url=scripted.url, timeout=0.05, max_retries=0) as client:
        assert client.sessions.get("s1", timeout=30).id == "s1"
        assert client.sessions.get("s1", timeout=None).id == "s1"  # None: no timeout, as for the client
        with pytest.raises(APITimeoutError):
            client.sessions.get("s1")  # the client's own again


def test_with_options_shares_the_connections_and_changes_only_what_it_names(scripted: Scripted) -> None:
    scripted.script(unavailable())
    with Client(base_url=scripted.url, api_key="k1", max_retries=2, default_headers={"X-A": "1"}) as client:
        quick = client.with_options(max_retries=0, api_key="k2", default_headers={"X-B": "2"})
        assert quick._http is client._http  # one connection pool
        assert (quick.base_url, quick.timeout) == (client.base_url, client.timeout)
        with pytest.raises(ServiceUnavailableError):
            quick.sessions.get("s1")
        assert len(scripted.seen) == 1  # no retry
        assert scripted.seen[0].header("authorization") == ["Bearer k2"]
        assert scripted.seen[0].header("x-a") == ["1"] and scripted.seen[0].header("x-b") == ["2"]
        scripted.script(_reply("get"))
        client.sessions.get("s1")
        assert scripted.seen[0].header("authorization") == ["Bearer k1"]  # the parent's key is its own
        assert scripted.seen[0].header("x-b") == []
        with client.with_options(timeout=5) as brief:
            assert brief.timeout == httpx.Timeout(5)
        assert not client.is_closed  # a copy's close leaves its parent's connections open
        client.sessions.get("s1")
        elsewhere = client.with_options(base_url=scripted.url + "/")  # the same server, said otherwise
        assert elsewhere._http is client._http
        other = client.with_options(base_url="http://127.0.0.1:9/v1")  # another server: the same pool serves it
        assert other._http is client._http and other.base_url == "http://127.0.0.1:9"
        other.close()
        assert not client.is_closed
        with pytest.raises(TypeError, match="'retries'"):
            client.with_options(retries=0)
        # a copy of a copy: a later name replaces an earlier one whatever its case (an earlier None had kept "c" out)
        chained = client.with_options(default_headers={"x-a": None}).with_options(default_headers={"X-A": "c"})
        scripted.script(_reply("get"))
        chained.sessions.get("s1", extra_headers={"x-b": None, "X-B": "d"})
        assert scripted.seen[0].header("x-a") == ["c"] and scripted.seen[0].header("x-b") == ["d"]
        with pytest.raises(ValueError, match="api_key holds a character"):
            client.with_options(api_key="two words")
    assert client.copy is not None and Client.copy is Client.with_options


def test_a_given_http_client_is_used_and_closed_with_the_client(scripted: Scripted) -> None:
    scripted.script(_reply("get"))
    hooked: list[str] = []
    http = httpx.Client(headers={"X-Proxy-Auth": "p"}, event_hooks={"request": [lambda r: hooked.append(r.url.host)]})
    with Client(base_url=scripted.url, http_client=http) as client:
        client.sessions.get("s1")
        client.with_options(base_url=scripted.url.replace("127.0.0.1", "localhost")).sessions.get("s1")
        assert client.timeout == httpx.Timeout(600, connect=5)  # httpx's default 5 s is not taken
    assert scripted.seen[0].header("x-proxy-auth") == ["p"]  # its own settings hold, for a copy's too
    assert hooked == ["127.0.0.1", "localhost"]
    assert http.is_closed
    timed = httpx.Client(timeout=7)  # a timeout set on it is, where the client is given none
    with Client(base_url=scripted.url, http_client=timed) as client:
        assert client.timeout == httpx.Timeout(7)
    with Client(base_url=scripted.url, http_client=httpx.Client(timeout=7), timeout=9) as client:
        assert client.timeout == httpx.Timeout(9)
    with pytest.raises(ValueError, match="seconds above 0"):
        Client(base_url=scripted.url, timeout=-1)
    with pytest.raises(TypeError, match="timeout is seconds"):
        Client(base_url=scripted.url, timeout="5")  # type: ignore[arg-type]
    # a header set on the http_client itself, which h11 refuses as it goes: not retried, and not quoted
    scripted.script(_reply("get"))
    with Client(base_url=scripted.url, http_client=httpx.Client(headers={"X-Key": "secret "})) as client, \
            pytest.raises(APIError, match="could not be sent as HTTP") as info:
        client.sessions.get("s1")
    assert "secret" not in str(info.value) and not isinstance(info.value, APIConnectionError)
    assert scripted.seen == []
    with pytest.raises(TypeError, match="an httpx.Client"):
        Client(base_url=scripted.url, http_client=httpx.AsyncClient())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="an httpx.AsyncClient"):
        AsyncClient(base_url=scripted.url, http_client=httpx.Client())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot carry"):
        Client(base_url=scripted.url, default_headers={"X-A": "ключ"})


@pytest.mark.anyio
async def test_the_async_client_takes_the_same_options(scripted: Scripted) -> None:
    scripted.script(_reply("list"))
    async with AsyncClient(base_url=scripted.url, timeout=60, max_retries=0) as client:
        page = await client.sessions.list(limit=2, extra_headers={"X-Trace": "a"}, extra_query={"q": "1"})
        assert [s.id for s in page.data] == ["s1"]
        assert scripted.seen[0].header("x-trace") == ["a"] and _query(scripted.seen[0].path)["q"] == ["1"]
        scripted.script(_reply("append"))
        async with client.with_options(api_key="k3") as copy:
            assert copy._http is client._http
            await copy.sessions.append("s1", "x", extra_body={"echo": True})
        assert json.loads(scripted.seen[0].body) == {"text": "x", "echo": True}
        assert scripted.seen[0].header("authorization") == ["Bearer k3"]
        assert not client.is_closed
        scripted.script(Reply(200, json.dumps(SESSION).encode(), delay=1.5))
        started = time.monotonic()
        with pytest.raises(APITimeoutError):
            await client.sessions.get("s1", timeout=0.2)
        assert time.monotonic() - started < 1.4
        with pytest.raises(TypeError, match="'timout'"):
            client.sessions.list(timout=1)  # refused as it is made, not when awaited
        with pytest.raises(TypeError, match="'timout'"):
            client.ws.connect(timout=1)


def _recording(seen: list[tuple[str, list[tuple[str, str]]]], answer: bool) -> Callable[..., Any]:
    async def handler(ws: Any) -> None:
        seen.append((ws.request.path, [(k.lower(), v) for k, v in ws.request.headers.raw_items()]))
        if answer:
            msg = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "completion.delta", "id": "c1", "text": msg["prompt"]}))
            await ws.send(json.dumps({"type": "completion.done", "id": "c1", **DONE}))
        else:
            await ws.wait_closed()  # answers nothing: the client's read timeout closes it
    return handler


def test_a_websockets_headers_query_and_read_timeout(anyio_backend: str) -> None:
    seen: list[tuple[str, list[tuple[str, str]]]] = []
    with ScriptedWebSocket(_recording(seen, answer=True)) as srv, \
            Client(base_url=srv.url, api_key="k1", default_query={"tenant": "t1"}) as client:
        chunks = list(client.ws.stream(model="m", prompt="hey", extra_headers={"X-Trace": "w"},
                                       extra_query={"q": "2"}))
        assert "".join(c.text for c in chunks) == "hey"  # the request options did not go into the body
        copy = client.with_options(api_key="k2", default_headers={"User-Agent": "mine/2"})
        with copy.ws.connect() as conn:
            assert [c.text for c in conn.completion(model="m", prompt="yo")][0] == "yo"
    (path1, headers1), (path2, headers2) = seen
    assert _query(path1) == {"tenant": ["t1"], "q": ["2"]} and _query(path2) == {"tenant": ["t1"]}
    assert ("x-trace", "w") in headers1 and ("authorization", "Bearer k1") in headers1
    assert ("authorization", "Bearer k2") in headers2
    assert [v for k, v in headers2 if k == "user-agent"] == ["mine/2"]
    with ScriptedWebSocket(_recording(seen, answer=True)) as srv, Client(base_url=srv.url) as client, \
            client.ws.connect() as conn:
        with pytest.raises(TypeError, match="timeout is the connection's"):
            conn.completion(model="m", prompt="x", timeout=5)  # it had gone into the body
        with pytest.raises(TypeError, match="'max_token'"):
            conn.completion(model="m", prompt="x", max_token=5)  # the server's 400 before
        with pytest.raises(TypeError, match="'timout'"):
            client.ws.stream(model="m", prompt="x", timout=5)
        with pytest.raises(TypeError, match="'max_token'"):  # before a socket is opened: none was
            Client(base_url="http://127.0.0.1:9", max_retries=2).ws.stream(model="m", max_token=8)
        with pytest.raises(ValueError, match="seconds above 0"):
            client.ws.connect(timeout=float("inf"))
        assert [c.text for c in conn.completion(model="m", prompt="ok", extra_body={"min_tokens": 1})] == ["ok", ""]
    with ScriptedWebSocket(_recording(seen, answer=False)) as srv, \
            Client(base_url=srv.url, timeout=60, max_retries=0) as client:
        started = time.monotonic()
        with client.ws.connect(timeout=httpx.Timeout(5, read=0.3)) as conn, pytest.raises(APITimeoutError):
            list(conn.completion(model="m", prompt="x"))
        assert time.monotonic() - started < 10


def test_a_copy_with_another_key_is_that_key_on_the_live_server(keyed_server: KeyedServer) -> None:
    """The server's own check of the key a copy sends: a session made through ``with_options(api_key=...)``
    belongs to that key, and the parent's key does not see it."""
    with Client(base_url=keyed_server.url, api_key=API_KEYS[0], timeout=30) as alpha:
        bravo = alpha.with_options(api_key=API_KEYS[1])
        made = bravo.sessions.create(text="to be", metadata={"by": "bravo"})
        try:
            assert bravo.sessions.get(made.id).id == made.id
            with pytest.raises(Exception) as info:
                alpha.sessions.get(made.id)
            assert getattr(info.value, "status", None) == 404
            done = bravo.completions.create(model=MODEL, prompt=" or", max_tokens=2, session_id=made.id,
                                            temperature=0, extra_headers={"X-Request-Id": "req-1"}, timeout=30)
            assert done.usage.completion_tokens == 2
            # openai-python's _request_id: the id the server logged the call under (the caller's, where it sent one)
            assert done._request_id == "req-1" and made._request_id and made._request_id != "req-1"
            with bravo.completions.create(model=MODEL, prompt=" not", max_tokens=2, session_id=made.id,
                                          stream=True, extra_headers={"X-Request-Id": "req-2"}) as stream:
                assert stream._request_id == "req-2" and len(list(stream)) >= 2
            assert bravo.sessions.get(made.id, extra_headers={"X-Request-Id": "req-3"})._request_id == "req-3"
        finally:
            assert bravo.sessions.delete(made.id)._request_id


def test_a_websocket_completion_takes_the_fields_completions_create_names() -> None:
    """The fields a WebSocket completion takes as keyword arguments are create's, sync and async alike."""
    import inspect

    from txlserve_client import AsyncCompletions, Completions
    from txlserve_client._base import COMPLETION_FIELDS

    for create in (Completions.create, AsyncCompletions.create):
        named = set(inspect.signature(create).parameters) - {"self", "model", "prompt", "stream", "options"}
        assert named == COMPLETION_FIELDS
