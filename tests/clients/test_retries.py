"""Retries, timeouts and broken streams, against a small scripted HTTP server on a real socket."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from txlserve_client import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AsyncClient,
    Client,
    InternalServerError,
    NotFoundError,
    RateLimitError,
    ServiceUnavailableError,
    SessionBusyError,
)

from tests.clients.scripted_http import (
    APPENDED,
    CHUNK,
    COMPLETION,
    SESSION,
    Reply,
    Scripted,
    error,
    sse,
    unavailable,
)
from tests.live import free_port


def test_backs_off_exponentially_then_succeeds(scripted: Scripted) -> None:
    ok = Reply(200, json.dumps(COMPLETION).encode())
    scripted.script(unavailable(retry_after=None), unavailable(retry_after=None), ok)
    with Client(base_url=scripted.url, max_retries=2) as client:
        assert client.completions.create(model="m", prompt="x").text == "ok"
    assert len(scripted.seen) == 3
    first, second = scripted.gaps()
    assert 0.375 <= first < second < 3  # 0.5 s then 1 s, less up to 25% jitter
    assert second >= 0.75


def test_honours_retry_after(scripted: Scripted) -> None:
    scripted.script(error(429, "rate_limit_error", "overloaded", retry_after="1"),
                    Reply(200, json.dumps(SESSION).encode()))
    with Client(base_url=scripted.url) as client:
        assert client.sessions.get("s1").tokens_seen == 3
    assert [s.method for s in scripted.seen] == ["GET", "GET"]
    assert 1.0 <= scripted.gaps()[0] < 3


def test_gives_up_after_max_retries(scripted: Scripted) -> None:
    scripted.script(unavailable())
    with Client(base_url=scripted.url, max_retries=2) as client, pytest.raises(ServiceUnavailableError) as info:
        client.sessions.delete("s1")
    assert len(scripted.seen) == 3
    assert (info.value.status, info.value.code, info.value.message) == (503, "store_unavailable",
                                                                        "store_unavailable now")
    scripted.script(unavailable())
    with Client(base_url=scripted.url, max_retries=0) as client, pytest.raises(ServiceUnavailableError):
        client.models.list()
    assert len(scripted.seen) == 1


CHANGING_CALLS = ["append", "session_completion", "session_stream", "create", "fork", "import"]


def _changing_call(client: Client, call: str) -> object:
    return {"append": lambda: client.sessions.append("s1", "more text"),
            "session_completion": lambda: client.completions.create(model="m", prompt="x", session_id="s1"),
            "session_stream": lambda: list(client.completions.create(model="m", prompt="x", session_id="s1",
                                                                     stream=True)),
            "create": lambda: client.sessions.create(text="x"),
            "fork": lambda: client.sessions.fork("s1"),
            "import": lambda: client.sessions.import_({"version": 1})}[call]()


def _answer_to(call: str) -> Reply:
    if call == "session_stream":
        return sse(CHUNK, b"[DONE]")
    return Reply(200, json.dumps(SESSION if call == "fork" else APPENDED if call in ("append", "create", "import")
                                 else COMPLETION).encode())


@pytest.mark.parametrize("call", CHANGING_CALLS)
def test_calls_that_change_a_session_are_not_retried_where_they_may_have_run(scripted: Scripted, call: str) -> None:
    """The server's busy 409 and its 503 whose commit is unknown say ``x-should-retry: false``; a proxy's 502, a
    429 with no Retry-After, or a dropped answer may follow a run that committed: sent again, it fed twice."""
    busy = error(409, "conflict_error", "session_busy", retry_after=None)
    busy.headers["x-should-retry"] = "false"
    unknown = error(503, "service_unavailable_error", "commit_outcome_unknown", retry_after=None)
    unknown.headers["x-should-retry"] = "false"
    said_no = error(429, "rate_limit_error", "overloaded")  # a Retry-After, but told not to
    said_no.headers["x-should-retry"] = "false"
    proxy = Reply(502, b"<html>bad gateway</html>", {"Content-Type": "text/html"})
    bare = error(429, "rate_limit_error", "overloaded", retry_after=None)
    for reply, raised in ((busy, SessionBusyError), (unknown, ServiceUnavailableError), (said_no, RateLimitError),
                          (proxy, InternalServerError), (bare, RateLimitError),
                          (Reply(200, b"", drop=True), APIConnectionError)):
        scripted.script(reply, _answer_to(call))
        with Client(base_url=scripted.url, max_retries=5) as client, pytest.raises(raised):
            _changing_call(client, call)
        assert len(scripted.seen) == 1, (reply, len(scripted.seen))


@pytest.mark.parametrize("call", CHANGING_CALLS)
def test_calls_that_change_a_session_are_retried_where_they_provably_did_not_run(scripted: Scripted,
                                                                                call: str) -> None:
    """The server sends Retry-After only with a 429 or 503 where nothing ran; a refused connection sent nothing.
    Such a failure raised at once for every call that changes a session (a review's finding)."""
    for refusal in (error(429, "rate_limit_error", "overloaded"), unavailable()):
        scripted.script(refusal, _answer_to(call))
        with Client(base_url=scripted.url, max_retries=2) as client:
            assert _changing_call(client, call) is not None
        assert len(scripted.seen) == 2
    scripted.script(_answer_to(call))
    with Client(base_url=scripted.url, max_retries=1) as client:
        real, tries = client._http._transport.handle_request, []

        def refuse_first(request: httpx.Request) -> httpx.Response:
            tries.append(request)
            if len(tries) == 1:
                raise httpx.ConnectError("refused", request=request)
            return real(request)

        client._http._transport.handle_request = refuse_first
        assert _changing_call(client, call) is not None
    assert len(tries) == 2 and len(scripted.seen) == 1


@pytest.mark.anyio
async def test_the_async_client_retries_a_session_call_that_did_not_run(scripted: Scripted) -> None:
    scripted.script(unavailable(), Reply(200, json.dumps(APPENDED).encode()))
    async with AsyncClient(base_url=scripted.url) as client:
        assert (await client.sessions.append("s1", "x")).tokens_seen == 3
    assert len(scripted.seen) == 2  # and without a Retry-After, once: test_async_client_retries_the_same_way


@pytest.mark.parametrize("status", [408, 409, 500, 502, 504])
def test_stateless_calls_are_retried_as_openais_sdk_retries_them(scripted: Scripted, status: int) -> None:
    scripted.script(Reply(status, b"{}"), Reply(200, json.dumps(SESSION).encode()))
    with Client(base_url=scripted.url, max_retries=1) as client:
        assert client.sessions.get("s1").tokens_seen == 3
    assert len(scripted.seen) == 2
    scripted.script(Reply(status, b"{}"), Reply(200, json.dumps(COMPLETION).encode()))
    with Client(base_url=scripted.url, max_retries=1) as client:
        assert client.completions.create(model="m", prompt="x").text == "ok"
    assert len(scripted.seen) == 2


def test_x_should_retry_is_obeyed(scripted: Scripted) -> None:
    told = Reply(400, b"{}", {"x-should-retry": "true"})
    scripted.script(told, Reply(200, json.dumps(SESSION).encode()))
    with Client(base_url=scripted.url, max_retries=1) as client:
        assert client.sessions.get("s1").tokens_seen == 3
    assert len(scripted.seen) == 2
    refused = unavailable()
    refused.headers["x-should-retry"] = "false"
    scripted.script(refused, Reply(200, json.dumps(SESSION).encode()))
    with Client(base_url=scripted.url, max_retries=3) as client, pytest.raises(ServiceUnavailableError):
        client.sessions.get("s1")
    assert len(scripted.seen) == 1


def test_retry_after_ms_comes_first(scripted: Scripted) -> None:
    slow = unavailable(retry_after="30")
    slow.headers["retry-after-ms"] = "50"
    scripted.script(slow, Reply(200, json.dumps(SESSION).encode()))
    with Client(base_url=scripted.url) as client:
        assert client.sessions.get("s1").tokens_seen == 3
    assert 0.05 <= scripted.gaps()[0] < 0.375  # neither the 30 s nor the first backoff


def test_a_retried_call_that_fails_keeps_the_failure_before(scripted: Scripted) -> None:
    """A GET that timed out, then found the server 503: the 503 alone hid why it had been sent again."""
    scripted.script(Reply(200, json.dumps(SESSION).encode(), delay=1.0), unavailable(retry_after=None))
    with Client(base_url=scripted.url, timeout=0.3, max_retries=1) as client, \
            pytest.raises(ServiceUnavailableError) as info:
        client.sessions.get("s1")
    assert isinstance(info.value.__cause__, APITimeoutError), info.value.__cause__
    assert isinstance(info.value.__cause__.__cause__, httpx.TimeoutException)


def test_errors_carry_openais_attributes(scripted: Scripted) -> None:
    gone = error(404, "not_found_error", "session_not_found", retry_after=None)
    gone.headers["x-request-id"] = "req-7"
    scripted.script(gone)
    with Client(base_url=scripted.url) as client, pytest.raises(APIStatusError) as info:
        client.sessions.get("s1")
    err = info.value
    assert isinstance(err, NotFoundError) and err.status_code == err.status == 404
    assert isinstance(err.response, httpx.Response) and err.response.status_code == 404
    assert err.body == {"message": "session_not_found now", "type": "not_found_error", "param": None,
                        "code": "session_not_found"}
    assert err.request_id == "req-7" and err.request is err.response.request
    assert err.request.url.path == "/v1/sessions/s1"

    scripted.script(Reply(502, b"<html>bad gateway</html>", {"Content-Type": "text/html"}))
    with Client(base_url=scripted.url, max_retries=0) as client, pytest.raises(InternalServerError) as info:
        client.models.list()
    assert info.value.body is None and info.value.request_id is None and info.value.response.status_code == 502

    busy = {"error": {"message": "in use", "type": "conflict_error", "param": None, "code": "session_busy"},
            "status": 409}
    scripted.script(sse(CHUNK, busy, b"[DONE]"))
    with Client(base_url=scripted.url) as client, pytest.raises(SessionBusyError) as info:
        list(client.completions.create(model="m", prompt="x", stream=True))
    assert info.value.status_code == 409 and info.value.body == busy["error"]
    assert info.value.response.status_code == 200 and info.value.request.url.path == "/v1/completions"

    with Client(base_url=f"http://127.0.0.1:{free_port()}", max_retries=0) as client, \
            pytest.raises(APIConnectionError) as info:
        client.models.list()
    assert info.value.request.url.path == "/v1/models" and info.value.response is None


@pytest.mark.parametrize("kind", ["application/json", "text/html; charset=utf-8"])
def test_a_stream_answered_with_no_event_stream_says_what_came(scripted: Scripted, kind: str) -> None:
    """It read as SSE, found no event, and blamed the connection: "the stream ended before [DONE]"."""
    scripted.script(Reply(200, json.dumps(COMPLETION).encode(), {"Content-Type": kind}))
    with Client(base_url=scripted.url) as client, pytest.raises(APIError) as info:
        list(client.completions.create(model="m", prompt="x", stream=True))
    assert not isinstance(info.value, APIConnectionError) and "DONE" not in str(info.value)
    assert kind in str(info.value) and "HTTP 200" in str(info.value) and "text/event-stream" in str(info.value)
    assert info.value.response.status_code == 200


@pytest.mark.anyio
async def test_the_async_client_says_what_came_for_a_stream_too(scripted: Scripted) -> None:
    scripted.script(Reply(200, json.dumps(COMPLETION).encode()))
    async with AsyncClient(base_url=scripted.url) as client:
        with pytest.raises(APIError, match="application/json"):
            await client.completions.create(model="m", prompt="x", stream=True)


def test_stream_retried_before_it_starts(scripted: Scripted) -> None:
    chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]}
    scripted.script(unavailable(), sse(chunk, b"[DONE]"))
    with Client(base_url=scripted.url) as client, client.completions.create(model="m", prompt="x",
                                                                               stream=True) as stream:
        assert [c.text for c in stream] == ["hi"]
    assert [s.path for s in scripted.seen] == ["/v1/completions"] * 2


