"""``txlserve-chat`` as a user runs it: a real process, its stdin a pipe, against the live server."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from txlserve_client import APIConnectionError, Client, Timeout
from txlserve_client import chat as chat_module
from txlserve_client._types import Session

from tests.clients.conftest import CLIENT_SRC
from tests.clients.scripted_ws import ScriptedWebSocket
from tests.live import LONG, LiveServer
from tests.procs import Streamed

ID = r"[\w-]+"


def chat(server: LiveServer | str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(CLIENT_SRC), "PYTHONUNBUFFERED": "1", **(env or {})}
    url = server if isinstance(server, str) else server.url
    return subprocess.Popen([sys.executable, "-m", "txlserve_client.chat", "--url", url, *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=CLIENT_SRC)


def run_chat(server: LiveServer | str, lines: str | bytes, *args: str,
             env: dict[str, str] | None = None) -> tuple[int, str, str]:
    with chat(server, *args, env=env) as proc:
        out, err = proc.communicate(lines.encode() if isinstance(lines, str) else lines, timeout=60)
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def test_lines_info_fork_new_quit(server: LiveServer, client: Client) -> None:
    rc, out, err = run_chat(server, "hello\n/info\n/fork\n/info\nworld\n/new\n/bogus\n/quit\nnot read\n",
                            "--max-tokens", "8", "--temperature", "0.5")
    assert rc == 0, err
    first = re.search(rf"^session ({ID}) \(0 tokens\)", out, re.M).group(1)
    infos = re.findall(rf"session ({ID}): tokens_seen=(\d+) mem_len=24", out)
    fork = re.search(rf"forked {first} -> ({ID})", out).group(1)
    assert infos == [(first, "14"), (fork, "14")]  # "hello\n" + 8 generated, then the fork's copy
    fresh = re.search(rf"new session ({ID})", out).group(1)
    assert "unknown command /bogus: /info" in out.split(f"new session {fresh}")[1]  # and the help line
    assert out.rstrip().endswith(f"session {fresh}: resume with --session {fresh}")
    assert client.sessions.get(first).tokens_seen == 14
    assert client.sessions.get(fork).tokens_seen == 14 + 6 + 8  # "world\n" went on in the fork
    assert client.sessions.get(fresh).tokens_seen == 0


def test_resume_a_session_and_exit_at_eof(server: LiveServer, client: Client) -> None:
    session = client.sessions.create(text="some text")
    rc, out, _ = run_chat(server, "\n/info\n", "--session", session.id, "--max-tokens", "5")
    assert rc == 0
    assert f"session {session.id} (9 tokens)" in out
    assert f"session {session.id}: tokens_seen=14" in out  # an empty line continued by 5 tokens


def test_a_model_the_server_does_not_serve_is_refused_before_a_session_is_made(server: LiveServer,
                                                                                client: Client) -> None:
    before = [s.id for s in client.sessions.list(limit=100).iter_all()]
    rc, out, err = run_chat(server, "hello\n", "--model", "gpt-4")
    assert rc == 2 and err.startswith("txlserve-chat: error: this server serves ") and out == "", (rc, out, err)
    assert err.endswith(", not 'gpt-4'\n")
    assert [s.id for s in client.sessions.list(limit=100).iter_all()] == before


def test_the_help_reads_as_text() -> None:
    """It showed the docstring's reStructuredText quotes (``txlserve-chat``), and that name under ``txlserve chat``
    (found by a helper)."""
    from txlserve_client.chat import build_parser

    for prog in ("txlserve-chat", "txlserve chat"):
        text = build_parser(prog).format_help()
        assert "``" not in text and f"\n{prog}: continue a session from the terminal." in text, text


def test_a_line_that_starts_with_a_slash_is_sent_after_a_second_one(server: LiveServer, client: Client) -> None:
    session = client.sessions.create(text="x")
    rc, _, err = run_chat(server, "//etc/passwd\n", "--session", session.id, "--max-tokens", "3")
    assert rc == 0, err
    assert client.sessions.get(session.id).tokens_seen == 1 + len("/etc/passwd\n") + 3


def test_bad_sampling_flags_are_refused_before_a_session_is_made(server: LiveServer, client: Client) -> None:
    before = [s.id for s in client.sessions.list(limit=100).iter_all()]
    for flag, value in (("--temperature", "5"), ("--temperature", "nan"), ("--max-tokens", "0")):
        rc, out, err = run_chat(server, "hello\n", flag, value)
        assert rc == 2 and flag in err and out == "", (rc, out, err)
        assert len(err.strip().splitlines()) == 1 and "(see txlserve-chat --help)" in err, err  # as txlserve's
    assert [s.id for s in client.sessions.list(limit=100).iter_all()] == before


def test_max_tokens_over_the_servers_limit_is_refused_before_a_session_is_made(server: LiveServer,
                                                                              client: Client) -> None:
    """The server's card says its limit (``max_tokens_limit``): the chat had made a session, then ended at the
    first line's 400 (found by a helper)."""
    limit = client.models.list()[0].max_tokens_limit
    assert limit == LONG, limit  # as the suite's servers are started
    before = [s.id for s in client.sessions.list(limit=100).iter_all()]
    rc, out, err = run_chat(server, "hello\n", "--max-tokens", str(limit + 1))
    assert rc == 2 and out == "" and err.strip() == (f"txlserve-chat: error: --max-tokens {limit + 1} is over "
                                                     f"this server's limit of {limit}"), (rc, out, err)
    assert [s.id for s in client.sessions.list(limit=100).iter_all()] == before
    rc, _, err = run_chat(server, "", "--max-tokens", str(limit))  # the limit itself is taken
    assert rc == 0, err


