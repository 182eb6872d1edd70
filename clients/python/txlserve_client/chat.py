"""``txlserve-chat``: continue a session from the terminal.

Each line you type is added to the session (with its newline) and the model's continuation
streams back; an empty line asks for more of the same. Ctrl-C during a generation stops it (the
session keeps exactly what was shown); Ctrl-C or Ctrl-D at the prompt quits. The session persists
on the server: come back to it with ``--session ID``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import signal
import sys
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, NoReturn, TextIO

from txlserve_client._client import Client
from txlserve_client._exceptions import APIConnectionError, APIError, RequestCancelledError, SessionBusyError
from txlserve_client._streaming import Stream
from txlserve_client._types import CompletionChunk, Session
from txlserve_client._websocket import WebSocketConnection, WebSocketStream

# a model's output must not drive the terminal: C0 controls (ESC above all) but newline and tab are dropped
_CONTROLS = dict.fromkeys(c for c in range(32) if c not in (9, 10)) | {127: None}
HELP = ("/info  the session   /fork  fork it and go on in the fork   /new  a fresh session   /quit  leave   "
        "//...  a line that starts with /")
COMMANDS = """in the chat:
  /info     the session: its tokens, memory, tier and model
  /fork     fork the session and go on in the fork (the original stays as it was)
  /new      a fresh session
  /quit     leave (as /exit, Ctrl-D, or Ctrl-C at the prompt)
  //...     send a line that starts with / (the first slash is dropped)"""