def test_errors_inside_a_stream(scripted: Scripted) -> None:
    chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]}
    busy = {"error": {"message": "in use", "type": "conflict_error", "param": None, "code": "session_busy"},
            "status": 409}
    scripted.script(sse(chunk, busy, b"[DONE]"))
    with Client(base_url=scripted.url) as client:
        stream = client.completions.create(model="m", prompt="x", stream=True)
        assert next(stream).text == "hi"
        with pytest.raises(SessionBusyError) as info:
            next(stream)
        assert info.value.status == 409 and info.value.message == "in use"

        scripted.script(sse(chunk))  # the connection ends without [DONE]
        with pytest.raises(APIConnectionError, match=r"\[DONE\]"):
            list(client.completions.create(model="m", prompt="x", stream=True))


def test_a_retried_delete_that_finds_nothing_reports_the_first_tries_delete(scripted: Scripted) -> None:
    """A DELETE is retried after a lost answer; its first try may have deleted the session, and the retry's 404
    then raised NotFoundError for a delete that succeeded (found by a helper). A 404 with no answer lost is one."""
    gone = error(404, "invalid_request_error", "session_not_found", retry_after=None)
    scripted.script(Reply(200, b"", drop=True), gone)
    with Client(base_url=scripted.url) as client:
        deleted = client.sessions.delete("s1")
        assert (deleted.id, deleted.deleted) == ("s1", True) and len(scripted.seen) == 2
        scripted.script(gone)
        with pytest.raises(NotFoundError):
            client.sessions.delete("s1")
    # a first try that never connected lost no answer: the 404 is the answer (a review's finding)
    scripted.script(gone)
    with Client(base_url=scripted.url) as client:
        real = client._http._transport.handle_request
        tries = []

        def refuse_first(request):
            tries.append(request)
            if len(tries) == 1:
                raise httpx.ConnectError("refused", request=request)
            return real(request)

        client._http._transport.handle_request = refuse_first
        with pytest.raises(NotFoundError):
            client.sessions.delete("s1")
        assert len(tries) == 2