def test_the_default_max_tokens_is_the_servers_limit_where_that_is_lower(fuzz_server: LiveServer) -> None:
    """A server whose limit is under the chat's default of 200 (the fuzzers' server takes 32): a chat started
    without --max-tokens had every line refused over a flag the user never gave."""
    rc, out, err = run_chat(fuzz_server, "hi\n")
    assert rc == 0, err
    session_id = re.search(rf"^session ({ID}) \(0 tokens\)", out, re.M).group(1)
    with Client(base_url=fuzz_server.url, timeout=30) as client:
        assert client.sessions.get(session_id).tokens_seen == len("hi\n") + 32


def test_a_flag_an_older_server_refuses_ends_the_chat_with_the_way_back(monkeypatch) -> None:
    """A server that does not say its limit refuses every line with the same 400: the chat ends at the first, with
    the way back (its exit status had been 0 after one error a line)."""
    from txlserve_client._exceptions import error_from_body

    sent = []

    class OlderServersConnection:  # the chat's WebSocket to it (a fake of the client's own seam)
        def completion(self, **body: object) -> Iterator[object]:
            sent.append(body["prompt"])
            raise error_from_body({"error": {"message": "max_tokens must be at most 4096", "code": None,
                                             "type": "invalid_request_error", "param": "max_tokens"}}, 400)
            yield  # a generator: it raises on its first next(), as a stream the server refused

        def close(self) -> None:
            pass

    with Client(base_url="http://older.invalid") as client:
        monkeypatch.setattr(client.ws, "connect", OlderServersConnection)
        session = Session("s-1", "m", 0, 8, 0, "hot", 0, 0)
        out, err = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nagain\n"))
        args = chat_module.build_parser("txlserve-chat").parse_args(["--max-tokens", "100000"])
        rc = chat_module.Chat(client, "m", session, args, out=out, err=err).run()
    assert rc == 2 and sent == ["hello\n"], (rc, sent)  # the second line was not sent
    assert err.getvalue().count("error: ") == 1 and "max_tokens" in err.getvalue(), err.getvalue()
    assert "resume with --session s-1 and another --max-tokens" in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("failure", ["server", "gone"])
