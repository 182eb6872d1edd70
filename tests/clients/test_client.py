"""The synchronous client against a real server: completions, streams, sessions, WebSocket, errors."""

from __future__ import annotations

import contextlib
import gc
import os
import threading

import pytest
from txlserve_client import (
    APIConnectionError,
    APIError,
    AuthenticationError,
    BadRequestError,
    Client,
    Completion,
    CompletionChunk,
    NotFoundError,
    PayloadTooLargeError,
    Session,
    SessionBusyError,
    SessionRef,
    Stream,
)

from tests.conftest import KeyedServer
from tests.live import LONG, MODEL, LiveServer, wait_for


def wait_for_tokens(client: Client, session_id: str, above: int, timeout: float = 120) -> Session:
    """The session once it holds more than ``above`` tokens (a cancelled run commits in the background)."""
    def grown() -> Session | None:
        s = client.sessions.get(session_id)
        return s if s.tokens_seen > above else None

    return wait_for(grown, timeout, f"session {session_id} to pass {above} tokens")


def test_completion(client: Client) -> None:
    done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, seed=3, logprobs=2)
    assert isinstance(done, Completion)
    assert done.id.startswith("cmpl-") and done.model == MODEL and done.finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (5, 8, 13)
    assert done.usage.cached_tokens == 0 and done.session is None
    assert done.system_fingerprint is not None and done.system_fingerprint == client.models.list()[0].fingerprint
    assert done.logprobs is not None and len(done.logprobs.token_logprobs) == 8
    assert all(len(top) in (2, 3) for top in done.logprobs.top_logprobs)
    again = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, seed=3, logprobs=2)
    assert again.text == done.text  # same seed, same text
    as_ids = client.completions.create(model=MODEL, prompt=list(b"Hello"), max_tokens=8, seed=3)  # byte model
    assert as_ids.text == done.text and as_ids.usage.prompt_tokens == 5
    forced = dict(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logit_bias={"101": 100})
    assert client.completions.create(**forced).text == "eee"
    for penalty in ("frequency_penalty", "presence_penalty"):  # sent: the server refuses one out of range
        with pytest.raises(BadRequestError) as bad:
            client.completions.create(**forced, **{penalty: 5})
        assert bad.value.param == penalty


def test_choices_of_a_batch_and_n(client: Client) -> None:
    """A list of prompts with n gives every choice (``text`` is the first's); a stream's chunks carry theirs."""
    done = client.completions.create(model=MODEL, prompt=["Hello", "Bye"], n=2, max_tokens=4, seed=3, logprobs=0)
    assert [c.index for c in done.choices] == [0, 1, 2, 3] and done.text == done.choices[0].text
    alone = client.completions.create(model=MODEL, prompt="Bye", max_tokens=4, seed=4, logprobs=0)
    assert (done.choices[3].text, done.choices[3].finish_reason) == (alone.text, "length")
    assert done.choices[3].logprobs is not None and alone.logprobs is not None and done.usage.prompt_tokens == 5 + 3
    assert done.choices[3].logprobs.tokens == alone.logprobs.tokens
    assert done.choices[3].logprobs.token_logprobs == pytest.approx(alone.logprobs.token_logprobs, abs=1e-5)
    with client.completions.create(model=MODEL, prompt=["Hello", "Bye"], n=2, max_tokens=4, seed=3,
                                   stream=True) as stream:
        chunks = list(stream)
    for choice in done.choices:
        assert "".join(c.text for c in chunks if c.index == choice.index) == choice.text