@pytest.mark.anyio
async def test_the_async_client_reports_a_retried_delete_the_same_way(scripted: Scripted) -> None:
    gone = error(404, "invalid_request_error", "session_not_found", retry_after=None)
    scripted.script(Reply(200, b"", drop=True), gone)
    async with AsyncClient(base_url=scripted.url) as client:
        assert (await client.sessions.delete("s1")).deleted is True
        scripted.script(gone)
        with pytest.raises(NotFoundError):
            await client.sessions.delete("s1")


def test_non_json_error_body(scripted: Scripted) -> None:
    scripted.script(Reply(502, b"<html>bad gateway</html>", {"Content-Type": "text/html"}))
    with Client(base_url=scripted.url) as client, pytest.raises(InternalServerError) as info:
        client.sessions.append("s1", "x")
    assert info.value.status == 502 and "bad gateway" in info.value.message


def test_timeout(scripted: Scripted) -> None:
    scripted.script(Reply(200, json.dumps(SESSION).encode(), delay=1.0))
    with Client(base_url=scripted.url, timeout=0.2, max_retries=0) as client, pytest.raises(APITimeoutError):
        client.sessions.get("s1")


def test_connection_refused_is_retried_then_raised() -> None:
    t0 = time.monotonic()
    with Client(base_url=f"http://127.0.0.1:{free_port()}", max_retries=1) as client, \
            pytest.raises(APIConnectionError):
        client.models.list()
    assert time.monotonic() - t0 >= 0.375  # one backoff