def test_an_error_mid_line_is_said_on_a_line_of_its_own(monkeypatch, failure: str) -> None:
    """A server that failed (or went) after some of a line's tokens: the error, or the way back, was printed on
    the same line as the last token ("...He would be in prayesession ...: resume with ..."; found by a helper)."""
    from txlserve_client import APIConnectionError, CompletionChunk
    from txlserve_client._exceptions import error_from_body

    class FailingConnection:  # the chat's WebSocket (a fake of the client's own seam)
        def completion(self, **body: object) -> Iterator[object]:
            yield CompletionChunk("c-1", "He would be in praye")
            if failure == "server":
                raise error_from_body({"error": {"message": "the engine failed", "type": "server_error"}}, 500)
            raise APIConnectionError("the WebSocket closed")

        def close(self) -> None:
            pass

    with Client(base_url="http://failing.invalid") as client:
        monkeypatch.setattr(client.ws, "connect", FailingConnection)
        out = io.StringIO()  # stdout and stderr, as a terminal shows them: one screen
        monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
        chat = chat_module.Chat(client, "m", Session("s-1", "m", 0, 8, 0, "hot", 0, 0),
                                chat_module.build_parser().parse_args([]), out=out, err=out)
        if failure == "server":
            chat.run()
            assert "He would be in praye\nerror: 500" in out.getvalue(), out.getvalue()
        else:
            with pytest.raises(APIConnectionError):
                chat.run()
            assert "He would be in praye\nsession s-1: resume with --session s-1 once" in out.getvalue(), out.getvalue()


def test_a_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(server: LiveServer, client: Client) -> None:
    """Bytes that are not UTF-8 (a Latin-1 terminal) had ended the program with UnicodeEncodeError from inside the
    client, or UnicodeDecodeError where stdin's errors were strict (PYTHONIOENCODING=utf-8)."""
    for env in ({}, {"PYTHONIOENCODING": "utf-8"}):
        session = client.sessions.create(text="x")
        rc, _, err = run_chat(server, b"caf\xe9\nok\n", "--session", session.id, "--max-tokens", "3", env=env)
        assert rc == 0 and "Traceback" not in err, err
        assert "error: " in err and "not valid Unicode" in err, err  # the server's 400, one line
        assert client.sessions.get(session.id).tokens_seen == 1 + len("ok\n") + 3  # the bad line fed nothing


def test_unknown_session_is_an_error(server: LiveServer, client: Client) -> None:
    rc, _, err = run_chat(server, "", "--session", "no-such-session")
    assert rc == 2 and "404" in err and "not found" in err  # 2, as `txlserve session` exits
    # an empty id (--session "$SID", SID unset) is a usage error: it had started a new session, as if none were given
    before = sum(1 for _ in client.sessions.list().iter_all())
    rc, _, err = run_chat(server, "hi\n", "--session", "")
    assert rc == 2 and "argument --session: an empty session id" in err, err
    assert sum(1 for _ in client.sessions.list().iter_all()) == before


@contextlib.contextmanager
def _ctrl_c_mid_line(url: str) -> Iterator[tuple[Streamed, str]]:
    """A chat, and its session's id, given Ctrl-C while its first line ("hello") streams."""
    env = {**os.environ, "PYTHONPATH": str(CLIENT_SRC), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "txlserve_client.chat", "--url", url, "--max-tokens", "4000"]
    # Ctrl-C as a terminal delivers it: a test run started in the background (`cmd &` in a script) has SIGINT
    # ignored, which a child inherits, and Python then never raises KeyboardInterrupt; a handled signal is
    # reset to its default in the child (no preexec_fn: this process has threads)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        chat = Streamed(cmd, env=env, cwd=CLIENT_SRC)
    finally:
        signal.signal(signal.SIGINT, inherited)
    with chat as chat_proc:
        chat_proc.wait_for(b"> ")
        header = bytes(chat_proc.out)
        session_id = re.search(rf"session ({ID})".encode(), header).group(1).decode()
        chat_proc.write(b"hello\n")
        chat_proc.wait_until(lambda out: len(out) >= len(header) + 3, 120, "the continuation streaming")
        chat_proc.proc.send_signal(signal.SIGINT)
        yield chat_proc, session_id