def test_streaming_completion(client: Client) -> None:
    with client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, stream=True,
                                   stream_options={"include_usage": True}) as stream:
        assert isinstance(stream, Stream)
        chunks = list(stream)
    assert all(isinstance(c, CompletionChunk) for c in chunks)
    finish = [c for c in chunks if c.finish_reason]
    assert [c.finish_reason for c in finish] == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0)
    assert "".join(c.text for c in chunks) == plain.text
    # read as openai-python's chunks are: a choice each, none in the usage's own last piece
    assert chunks[-1].choices == [] and all(len(c.choices) == 1 for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == plain.text
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == ["length"]
    # extra_body, as OpenAI's SDK takes it: vLLM's fields reach the server; stop_reason says what ended the text
    stop = plain.text[3:5]
    cut = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"min_tokens": 1, "include_stop_str_in_output": True})
    assert cut.choices[0].stop_reason == stop and cut.text.endswith(stop) and cut.finish_reason == "stop"
    with client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, stream=True,
                                   stop=[stop]) as stream:
        ends = [c for c in stream if c.finish_reason]
    assert [(c.finish_reason, c.stop_reason) for c in ends] == [("stop", stop)]
    assert plain.choices[0].stop_reason is None
    # vLLM's return_token_ids: the prompt's ids and the generated ones, on the choice and across a stream's pieces
    ids = {"return_token_ids": True}
    got = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, extra_body=ids)
    assert got.choices[0].prompt_token_ids == list(b"Hello") and bytes(got.choices[0].token_ids).decode() == plain.text
    assert plain.choices[0].token_ids is None
    with client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, stream=True,
                                   extra_body=ids) as stream:
        pieces = list(stream)
    assert pieces[0].prompt_token_ids == list(b"Hello") and all(p.prompt_token_ids is None for p in pieces[1:])
    assert [t for p in pieces for t in p.token_ids or ()] == got.choices[0].token_ids
    with client.ws.connect() as conn:
        pieces = list(conn.completion(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, extra_body=ids))
    assert pieces[0].prompt_token_ids == list(b"Hello") == pieces[0].choices[0].prompt_token_ids
    assert "".join(p.choices[0].text for p in pieces) == plain.text and pieces[-1].choices[0].finish_reason
    assert [t for p in pieces for t in p.token_ids or ()] == got.choices[0].token_ids


def test_session_continues_across_requests(client: Client) -> None:
    """A completion in a session continues the session's text: greedy output equals the same text sent whole."""
    session = client.sessions.create(text="abc")
    assert session.tokens_seen == 3 and session.appended_tokens == 3
    done = client.completions.create(model=MODEL, prompt="de", max_tokens=6, temperature=0, session_id=session.id)
    assert done.session == SessionRef(session.id, 3 + 2 + 6)
    assert done.usage.cached_tokens == 3 and done.usage.prompt_tokens == 2
    whole = client.completions.create(model=MODEL, prompt="abcde", max_tokens=6, temperature=0)
    assert done.text == whole.text
    # an empty prompt continues where the session stopped, streamed this time
    with client.completions.create(model=MODEL, prompt="", max_tokens=4, session_id=session.id,
                                   stream=True) as stream:
        last = list(stream)[-1]
    assert last.session == SessionRef(session.id, 11 + 4)
    assert client.sessions.get(session.id).tokens_seen == 15