@pytest.mark.anyio
async def test_async_client_retries_the_same_way(scripted: Scripted) -> None:
    scripted.script(unavailable(), unavailable(), Reply(200, json.dumps(COMPLETION).encode()))
    async with AsyncClient(base_url=scripted.url) as client:
        assert (await client.completions.create(model="m", prompt="x")).text == "ok"
    assert len(scripted.seen) == 3
    scripted.script(unavailable(retry_after=None))
    async with AsyncClient(base_url=scripted.url) as client:
        with pytest.raises(ServiceUnavailableError):
            await client.sessions.append("s1", "x")
    assert len(scripted.seen) == 1


def test_a_negative_retry_after_backs_off_as_if_none_was_given(scripted: Scripted) -> None:
    """RFC 9110's Retry-After is digits only: a negative one retried at once, as a hammering loop would."""
    scripted.script(unavailable(retry_after="-5"), Reply(200, json.dumps(SESSION).encode()))
    with Client(base_url=scripted.url) as client:
        assert client.sessions.get("s1").tokens_seen == 3
    assert 0.375 <= scripted.gaps()[0] < 3  # the first backoff, 0.5 s less up to 25% jitter


def test_a_redirect_is_not_followed_and_says_where_it_points(scripted: Scripted) -> None:
    scripted.script(Reply(301, b"", {"Location": "https://elsewhere.example/v1/completions"}))
    with Client(base_url=scripted.url) as client, pytest.raises(APIError, match="redirected to 'https://else") as info:
        client.completions.create(model="m", prompt="x")
    assert info.value.status == 301 and len(scripted.seen) == 1  # a POST is never sent again elsewhere


@pytest.mark.parametrize("stream", [False, True])
def test_a_body_that_its_content_encoding_does_not_describe_is_an_api_error(scripted: Scripted, stream: bool
                                                                            ) -> None:
    """httpx's DecodingError is no TransportError: a proxy labelling plain JSON gzip reached the caller raw."""
    plain = json.dumps(COMPLETION).encode()
    scripted.script(Reply(200, plain if not stream else b"data: " + plain + b"\n\n",
                          {"Content-Encoding": "gzip", "Content-Type": "text/event-stream" if stream else
                           "application/json"}))
    with Client(base_url=scripted.url, max_retries=3) as client, pytest.raises(APIError, match="Content-Encoding"):
        list(client.completions.create(model="m", prompt="x", stream=True)) if stream else \
            client.completions.create(model="m", prompt="x")
    assert len(scripted.seen) == 1  # the same answer would come again: not retried
    scripted.script(Reply(503, plain, {"Content-Encoding": "deflate"}))  # an error body too
    with Client(base_url=scripted.url, max_retries=0) as client, pytest.raises(APIError, match="Content-Encoding"):
        client.models.list()


@pytest.mark.anyio
async def test_the_async_client_names_an_undecodable_body_too(scripted: Scripted) -> None:
    scripted.script(Reply(200, json.dumps(COMPLETION).encode(), {"Content-Encoding": "gzip"}))
    async with AsyncClient(base_url=scripted.url) as client:
        with pytest.raises(APIError, match="Content-Encoding"):
            await client.completions.create(model="m", prompt="x")