def test_ctrl_c_cancels_the_generation_not_the_program(server: LiveServer, client: Client) -> None:
    with _ctrl_c_mid_line(server.url) as (chat_proc, session_id):
        chat_proc.wait_for(b" tokens kept, as shown]\n> ")
        kept = int(re.search(rb"\[cancelled: (\d+) tokens kept, as shown\]", bytes(chat_proc.out)).group(1))
        chat_proc.close_stdin()  # then EOF: the program leaves on its own
        assert chat_proc.wait(timeout=60) == 0
    # the session holds "hello\n" and exactly the tokens the chat got (closing an SSE stream had left it those the
    # server made before it noticed: one or more past the screen, found by a helper)
    assert 0 < kept < 4000 and client.sessions.get(session_id).tokens_seen == len("hello\n") + kept


def test_an_empty_line_first_asks_for_text(server: LiveServer, client: Client) -> None:
    """A new session's first line empty was the server's 400, "no session, or an empty one", to a user in one."""
    rc, out, err = run_chat(server, "\nhello\n", "--max-tokens", "3")
    assert rc == 0 and err == "" and "nothing to continue yet: type some text first" in out, (out, err)
    session_id = re.search(rf"^session ({ID}) \(0 tokens\)", out, re.M).group(1)
    assert client.sessions.get(session_id).tokens_seen == len("hello\n") + 3


def test_the_help_lists_the_chats_commands() -> None:
    """They were printed only once the chat had started (found by a helper)."""
    text = chat_module.build_parser("txlserve chat").format_help()
    for command in ("/info", "/fork", "/new", "/quit", "//..."):
        assert f"\n  {command} " in text, (command, text)
    assert "as /exit" in text