def test_sessions_crud_append_fork(client: Client) -> None:
    created = client.sessions.create(text="Once upon a time", metadata={"user": "ada"})
    assert created.metadata == {"user": "ada"} and created.model == MODEL and created.bpc is not None
    got = client.sessions.get(created.id)
    assert isinstance(got, Session) and got.tokens_seen == 16 and got.mem_len > 0 and got.bytes > 0

    appended = client.sessions.append(created.id, " there was")
    assert appended.appended_tokens == 10 and appended.tokens_seen == 26
    assert appended.logprob is not None and appended.logprob < 0

    fork = client.sessions.fork(created.id, metadata={"branch": "b"})
    assert fork.id != created.id and fork.tokens_seen == 26 and fork.metadata == {"branch": "b"}
    client.sessions.append(fork.id, " a fork")
    assert client.sessions.get(fork.id).tokens_seen == 33
    assert client.sessions.fork(fork.id, metadata={}).metadata == {}  # cleared, as the server allows
    assert client.sessions.fork(fork.id).metadata == {"branch": "b"}  # none given: the source's
    assert client.sessions.get(created.id).tokens_seen == 26  # the original is untouched

    updated = client.sessions.update(created.id, metadata={"user": None, "title": "tale"})
    assert isinstance(updated, Session) and updated.metadata == {"title": "tale"} and updated.tokens_seen == 26
    assert client.sessions.get(created.id).metadata == {"title": "tale"}
    for bad in ([("title", "x")], {5: "n"}):  # JSON had made the key 5 "5"
        with pytest.raises(ValueError, match="mapping of str keys"):
            client.sessions.update(created.id, metadata=bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"a str \(session.id\), not Session"):
        client.sessions.update(got, metadata={"title": "x"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'import' is no session's id"):
        client.sessions.update("import", metadata={"title": "x"})
    with pytest.raises(BadRequestError) as bad:
        client.sessions.update(created.id, metadata={"n": 1})  # type: ignore[dict-item]
    assert bad.value.param == "metadata.n"

    deleted = client.sessions.delete(fork.id)
    assert deleted.id == fork.id and deleted.deleted
    with pytest.raises(NotFoundError) as info:
        client.sessions.get(fork.id)
    assert info.value.code == "session_not_found" and info.value.status == 404


def test_a_stream_of_text_holding_unicode_line_separators(client: Client) -> None:
    """U+2028, U+2029 and U+0085 travel raw in the JSON of an SSE event: the stream failed with a JSONDecodeError
    (the client cut lines where str.splitlines does; found by a helper)."""
    prompt = "a\u2028b\u2029c\x85d"
    with client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True, stream=True) as stream:
        text = "".join(chunk.text for chunk in stream)
    assert text.startswith(prompt)


def test_list_pages(keyed_server: KeyedServer) -> None:
    # the third key creates sessions in this test only, so its list is exactly what this test made
    with Client(base_url=keyed_server.url, api_key=keyed_server.keys[2], timeout=30) as client:
        mine = [client.sessions.create(metadata={"n": str(i)}).id for i in range(5)]
        page = client.sessions.list(limit=2)
        assert len(page.data) == 2 and page.has_more and page.next_cursor
        second = page.next_page()
        assert second is not None and {s.id for s in second.data}.isdisjoint(s.id for s in page.data)
        every = [s.id for s in page.iter_all()]
        assert sorted(every) == sorted(mine)  # every page, each session once
        assert [s.id for s in client.sessions.list(limit=2)] == every  # a page iterates all, as OpenAI's SDK's
        last = client.sessions.list(limit=100)
        assert not last.has_more and last.next_cursor is None and last.next_page() is None


def test_closing_a_stream_cancels_and_keeps_what_was_generated(client: Client) -> None:
    session = client.sessions.create(text="abc")
    stream = client.completions.create(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id, stream=True)
    with stream:
        for i, _ in enumerate(stream):
            if i == 3:
                break
    after = wait_for_tokens(client, session.id, above=4)
    assert after.tokens_seen < 4 + LONG  # stopped early...
    done = client.completions.create(model=MODEL, prompt="e", max_tokens=2, session_id=session.id)
    assert done.session == SessionRef(session.id, after.tokens_seen + 3)  # ...and the session goes on


def test_a_stream_closed_from_another_thread_ends_the_readers_loop_and_the_run(grouped_server: LiveServer) -> None:
    """A stop button: ``close()`` while another thread waits in the stream's read raised "generator already
    executing", and the reader read on to the end, the session given every token (found by a helper)."""
    import sys
    import threading

    with Client(base_url=grouped_server.url, timeout=30) as client:
        session = client.sessions.create(text="abc")
        stream = client.completions.create(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id,
                                           stream=True)
        next(stream)  # the next chunk is 100,000 tokens away: the reader waits in a read
        got: dict[str, object] = {}

        def read() -> None:
            try:
                got["rest"] = sum(1 for _ in stream)
            except Exception as err:  # noqa: BLE001 (what it raised is the test's finding)
                got["error"] = err

        reader = threading.Thread(target=read, daemon=True)
        reader.start()

        def reading() -> bool:  # the reader's stack is inside the stream's generator
            frame = sys._current_frames().get(reader.ident or -1)
            while frame is not None and frame.f_code.co_name != "_iter_chunks":
                frame = frame.f_back
            return frame is not None

        wait_for(reading, 30, "the reader to wait in the stream's read")
        stream.close()
        reader.join(30)
        assert not reader.is_alive() and got == {"rest": 0}, got
        after = wait_for_tokens(client, session.id, above=4)
        assert after.tokens_seen < 4 + LONG


def test_a_stream_dropped_after_break_closes_at_once(client: Client) -> None:
    """``for chunk in create(..., stream=True): break`` without ``with``: the stream's generator held the stream, a
    cycle only the cyclic collector freed, so the connection stayed open and the server went on generating into
    the session (13,653 tokens the caller never saw, found by a helper). The collector is off here: the stream
    must close as its last reference goes."""
    session = client.sessions.create(text="abc")
    gc.disable()
    try:
        for _ in client.completions.create(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id,
                                           stream=True):
            break
        after = wait_for_tokens(client, session.id, above=4, timeout=30)  # the cancelled run's commit
    finally:
        gc.enable()
    assert after.tokens_seen < 4 + LONG


@pytest.mark.parametrize("drop", ["stream", "connection"])
def test_a_dropped_websocket_stream_or_connection_closes_at_once(client: Client, drop: str) -> None:
    """``ws.stream`` left by ``break``, or a connection dropped unclosed after one: the server generated on to
    max_tokens into a busy session (found by a helper). With the collector off, each closes as its last reference
    goes."""
    session = client.sessions.create(text="abc")
    gc.disable()
    try:
        if drop == "stream":
            for _ in client.ws.stream(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id):
                break
        else:
            conn = client.ws.connect()
            for _ in conn.completion(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id):
                break
            del conn
        after = wait_for_tokens(client, session.id, above=4, timeout=30)  # the cancelled run's commit
    finally:
        gc.enable()
    assert after.tokens_seen < 4 + LONG


SCRIPT_END = {
    "sync": """
from txlserve_client import Client
c = Client(base_url=URL)
idle = c.ws.connect()
busy = c.ws.connect()
stream = busy.completion(model=MODEL, prompt="a", max_tokens=LONG)
next(stream)
own = c.ws.stream(model=MODEL, prompt="b", max_tokens=LONG)
next(own)
print("end")
""",
    "async": """
import asyncio
from txlserve_client import AsyncClient
async def main():
    async with AsyncClient(base_url=URL) as c:
        async for _ in c.ws.stream(model=MODEL, prompt="a", max_tokens=LONG):
            break
        conn = await c.ws.connect()
        async for _ in conn.completion(model=MODEL, prompt="b", max_tokens=LONG):
            break
        del conn
asyncio.run(main())
print("end")
"""}


@pytest.mark.parametrize("kind", SCRIPT_END)
def test_a_script_that_ends_holding_websockets_exits_cleanly(server: LiveServer, kind: str) -> None:
    """A script that ended with a sync connection (idle, or mid-completion) or ``ws.stream`` still held hung for
    ever: the connection's finalizer closed it at interpreter exit and waited on the websockets library's frozen
    reader thread. An async one that dropped its stream and connection just before ``asyncio.run`` returned left
    their closes to be cancelled there: unclosed sockets (both found by a helper). Dev mode: warnings are errors."""
    import subprocess
    import sys

    from tests.clients.conftest import CLIENT_SRC

    code = f"URL, MODEL, LONG = {server.url!r}, {MODEL!r}, {LONG}\n" + SCRIPT_END[kind]
    done = subprocess.run([sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", code],
                          capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(CLIENT_SRC),
                                                                          "PATH": os.environ.get("PATH", "")})
    assert done.returncode == 0 and done.stdout == "end\n", done.stderr[-3000:]
    assert "Warning" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]