MAX_TOKENS = 200  # a line's continuation, unless --max-tokens says otherwise
BUSY_WAIT_S = 5.0  # after a cancel the server commits in the background; a 409 until then is worth waiting out
# a WebSocket handshake answered so, by a server whose HTTP API answers, is a proxy's doing (or the server's own 426
# to a request a proxy stripped of its Upgrade header): 401, 403 (a key, an origin) and 429/503 are the server's
_NO_WEBSOCKET = (400, 404, 405, 426, 501, 502)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line pointing at --help, as `txlserve`'s other commands print them."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(prog: str = "txlserve-chat") -> argparse.ArgumentParser:
    about = __doc__.replace("``txlserve-chat``", prog).replace("``", "")  # as the terminal shows it, not as rST
    p = _Parser(prog=prog, description=about, epilog=COMMANDS, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--session", type=_session_id, default=None, help="continue this session (default: create one)")
    p.add_argument("--url", default=None, help="server URL (default: $TXLSERVE_BASE_URL or http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help="default: $TXLSERVE_API_KEY")
    p.add_argument("--model", default=None, help="default: the server's model")
    p.add_argument("--max-tokens", type=_bounded(int, 1, None), default=None,
                   help=f"per line (default: {MAX_TOKENS}, or the server's limit where that is lower)")
    p.add_argument("--temperature", type=_bounded(float, 0.0, 2.0), default=0.8, help="0 to 2 (default: 0.8)")
    return p


def _session_id(text: str) -> str:
    """An empty id (``--session "$SID"`` with SID unset) had started a new session, as if none were given."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty session id (leave --session out to create a session)")
    return text


def _bounded(kind: Callable[[str], float], lo: float, hi: float | None) -> Callable[[str], float]:
    """Refused when the command starts, not at the first line typed (the server would refuse it then)."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (lo <= value and (hi is None or value <= hi)):  # NaN fails too
            raise argparse.ArgumentTypeError(f"{text} is not from {lo:g} to {hi:g}" if hi is not None else
                                             f"{text} is less than {lo:g}")
        return value
    return parse


_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature"}  # request field: flag (--model: checked first)


@contextlib.contextmanager
def _on_ctrl_c(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for SIGINT meanwhile, where this is the main thread (elsewhere Ctrl-C stays as it was)."""
    try:
        before = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@contextlib.contextmanager
def _output_kept_on_ctrl_c() -> Iterator[None]:
    """A terminal's Ctrl-C flushes the output it has not yet shown (unless NOFLSH): a token the chat had written
    vanished from the screen while the session kept it, "as shown" off by one (1 press in 10, found by a
    helper). Set meanwhile where stdin is a terminal."""
    try:
        import termios
    except ImportError:  # not POSIX
        yield
        return
    try:
        fd = sys.stdin.fileno()
        before = termios.tcgetattr(fd)
    except (termios.error, OSError, ValueError):  # not a terminal
        yield
        return
    kept = list(before)
    kept[3] |= termios.NOFLSH  # local modes
    try:
        termios.tcsetattr(fd, termios.TCSANOW, kept)
        yield
    finally:
        with contextlib.suppress(OSError):
            termios.tcsetattr(fd, termios.TCSANOW, before)


class Chat:
    """Each line is a completion over one WebSocket, whose cancel (Ctrl-C) stops the generation where the user
    saw it: over an SSE stream, closing it left the session the tokens generated before the server noticed, one
    or more past the screen, and the next line joined them mid-word (found by a helper). Where a proxy does not
    pass WebSockets, lines stream over SSE after all (said once), rather than every line being refused."""

    def __init__(self, client: Client, model: str, session: Session, args: argparse.Namespace,
                 out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        self.client, self.model, self.session, self.args, self.out, self.err = client, model, session, args, out, err
        self.seen = session.tokens_seen  # the session's tokens, as its completions report them
        self._conn: WebSocketConnection | None = None
        self._stream: WebSocketStream | Stream | None = None  # the generation running, for Ctrl-C's cancel
        self._sse = False  # the WebSocket was out of reach: lines stream over HTTP
        self._generating = False  # Ctrl-C cancels the line's generation while it runs, and elsewhere quits
        self._pressed = False  # Ctrl-C since the line was entered

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def run(self) -> int:
        if sys.stdin.isatty():
            with contextlib.suppress(ImportError):  # line editing and history where the platform has it
                import readline  # noqa: F401
        self.say(f"session {self.session.id} ({self.session.tokens_seen} tokens). {HELP}")
        try:
            with _on_ctrl_c(self._on_ctrl_c), _output_kept_on_ctrl_c():
                return self._lines()
        finally:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.close()

    def _on_ctrl_c(self, sig: int, frame: Any) -> None:
        """During a line's generation, cancel it, once: one pressed before the stream existed (the connection
        still opening) was lost and the whole generation ran, and a second one quit while the cancel drained,
        leaving the session tokens never shown (both found by a helper). Further presses wait for the drain,
        which ends within a decode step. Elsewhere (the prompt, a command), as Python's own Ctrl-C."""
        if not self._generating:
            raise KeyboardInterrupt
        if not self._pressed:
            self._pressed = True
            if self._sse:  # an HTTP stream's cancel is its close: out of the read it waits in, in generate()
                raise KeyboardInterrupt
            if self._stream is not None and not isinstance(self._stream, Stream):  # Stream: over HTTP, above
                self._stream.cancel()

    def _lines(self) -> int:
        while True:
            self._pressed = False
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                self.say("")
                break
            command = line.strip()
            if command in ("/quit", "/exit"):
                break
            try:
                if command.startswith("/") and not command.startswith("//"):
                    self.command(command)
                else:  # "//..." sends the line from its second slash on
                    text = line.lstrip()[1:] if command.startswith("//") else line
                    self.generate(text + "\n" if text else "")
            except APIConnectionError:  # the server is gone: main() reports it and leaves, after the way back
                self.say(f"session {self.session.id}: resume with --session {self.session.id} once the server "
                         f"is back")
                raise
            except APIError as err:
                print(f"error: {err}", file=self.err, flush=True)
                if err.status == 400 and err.param in _FLAGS:  # every line would be refused the same way
                    self.say(f"session {self.session.id}: resume with --session {self.session.id} and another "
                             f"{_FLAGS[err.param]}")
                    return 2
        self.say(f"session {self.session.id}: resume with --session {self.session.id}")
        return 0

    def command(self, command: str) -> None:
        if command == "/info":
            s = self.client.sessions.get(self.session.id)
            self.seen = s.tokens_seen
            self.say(f"session {s.id}: tokens_seen={s.tokens_seen} mem_len={s.mem_len} bytes={s.bytes} "
                     f"tier={s.tier} model={s.model}")
        elif command == "/fork":
            fork = self.client.sessions.fork(self.session.id)
            self.say(f"forked {self.session.id} -> {fork.id}")
            self.session, self.seen = fork, fork.tokens_seen
        elif command == "/new":
            self.session, self.seen = self.client.sessions.create(), 0
            self.say(f"new session {self.session.id}")
        else:
            self.say(f"unknown command {command.split()[0]}: {HELP}")

    def generate(self, prompt: str) -> None:
        if not prompt and not self.seen:  # the server's 400 spoke of "no session" to a user in one
            self.say("nothing to continue yet: type some text first (an empty line continues what the session "
                     "holds)")
            return
        at_line_start, end, sent, closed = True, None, False, False
        self._generating = True
        chunks = self._chunks(prompt)
        try:
            for chunk in chunks:
                sent = True
                if chunk.text:
                    self.out.write(chunk.text.translate(_CONTROLS) if self.out.isatty() else chunk.text)
                    self.out.flush()
                    at_line_start = chunk.text.endswith("\n")
                if chunk.finish_reason is not None:
                    end = chunk
        except RequestCancelledError:  # Ctrl-C while the line was read: nothing was stored
            sent = False
        except APIError:  # the server failed or went mid-line: what says so starts a line of its own, not after the
            if not at_line_start:  # last token shown (found by a helper)
                self.out.write("\n")
                self.out.flush()
            raise
        except KeyboardInterrupt:
            if not (self._sse and self._pressed):
                raise
            closed = True
        finally:
            chunks.close()
            if isinstance(self._stream, Stream):  # an HTTP stream's response, where Ctrl-C left it
                self._stream.close()
            self._stream, self._generating = None, False
        if closed:  # the server stops once it notices: what it made by then is the session's, shown or not
            with contextlib.suppress(APIError):
                self.seen = self.client.sessions.get(self.session.id).tokens_seen
            self.out.write(" [cancelled]")
            at_line_start = False
        if not sent and self._pressed and not closed:
            self.out.write(" [cancelled: the line was not added]")
            at_line_start = False
        if end is not None and end.session is not None:
            self.seen = end.session.tokens_seen
        if end is not None and end.finish_reason == "cancelled":
            kept = end.usage.completion_tokens if end.usage is not None else None
            self.out.write(" [cancelled]" if kept is None else f" [cancelled: {kept} tokens kept, as shown]")
            at_line_start = False
        if not at_line_start:
            self.out.write("\n")
        self.out.flush()

    def _chunks(self, prompt: str) -> Generator[CompletionChunk, None, None]:
        """The completion's chunks, on the chat's connection: a busy session (a cancelled run still committing)
        is asked again for a few seconds, and a connection found closed as the line was sent (a server restarted
        between two lines) is opened again once; either before anything was generated. A connection that broke
        or timed out after the line left is not: the server may have read the line (a proxy that cut the
        connection then), and it was fed twice (a review's finding)."""
        deadline, reopened = time.monotonic() + BUSY_WAIT_S, False
        while True:
            unsent = True  # until the line has left: a failure before then provably fed the session nothing
            try:
                self._stream = self._send(prompt)
                unsent = False
                if self._stream is None:  # Ctrl-C before it was sent: nothing is
                    return
                first = next(self._stream, None)
            except SessionBusyError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
                continue
            except APIConnectionError:
                if self._conn is not None:
                    with contextlib.suppress(Exception):
                        self._conn.close()
                    self._conn = None
                if reopened or self._sse or not unsent:  # an HTTP request may have reached the server, and so
                    raise  # may a line sent on a WebSocket: never sent twice
                reopened = True
                continue
            if first is not None:
                yield first
            yield from self._stream
            return

    def _send(self, prompt: str) -> WebSocketStream | Stream | None:
        """The line's completion, sent on the chat's WebSocket, opened the first time (or over HTTP where a proxy
        refused the WebSocket); None where Ctrl-C came first."""
        if self._conn is None and not self._sse:
            try:
                self._conn = self.client.ws.connect()
            except APIError as err:
                if err.status not in _NO_WEBSOCKET:  # a connection error has none
                    raise
                self._sse = True
                print(f"note: the server's WebSocket is out of reach ({err.status}: a proxy that does not pass "
                      f"WebSockets?); lines stream over HTTP instead, where Ctrl-C can leave the session a few "
                      f"tokens past the screen", file=self.err, flush=True)
        if self._pressed:
            return None
        body = dict(model=self.model, prompt=prompt, max_tokens=self.args.max_tokens,
                    temperature=self.args.temperature, session_id=self.session.id)
        if self._sse:
            return self.client.completions.create(**body, stream=True)
        assert self._conn is not None  # opened above, unless the lines go over HTTP
        stream = self._conn.completion(**body)
        if self._pressed:  # pressed as it was sent, before the handler could see the stream
            with contextlib.suppress(APIConnectionError):  # the line left: its read says so (_chunks resends none)
                stream.cancel()
        return stream


def main(argv: Sequence[str] | None = None, prog: str = "txlserve-chat") -> int:
    args = build_parser(prog).parse_args(argv)
    if isinstance(sys.stdin, io.TextIOWrapper):  # bytes that are not UTF-8 reach the server, which says so
        sys.stdin.reconfigure(errors="surrogateescape")
    try:
        client = Client(base_url=args.url, api_key=args.api_key)
    except ValueError as err:  # a key no header can carry: said without quoting it
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    try:
        with client:
            cards = {m.id: m for m in client.models.list()}
            if args.model is not None and args.model not in cards:  # before a session is made for nothing
                print(f"{prog}: error: this server serves {', '.join(cards)}, not {args.model!r}", file=sys.stderr)
                return 2
            model = args.model or next(iter(cards))
            limit = cards[model].max_tokens_limit
            if args.max_tokens is None:  # a default the server refuses is not the user's to mend
                args.max_tokens = min(MAX_TOKENS, limit or MAX_TOKENS)
            elif limit is not None and args.max_tokens > limit:  # every line would be refused
                print(f"{prog}: error: --max-tokens {args.max_tokens} is over this server's limit of {limit}",
                      file=sys.stderr)
                return 2
            session = client.sessions.get(args.session) if args.session is not None else client.sessions.create()
            return Chat(client, model, session, args).run()
    except APIError as err:  # the server refused or is gone: one line, status 2 as `txlserve session` exits
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