def test_a_server_gone_mid_chat_leaves_the_way_back(checkpoint, redis_url, tmp_path) -> None:
    """The server's end was an error line alone: the line that says how to resume the session was skipped. A
    server restarted between two lines is found again (the chat's WebSocket to the old one is opened anew)."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path / "srv").start()
    try:
        env = {**os.environ, "PYTHONPATH": str(CLIENT_SRC), "PYTHONUNBUFFERED": "1"}
        with Streamed([sys.executable, "-m", "txlserve_client.chat", "--url", srv.url, "--max-tokens", "4"],
                      env=env, cwd=CLIENT_SRC) as chat_proc:
            chat_proc.wait_for(b"> ")
            session_id = re.search(rf"session ({ID})".encode(), bytes(chat_proc.out)).group(1).decode()
            for line in (b"hello\n", b"again\n"):
                before = bytes(chat_proc.out).count(b"> ")
                chat_proc.write(line)
                chat_proc.wait_until(lambda out, n=before: out.count(b"> ") > n, 120, "the line's continuation")
                if line == b"hello\n":
                    srv.stop()
                    srv.start()
            with httpx.Client(base_url=srv.url, timeout=30) as http:
                assert http.get(f"/v1/sessions/{session_id}").json()["tokens_seen"] == 2 * 4 + len("hello\nagain\n")
            srv.stop()
            chat_proc.write(b"hello\n")
            assert chat_proc.wait(timeout=120) == 2
            assert f"session {session_id}: resume with --session {session_id}" in chat_proc.out.decode()
            assert b"could not talk to the txlserve server" in chat_proc.proc.stderr.read()
    finally:
        srv.stop()


class _PressingConnection:
    """The chat's WebSocket (a fake of the client's own seam) on which Ctrl-C lands at a chosen moment: while the
    connection opens, as the completion is sent, or twice while tokens stream."""

    def __init__(self, chat: chat_module.Chat, when: str) -> None:
        self.chat, self.when, self.sent, self.cancels = chat, when, [], 0
        if when == "connecting":
            chat._on_ctrl_c(signal.SIGINT, None)
            chat._on_ctrl_c(signal.SIGINT, None)

    def completion(self, **body: object) -> Iterator[object]:
        from txlserve_client._types import CompletionChunk, SessionRef, Usage

        self.sent.append(body["prompt"])
        conn = self

        class Stream:
            done = False

            def cancel(self) -> None:
                conn.cancels += 1

            def __iter__(self) -> Stream:
                return self

            def __next__(self) -> CompletionChunk:
                if self.done:
                    raise StopIteration
                if conn.when == "streaming" and not conn.cancels:
                    conn.chat._on_ctrl_c(signal.SIGINT, None)
                    conn.chat._on_ctrl_c(signal.SIGINT, None)  # a second press: no KeyboardInterrupt
                    return CompletionChunk("c", "ab")
                self.done = True
                return CompletionChunk("c", "", "cancelled", Usage(3, 2, 5), SessionRef("s-1", 5))

        if self.when == "sending":
            self.chat._on_ctrl_c(signal.SIGINT, None)  # before the chat holds the stream
        return Stream()

    def close(self) -> None:
        pass


def test_ctrl_c_cancels_whenever_it_lands_after_the_prompt(monkeypatch) -> None:
    """A press while the connection opened was lost (the whole generation ran), and a second press while the cancel
    drained quit with the session holding tokens never shown (both found by a helper)."""
    for when, sent, cancels, says in (("connecting", [], 0, " [cancelled: the line was not added]\n"),
                                      ("sending", ["hi\n"], 1, " [cancelled: 2 tokens kept, as shown]\n"),
                                      ("streaming", ["hi\n"], 1, "ab [cancelled: 2 tokens kept, as shown]\n")):
        with Client(base_url="http://fake.invalid") as client:
            out = io.StringIO()
            chat = chat_module.Chat(client, "m", Session("s-1", "m", 3, 8, 0, "hot", 0, 0),
                                    chat_module.build_parser().parse_args([]), out=out, err=io.StringIO())
            conns = []
            monkeypatch.setattr(client.ws, "connect", lambda conns=conns, chat=chat, when=when: conns.append(
                _PressingConnection(chat, when)) or conns[-1])
            chat.generate("hi\n")
            with pytest.raises(KeyboardInterrupt):  # between lines (a command's call, the prompt): Python's own
                chat._on_ctrl_c(signal.SIGINT, None)
        assert (conns[0].sent, conns[0].cancels, out.getvalue()) == (sent, cancels, says), when


def test_a_terminal_keeps_the_chats_output_on_ctrl_c(monkeypatch) -> None:
    """A terminal's Ctrl-C flushed output not yet shown: a token vanished from the screen that the session kept."""
    termios = pytest.importorskip("termios")
    import pty

    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "r", closefd=False) as tty:
            monkeypatch.setattr(sys, "stdin", tty)
            assert not termios.tcgetattr(follower)[3] & termios.NOFLSH
            with chat_module._output_kept_on_ctrl_c():
                assert termios.tcgetattr(follower)[3] & termios.NOFLSH
            assert not termios.tcgetattr(follower)[3] & termios.NOFLSH
    finally:
        os.close(leader)
        os.close(follower)