def test_a_websocket_connection_refuses_a_second_thread_plainly(client: Client) -> None:
    """Two threads on one connection cancelled each other's completions, got each other's errors, or failed with
    the websockets library's own ConcurrencyError; the second now gets an APIError and the first runs on."""
    with client.ws.connect() as conn:
        stream = conn.completion(model=MODEL, prompt="Hello", max_tokens=40)
        first = next(stream)
        refused: list[BaseException] = []

        def other() -> None:
            try:
                list(conn.completion(model=MODEL, prompt="x", max_tokens=2))
            except BaseException as err:  # noqa: BLE001 - what the other thread got is the test's
                refused.append(err)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(60)
        assert not thread.is_alive() and len(refused) == 1 and type(refused[0]) is APIError, refused
        assert "another thread" in str(refused[0])
        rest = list(stream)
    assert rest[-1].finish_reason == "length" and rest[-1].usage.completion_tokens == 40 and first.text is not None


def test_concurrent_use_of_a_session_is_refused(client: Client) -> None:
    session = client.sessions.create(text="abc")
    with client.completions.create(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id,
                                   stream=True) as stream:
        next(stream)
        with pytest.raises(SessionBusyError) as info:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, session_id=session.id)
        assert (info.value.status, info.value.code, info.value.type) == (409, "session_busy", "conflict_error")
        assert session.id in info.value.message
        with pytest.raises(SessionBusyError):
            client.sessions.append(session.id, "x")
        with pytest.raises(SessionBusyError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, session_id=session.id, stream=True)
        with client.ws.connect() as conn, pytest.raises(SessionBusyError):  # inside a WebSocket: no status
            list(conn.completion(model=MODEL, prompt="x", max_tokens=2, session_id=session.id))


