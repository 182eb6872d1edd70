"""A small scripted HTTP server on a real socket, for what the live server cannot be made to do on cue: answer 503
then 200, stall, drop a connection after reading a request. It records what each request carried."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMPLETION = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                        "prompt_tokens_details": {"cached_tokens": 0}}}
CHUNK = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]}
SESSION = {"id": "s1", "object": "session", "model": "m", "tokens_seen": 3, "mem_len": 24, "bytes": 10,
           "tier": "hot", "created_at": 1, "last_used_at": 1, "metadata": {}}
APPENDED = {**SESSION, "appended_tokens": 3}


def error(status: int, type_: str, code: str, retry_after: str | None = "0") -> Reply:
    body = {"error": {"message": f"{code} now", "type": type_, "param": None, "code": code}}
    return Reply(status, json.dumps(body).encode(), {"Retry-After": retry_after} if retry_after else {})


def unavailable(retry_after: str | None = "0") -> Reply:
    return error(503, "service_unavailable_error", "store_unavailable", retry_after)


def sse(*events: object) -> Reply:
    data = b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)
    return Reply(200, data, {"Content-Type": "text/event-stream"})


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    drop: bool = False  # close the connection without an answer: the request ran, its answer was lost


@dataclass
class Seen:
    method: str
    path: str  # with its query
    at: float
    headers: list[tuple[str, str]] = field(default_factory=list)  # as sent, names' case kept, repeats and all
    body: bytes = b""

    def header(self, name: str) -> list[str]:
        """Every value sent under ``name``, whatever its case."""
        return [v for k, v in self.headers if k.lower() == name.lower()]


class Scripted:
    """Answers each request with the next scripted reply (the last one repeats) and records it."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.seen: list[Seen] = []
        script = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                script.seen.append(Seen(self.command, self.path, time.monotonic(), list(self.headers.items()), body))
                reply = script.replies.pop(0) if len(script.replies) > 1 else script.replies[0]
                time.sleep(reply.delay)  # bounded: the scripted server's slow reply is what the test is about
                if reply.drop:
                    self.close_connection = True
                    return
                self.send_response(reply.status)
                for k, v in {"Content-Type": "application/json", **reply.headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client that timed out
                    self.wfile.write(reply.body)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def script(self, *replies: Reply) -> Scripted:
        self.replies, self.seen = list(replies), []
        return self

    def gaps(self) -> list[float]:
        return [b.at - a.at for a, b in zip(self.seen, self.seen[1:])]