class _NoWebSocketProxy:
    """A reverse proxy as nginx is without its WebSocket lines: it forwards HTTP and drops the hop-by-hop Upgrade
    and Connection headers, so that the server answers the chat's handshake with its 426."""

    def __init__(self, upstream: str) -> None:
        import socket
        import threading

        host, port = httpx.URL(upstream).host, httpx.URL(upstream).port
        self.upstream, self.socks, self.threads = (host, port), [], []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stopping = threading.Event()
        self._spawn(self._accept)

    def _spawn(self, target, *args) -> None:
        import threading

        t = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(t)
        t.start()

    def _accept(self) -> None:
        import socket

        while not self.stopping.is_set():
            try:
                client, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            server = socket.create_connection(self.upstream, timeout=10)
            server.settimeout(None)
            self.socks += [client, server]
            self._spawn(self._forward, client, server, True)
            self._spawn(self._forward, server, client, False)

    @staticmethod
    def _forward(src, dst, first_head: bool) -> None:
        head = first_head
        buf = b""
        try:
            while data := src.recv(65536):
                if head:  # the first request's head, as the proxy passes it on
                    buf += data
                    if b"\r\n\r\n" not in buf:
                        continue
                    lines, rest = buf.split(b"\r\n\r\n", 1)
                    kept = [h for h in lines.split(b"\r\n") if not h.lower().startswith((b"upgrade:", b"connection:"))]
                    data, head = b"\r\n".join(kept) + b"\r\n\r\n" + rest, False
                dst.sendall(data)
        except OSError:
            pass
        finally:
            import socket

            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def __enter__(self) -> _NoWebSocketProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        import socket

        self.stopping.set()
        self.listener.close()
        for s in self.socks:  # a shutdown wakes a thread's recv, which a close alone does not
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self.threads:
            t.join(timeout=10)
            assert not t.is_alive(), "a proxy thread outlived its sockets"


def test_a_proxy_that_drops_websockets_streams_the_lines_over_http(server: LiveServer, client: Client) -> None:
    """Every line had been refused with the WebSocket's 426 where a proxy did not pass WebSockets."""
    with _NoWebSocketProxy(server.url) as proxy:
        rc, out, err = run_chat(proxy.url, "hello\n\n/info\n", "--max-tokens", "5")
    assert rc == 0, err
    assert err.count("note: the server's WebSocket is out of reach (426") == 1, err  # said once, not per line
    session_id = re.search(rf"^session ({ID}) \(0 tokens\)", out, re.M).group(1)
    assert f"session {session_id}: tokens_seen={len('hello') + 1 + 5 + 5} " in out, out
    assert client.sessions.get(session_id).tokens_seen == len("hello\n") + 5 + 5


def test_ctrl_c_over_http_cancels_the_line_and_the_chat_goes_on(server: LiveServer, client: Client) -> None:
    with _NoWebSocketProxy(server.url) as proxy, _ctrl_c_mid_line(proxy.url) as (chat_proc, session_id):
        chat_proc.wait_for(b" [cancelled]\n> ")
        chat_proc.write(b"/info\n")  # the chat goes on: the server's count, once its commit is done
        chat_proc.wait_until(lambda out: re.search(rb"tokens_seen=(\d+) ", out), 60, "/info's answer")
        chat_proc.close_stdin()
        assert chat_proc.wait(timeout=60) == 0
    seen = client.sessions.get(session_id).tokens_seen
    assert len("hello\n") < seen < len("hello\n") + 4000  # stopped: some tokens, not all of them


@pytest.mark.parametrize("cut", ["dropped", "silent"])
def test_a_line_the_server_may_have_read_is_not_sent_again(cut: str) -> None:
    """A connection that broke (a proxy that cut it) or stayed silent past the read timeout after the line left:
    the chat opened another and sent the line again, which the server may already have fed to the session (a
    review's finding). Only a connection found closed as the line was sent is opened again (the test above)."""
    prompts = []

    async def handler(ws) -> None:
        async for raw in ws:
            prompts.append(json.loads(raw)["prompt"])
            if cut == "dropped":
                ws.transport.abort()  # as a proxy drops it: no close frame
                return

    with ScriptedWebSocket(handler) as server, \
            Client(base_url=server.url, timeout=Timeout(0.3, connect=5), max_retries=0) as client:
        chat = chat_module.Chat(client, "m", Session("s-1", "m", 3, 8, 0, "hot", 0, 0),
                                chat_module.build_parser().parse_args([]), out=io.StringIO(), err=io.StringIO())
        with pytest.raises(APIConnectionError):
            chat.generate("hi\n")
        assert server.wait_ended(1)
    assert prompts == ["hi\n"]