def test_request_errors(client: Client) -> None:
    with pytest.raises(NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x")
    assert (info.value.code, info.value.param, info.value.status) == ("model_not_found", "model", 404)
    assert "no-such-model" in info.value.message
    with pytest.raises(BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", temperature=5.0)
    assert bad.value.param == "temperature" and bad.value.status == 400
    with pytest.raises(BadRequestError):
        client.completions.create(model=MODEL, prompt="x", stream=True, n=0)
    with pytest.raises(NotFoundError) as missing:
        client.completions.create(model=MODEL, prompt="x", session_id="no-such-session")
    assert (missing.value.code, missing.value.param) == ("session_not_found", "session_id")  # the body's field
    with pytest.raises(NotFoundError):
        client.sessions.append("no-such-session", "x")
    for dots in (".", ".."):  # path segments a URL drops: sent as they were, "." read the session list
        with pytest.raises(NotFoundError) as dotted:
            client.sessions.get(dots)
        assert dotted.value.code == "session_not_found", dotted.value
        with pytest.raises(NotFoundError):
            client.sessions.delete(dots)
    with pytest.raises(PayloadTooLargeError) as big:
        client.completions.create(model=MODEL, prompt="x" * 1_000_001, max_tokens=1)
    assert big.value.status == 413 and big.value.param == "prompt"
    session = client.sessions.create(text="kept")
    for call in (lambda: client.completions.create(model=MODEL, prompt="caf\udce9", session_id=session.id),
                 lambda: client.sessions.append(session.id, "a\ud800")):  # bytes read with surrogateescape
        with pytest.raises(BadRequestError) as lone:  # the server's 400, not UnicodeEncodeError in the client
            call()
        assert lone.value.status == 400 and lone.value.param in ("prompt", "text"), lone.value
    assert client.sessions.get(session.id).tokens_seen == 4


def test_api_keys(keyed_server: KeyedServer) -> None:
    k1, k2, _ = keyed_server.keys
    for key in (None, "wrong"):
        with Client(base_url=keyed_server.url, api_key=key, max_retries=0) as client:
            with pytest.raises(AuthenticationError) as info:
                client.sessions.create()
            assert info.value.status == 401 and info.value.code == "invalid_api_key"
            with pytest.raises(AuthenticationError):
                client.ws.connect()
    with Client(base_url=keyed_server.url, api_key=k1) as one, Client(base_url=keyed_server.url, api_key=k2) as two:
        session = one.sessions.create(text="mine")
        assert one.completions.create(model=MODEL, prompt="x", max_tokens=1, session_id=session.id).session
        with pytest.raises(NotFoundError):  # sessions belong to the key that made them
            two.sessions.get(session.id)
        with one.ws.connect() as conn:
            assert list(conn.completion(model=MODEL, prompt="x", max_tokens=2))[-1].finish_reason == "length"


def test_environment_defaults(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TXLSERVE_BASE_URL", server.url + "/")
    monkeypatch.setenv("TXLSERVE_API_KEY", "from-env")
    with Client() as client:
        assert client.base_url == server.url and client.api_key == "from-env"
        assert [m.id for m in client.models.list()] == [MODEL]


def test_the_openai_sdks_base_url_and_a_session_id_no_header_can_hold(server: LiveServer) -> None:
    """base_url ".../v1", as the OpenAI SDK takes it, names the same server (it had asked /v1/v1/models); an id
    outside ASCII is the server's to refuse (404), not a UnicodeEncodeError while building the routing header."""
    with Client(base_url=server.url + "/v1/", max_retries=0) as client:
        assert client.base_url == server.url and [m.id for m in client.models.list()] == [MODEL]
        with pytest.raises(NotFoundError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, session_id="\u2603")
        for spaced in (" ", "a ", " a"):  # no header holds a space at its ends: an APIConnectionError before
            with pytest.raises(NotFoundError):
                client.completions.create(model=MODEL, prompt="x", max_tokens=1, session_id=spaced)
            with pytest.raises(NotFoundError):
                list(client.completions.create(model=MODEL, prompt="x", max_tokens=1, session_id=spaced,
                                               stream=True))


def test_connection_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with Client(base_url="http://127.0.0.1:9", max_retries=0) as client:
        with pytest.raises(APIConnectionError, match="at http://127.0.0.1:9 "):  # where it tried
            client.models.list()
        with pytest.raises(APIConnectionError, match="at ws://127.0.0.1:9 "):  # (it had not said where)
            client.ws.connect()
    # a WebSocket that could not connect is opened again, as any call that provably did not run (it failed at once)
    with Client(base_url="http://127.0.0.1:9", max_retries=2) as client:
        waits: list[int] = []
        monkeypatch.setattr(client, "_backoff", lambda attempt: waits.append(attempt) or 0.0)
        with pytest.raises(APIConnectionError, match="at ws://127.0.0.1:9 "):
            client.ws.connect()
        assert waits == [0, 1]
        waits.clear()
        with pytest.raises(APIConnectionError):
            next(iter(client.ws.stream(model=MODEL, prompt="x")))
        assert waits == [0, 1]
    # a connection dropped during the handshake (websockets' InvalidMessage) is retried too, as a GET's is
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)

    def drop() -> None:  # each connection closed unanswered, until the test closes the listener
        with contextlib.suppress(OSError):
            while True:
                listener.accept()[0].close()

    threading.Thread(target=drop, daemon=True).start()
    try:
        with Client(base_url=f"http://127.0.0.1:{listener.getsockname()[1]}", max_retries=2) as client:
            waits = []
            monkeypatch.setattr(client, "_backoff", lambda attempt: waits.append(attempt) or 0.0)
            with pytest.raises(APIConnectionError):
                client.ws.connect()
            assert waits == [0, 1]
    finally:
        listener.close()


def test_a_closed_client_and_a_url_that_is_not_one_say_so() -> None:
    with Client(base_url="http://127.0.0.1:9", max_retries=0) as client:
        pass
    with pytest.raises(APIConnectionError, match="this client is closed"):  # httpx's bare RuntimeError before
        client.models.list()
    with pytest.raises(APIConnectionError, match="this client is closed"):  # not a new connection either
        client.ws.connect()
    assert client.is_closed
    # refused when made: "localhost:8000" read as scheme "localhost", and ws.connect() raised a bare ValueError
    with pytest.raises(ValueError, match=r"did you mean 'http://notaurl'\?"):
        Client(base_url="notaurl")
    with pytest.raises(ValueError, match=r"did you mean 'http://localhost:8000'\?"):
        Client(base_url="localhost:8000")


def test_websocket_completions_in_turn_with_cancel(client: Client) -> None:
    session = client.sessions.create(text="abc")
    with client.ws.connect() as conn:
        chunks = list(conn.completion(model=MODEL, prompt="Hello", max_tokens=12, temperature=0))
        plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0)
        assert "".join(c.text for c in chunks) == plain.text
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12

        stream = conn.completion(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id)
        texts = []
        for chunk in stream:
            texts.append(chunk.text)
            if len(texts) == 3:
                conn.cancel()
        last = chunk
        assert last.finish_reason == "cancelled" and stream.done
        assert last.usage.completion_tokens < LONG
        assert last.session == SessionRef(session.id, 3 + 1 + last.usage.completion_tokens)

        # leaving a completion early: the next one on the connection cancels it and starts cleanly
        for _ in conn.completion(model=MODEL, prompt="x", max_tokens=LONG):
            break
        again = list(conn.completion(model=MODEL, prompt="e", max_tokens=3, session_id=session.id))
        assert again[-1].session == SessionRef(session.id, last.session.tokens_seen + 1 + 3)

        # an error answers one request; the connection stays usable
        with pytest.raises(NotFoundError):
            list(conn.completion(model="no-such-model", prompt="x"))
        with pytest.raises(BadRequestError):
            list(conn.completion(model=MODEL, prompt="x", temperature=9))
        assert list(conn.completion(model=MODEL, prompt="x", max_tokens=1))[-1].finish_reason == "length"


def test_a_completion_started_inside_anothers_loop_leaves_that_loop_its_last_tokens(client: Client) -> None:
    """As the async client's test: A's loop read on to its end (finish_reason "cancelled"), its text what its
    session kept."""
    session = client.sessions.create(text="abc")
    with client.ws.connect() as conn:
        first = conn.completion(model=MODEL, prompt="d", max_tokens=LONG, session_id=session.id, temperature=0)
        chunks = []
        for chunk in first:
            chunks.append(chunk)
            if len(chunks) == 2:
                assert list(conn.completion(model=MODEL, prompt="Hi", max_tokens=2))[-1].finish_reason == "length"
        assert chunks[-1].finish_reason == "cancelled" and chunks[-1].usage.completion_tokens < LONG
        made = chunks[-1].usage.completion_tokens
        assert client.sessions.get(session.id).tokens_seen == 3 + 1 + made
        text = "".join(c.text for c in chunks)
    greedy = client.completions.create(model=MODEL, prompt="abcd", max_tokens=made, temperature=0).text
    assert text == greedy  # every token it made, read by its own loop


def test_websocket_one_shot_stream(client: Client) -> None:
    with client.ws.stream(model=MODEL, prompt="Hello", max_tokens=5) as stream:
        chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].session is None
    with client.ws.stream(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,  # as completions.create takes it
                          extra_body={"allowed_token_ids": [ord("q")]}) as stream:
        assert "".join(c.text for c in stream) == "q" * 5
    with client.ws.connect() as conn:
        assert "".join(c.text for c in conn.completion(model=MODEL, prompt="Hi", max_tokens=3,
                                                        extra_body={"allowed_token_ids": [ord("r")]})) == "rrr"
    # stream is the caller's: the answer is read as what was asked for
    done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, extra_body={"stream": True})
    assert done.usage.completion_tokens == 3
    with client.ws.stream(model=MODEL, prompt="Hello", max_tokens=LONG) as stream:
        next(stream)
    assert stream.done  # closing cancelled it and read it to its end


def test_append_with_logprobs_and_completions_name_their_session(client: Client) -> None:
    made = client.sessions.create(text="Once upon")
    got = client.sessions.append(made.id, " a time", logprobs=2)
    assert got.logprobs is not None and len(got.logprobs.token_logprobs) == 7
    assert abs(sum(got.logprobs.token_logprobs) - got.logprob) < 1e-4 and len(got.logprobs.top_logprobs[0]) in (2, 3)
    assert client.sessions.append(made.id, "!").logprobs is None
    out = client.completions.create(model=MODEL, prompt="", max_tokens=3, session_id=made.id)
    assert out.session is not None and out.session.id == made.id and out.session.rebuilt is False


def test_a_websocket_message_over_the_servers_limit_is_payload_too_large(grouped_server: LiveServer) -> None:
    """As over HTTP (413), not a bare APIConnectionError ("received 1009 (message too big)"); a Session given
    whole as the session_id is a TypeError that says what to give, not "AppendResult is not JSON serializable"
    (both found by a helper)."""
    with Client(base_url=grouped_server.url, timeout=30, max_retries=0) as client:
        with client.ws.connect() as conn, pytest.raises(PayloadTooLargeError) as info:
            list(conn.completion(model=MODEL, prompt="x" * 11_000_000, max_tokens=1))  # the limit is 10 MB
        assert info.value.status_code == 413 and "--max-body-bytes" in str(info.value)
        session = client.sessions.create(text="abc")
        with pytest.raises(TypeError, match=r"a str \(session.id\), not AppendResult"):
            client.completions.create(model=MODEL, prompt="x", session_id=session)  # type: ignore[arg-type]


def test_a_websocket_sends_no_pings_of_its_own() -> None:
    """A client that stops reading for a while (a user thinking between tokens) stops reading pongs too: its own
    pings timed out at 40 s and closed the connection with 1011, where an SSE stream waits. The server pings; a
    dead server is found by the read timeout, as over HTTP (measured by hand: a 45 s pause, then the 4,000 tokens
    all read)."""
    from txlserve_client._websocket import Target

    with Client(base_url="http://127.0.0.1:9") as client:
        assert Target.of(client, {}).connect["ping_interval"] is None
