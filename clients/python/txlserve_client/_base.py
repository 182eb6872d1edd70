"""What ``Client`` and ``AsyncClient`` share: configuration, the calls of the API (each a request and
the parser of its answer), the retry policy, and the mapping of failures to exceptions. The two
clients add only the transport: the same loop with ``time.sleep`` or ``await asyncio.sleep``.

Retries, as OpenAI's SDK makes them, less those that could apply a call twice. At most ``max_retries``
times, after the server's ``retry-after-ms`` or ``Retry-After`` (one over 60 s is not waited for: the
backoff applies), else after ``0.5 s * 2**attempt`` (at most 8 s, less up to 25% jitter):

- Any call whose request provably never ran: one that could not connect (refused, a connect or pool
  timeout: ``UNSENT``), or answered 429 or 503 with a ``Retry-After`` (the server sends one only where
  nothing ran). An answer with ``x-should-retry: false`` is never retried (the server's 503 whose commit
  is unknown, and its busy-session 409).
- GETs, DELETEs, and completions *without* a session (a stateless function of their parameters; with
  ``stream=True``, only before any of the stream was read) are also retried on a timeout or a broken
  connection, and on 408, 409, 429 and 5xx answers, or any answer with ``x-should-retry: true``.
- Appends and completions *in* a session are not retried otherwise: each feeds text to the session's
  memory, and a failure after the server committed (a reset connection, a timeout, a proxy's 502) would
  feed it twice. Creating, forking and importing sessions neither: a lost answer would leave a second
  session behind. The caller knows whether a retry is safe.

The error a retried call finally raises has the error of the try before it as its ``__cause__`` (where it
has none of its own), so that a 404 after a timed-out DELETE or a 503 after a refused connection says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import json
import os
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar
from urllib.parse import quote, urlsplit

import httpx

from txlserve_client._exceptions import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    error_from_body,
)
from txlserve_client._types import AppendResult, Completion, Model, Session, SessionDeleted

__version__ = "0.1.0"

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=5.0)  # read: the longest wait for the next byte of an answer
DEFAULT_MAX_RETRIES = 2
RETRY_STATUSES = frozenset({408, 409, 429})  # and 5xx: OpenAI's SDK's, for a call that may run twice
NOT_RUN_STATUSES = frozenset({429, 503})  # with a Retry-After: the server's word that nothing ran
# failures before a request left: its answer was not lost, as a broken connection's may be (``_done_before``)
UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
MAX_RETRY_AFTER = 60.0  # a longer Retry-After is not waited for: the normal backoff applies

if TYPE_CHECKING:  # typing_extensions: in every type checker, not needed at run time
    from typing_extensions import Unpack

T = TypeVar("T")
C = TypeVar("C", bound="BaseClient")
_CLOSING: set[asyncio.Task[None]] = set()  # closes begun by finalizers (``close_soon``), held until they end


class RequestOptions(TypedDict, total=False):
    """What every call takes besides its own arguments, as openai-python's methods take them: headers and query
    parameters added to the request (a header given None is not sent), and a timeout of this call's own
    (seconds or an ``httpx.Timeout``; None waits forever) in place of the client's."""

    extra_headers: Mapping[str, str | None]
    extra_query: Mapping[str, Any]
    timeout: float | httpx.Timeout | None


class BodyRequestOptions(RequestOptions, total=False):
    """``RequestOptions`` of a call that sends a JSON body: ``extra_body``'s fields are added to it."""

    extra_body: Mapping[str, Any]


class ClientOptions(TypedDict, total=False):
    """What ``with_options`` may change: the client's own arguments."""

    base_url: str
    api_key: str
    timeout: float | httpx.Timeout | None
    max_retries: int
    default_headers: Mapping[str, str]
    default_query: Mapping[str, Any]


class _Unset:
    """A call's timeout left to the client's (None is a timeout: wait forever)."""


_UNSET: Any = _Unset()


@dataclass(frozen=True)
class Call(Generic[T]):
    """One API call: the request, whether it may be sent again, and how to read its answer."""

    method: str
    path: str
    parse: Callable[[Any], T]
    json: Any = None
    params: Mapping[str, Any] | None = None
    retry: bool = False
    headers: Mapping[str, str | None] | None = None
    gone: Any = None  # the answer a 404 stands for once the call was sent again after its answer was lost: a
    # DELETE whose first try did its work (the retry then found nothing to delete)
    timeout: Any = _UNSET  # float | httpx.Timeout | None: the caller's for this call, else the client's

    def using(self, options: Mapping[str, Any]) -> Call[T]:
        """This call with a caller's ``RequestOptions``."""
        check_options(options, body=self.json is not None, where=f"{self.method} {self.path}")
        if not options:
            return self
        headers, query, body = (options.get(k) for k in ("extra_headers", "extra_query", "extra_body"))
        return replace(self, headers=header_layers(self.headers, headers),
                       params={**(self.params or {}), **(query or {})},
                       json=self.json if body is None else {**self.json, **body},
                       timeout=options.get("timeout", self.timeout))

    def answer(self, response: httpx.Response) -> T:
        """The result a 2xx answer carries. One that is not the server's (a captive portal's page, a body cut
        short, JSON of another shape) is an APIError naming what came, not a JSONDecodeError or a KeyError: every
        failure a call meets is an APIError (found by a helper)."""
        try:
            result = self.parse(response.json())
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            raise APIError(f"the answer to {self.method} {self.path} is not a txlserve server's ({type(err).__name__}"
                           f"; {response.headers.get('content-type', 'no content type')})",
                           status=response.status_code, response=response) from None
        if dataclasses.is_dataclass(result):  # openai-python's _request_id: the id the server logged the call under
            object.__setattr__(result, "_request_id", response.headers.get("x-request-id"))
        return result

    def build(self, http: httpx.Client | httpx.AsyncClient, client: BaseClient) -> httpx.Request:
        """The request, with ``client``'s headers, query and timeout under the call's own. They are set on each
        request, not on ``http``: clients made by ``with_options`` share one connection pool."""
        headers = merged_headers(client._headers(), self.headers)
        if self.json is not None:
            headers["content-type"] = "application/json"
        query = {k: v for k, v in {**client.default_query, **(self.params or {})}.items() if v is not None}
        request = http.build_request(
            self.method, client.base_url + self.path, params=query,
            headers=headers, content=None if self.json is None else json_body(self.json),
            timeout=client.timeout if self.timeout is _UNSET else self.timeout)
        for name in unsent(client.default_headers, self.headers):  # httpx's own defaults too (Accept: */*)
            request.headers.pop(name, None)
        return request


def check_options(options: Mapping[str, Any], *, body: bool, where: str) -> None:
    """Raise the TypeError Python raises for a keyword argument a call does not take, and for an option of the
    wrong kind: a misspelt option (``timout=``), passed through ``**options``, would otherwise be ignored."""
    allowed = BodyRequestOptions.__optional_keys__ if body else RequestOptions.__optional_keys__
    if unknown := sorted(k for k in set(options) - allowed if not (k == "extra_body" and options[k] is None)):
        extra = " (it sends no body)" if unknown[0] == "extra_body" else ""
        raise TypeError(f"{where} got an unexpected keyword argument {unknown[0]!r}{extra}")
    for name in ("extra_headers", "extra_query", "extra_body"):
        if options.get(name) is not None and not isinstance(options[name], Mapping):
            raise TypeError(f"{name} is a mapping, not {type(options[name]).__name__}")
    if "timeout" in options:
        checked_timeout(options["timeout"])


MAX_TIMEOUT_S = 1e9  # past it a socket's deadline overflows (OverflowError from deep in httpcore); None waits forever


def checked_timeout(timeout: Any) -> httpx.Timeout:
    """``timeout`` as an ``httpx.Timeout``, each of its waits a number of seconds above 0 (a socket cannot wait 0 s
    or less: httpx failed as it connected, and sync and async differently) and at most ``MAX_TIMEOUT_S``, or None
    (no limit). A value out of range failed deep in httpcore, websockets or the socket module, raw."""
    if not isinstance(timeout, (int, float, httpx.Timeout, type(None))) or isinstance(timeout, bool):
        raise TypeError(f"timeout is seconds or an httpx.Timeout, not {type(timeout).__name__}")
    timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
    for name in ("connect", "read", "write", "pool"):
        value = getattr(timeout, name)
        if value is not None and not (isinstance(value, (int, float)) and 0 < value <= MAX_TIMEOUT_S):
            raise ValueError(f"timeout{'' if name == 'read' else f' ({name})'} is seconds above 0 and at most "
                             f"{MAX_TIMEOUT_S:g}, or None for no limit (got {value!r})")
    return timeout


def next_page(options: Mapping[str, Any]) -> dict[str, Any]:
    """A list's ``options`` for its next page: the page's cursor wins over an ``after`` in ``extra_query`` (which
    had fetched the same page again, without end; openai-python's pages do the same)."""
    query = {k: v for k, v in (options.get("extra_query") or {}).items() if k != "after"}
    return {**options, "extra_query": query} if "extra_query" in options else dict(options)


def request_options(fields: dict[str, Any]) -> dict[str, Any]:
    """The ``RequestOptions`` among a WebSocket completion's ``fields``, taken out of them (the rest are the
    body's)."""
    return {k: fields.pop(k) for k in RequestOptions.__optional_keys__ if k in fields}


def merged_headers(*layers: Mapping[str, str | None] | None) -> httpx.Headers:
    """Each layer's headers over the layers before it, whatever the case of their names (``user-agent`` replaces
    ``User-Agent``; two were sent); a name given None is not sent. A value a header cannot carry is a ValueError
    that never quotes it (it may be a key): httpx's UnicodeEncodeError or h11's LocalProtocolError had."""
    headers = httpx.Headers()
    for layer in layers:
        for name, value in (layer or {}).items():
            if value is None:
                headers.pop(name, None)
                continue
            if not isinstance(name, str) or not isinstance(value, str):
                raise TypeError(f"a header's name and value are str, not {type(name).__name__}: "
                                f"{type(value).__name__}")
            if not (_TOKEN.fullmatch(name) and _VALUE.fullmatch(value)):
                raise ValueError(f"the header {name[:60]!r} has a name or value an HTTP header cannot carry (a "
                                 f"name is letters, digits and !#$%&'*+-.^_`|~; a value printable ASCII, no space "
                                 f"or tab at either end)")
            if name.lower() in _FRAMING:
                raise ValueError(f"the header {name!r} is the client's to set, from the body it sends")
            headers[name] = value
    return headers


def header_layers(*layers: Mapping[str, str | None] | None) -> dict[str, str | None]:
    """Layers of headers as one, a later name replacing an earlier one whatever their case (a plain dict kept an
    earlier None under another case, and a later value was dropped with it; found by a reviewer)."""
    merged: dict[str, str | None] = {}
    for layer in layers:
        for name, value in (layer or {}).items():
            for old in [k for k in merged if isinstance(name, str) and k.lower() == name.lower()]:
                del merged[old]
            merged[name] = value
    return merged


def unsent(*layers: Mapping[str, str | None] | None) -> set[str]:
    """The headers ``merged_headers`` leaves out (given None, and not given again by a later layer)."""
    names: set[str] = set()
    for layer in layers:
        for name, value in (layer or {}).items():
            (names.add if value is None else names.discard)(name.lower())
    return names


def json_body(value: Any) -> bytes:
    """A request's JSON, as httpx writes it (UTF-8, compact, no NaN); text holding a lone surrogate (bytes that
    were not UTF-8, read with ``surrogateescape`` as Python reads a terminal's input, or a string cut between a
    pair) is escaped as ``\\udXXX`` instead, so the server refuses it with its 400 that names the field, where
    httpx raised UnicodeEncodeError from inside the client."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


# OpenAI's four forms of a prompt: text, token ids, or a batch of either (a choice for each, times n)
Prompt = str | list[int] | list[str] | list[list[int]]


def completion_body(model: str, prompt: Prompt, stream: bool, options: Mapping[str, Any],
                    extra_body: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The request body: unset options are left out, so the server's defaults apply; ``extra_body``'s fields
    (OpenAI's SDK's name) are sent as they are, last (so they may name another model or prompt), but ``stream``,
    which decides how the answer is read, is the caller's."""
    if options.get("session_id") is not None:  # a Session given whole had said "AppendResult is not JSON
        _check_sid(options["session_id"])  # serializable" (found by a helper)
    body = {"model": model, "prompt": prompt, **{k: v for k, v in options.items() if v is not None},
            **(extra_body or {})}
    body.pop("stream", None)
    if stream:
        body["stream"] = True
    return body


# the fields ``completions.create`` names, which a WebSocket completion takes as keyword arguments too
COMPLETION_FIELDS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "logprobs", "echo", "n",
                               "user", "session_id", "logit_bias", "frequency_penalty", "presence_penalty",
                               "stream_options", "extra_body"})


def ws_completion_body(model: str, prompt: Prompt, fields: dict[str, Any], *, where: str) -> dict[str, Any]:
    """A WebSocket completion's body from the fields ``completions.create`` takes. Any other is a TypeError, as it
    is there: sent on, a misspelt one (``max_token=``) was the server's 400, and ``timeout=`` went into the body
    (found by a helper). Fields this client does not name go in ``extra_body``."""
    if unknown := sorted(set(fields) - COMPLETION_FIELDS):
        if unknown[0] in RequestOptions.__optional_keys__:
            raise TypeError(f"{where}: {unknown[0]} is the connection's, for its life: client.ws.connect("
                            f"{unknown[0]}=...)")
        raise TypeError(f"{where} got an unexpected keyword argument {unknown[0]!r} (a field this client does not "
                        f"name goes in extra_body)")
    return completion_body(model, prompt, False, fields, fields.pop("extra_body", None))


def completion_call(body: dict[str, Any]) -> Call[Completion]:
    sid = body.get("session_id")
    # X-Session-Id lets a load balancer send a session's requests to the replica that holds it hot
    # a header holds ASCII, and no space at its ends (h11 refused " " as an illegal header, a connection error):
    # no server's id is anything else; the body still names it, and the server answers for it
    routable = isinstance(sid, str) and sid.isascii() and sid.isprintable() and sid == sid.strip()
    return Call("POST", "/v1/completions", Completion.from_dict, json=body, retry=sid is None,
                headers={"x-session-id": sid} if sid and routable else None)


def _sid(session_id: str) -> str:
    """One path segment. A URL's "." and ".." segments are removed (RFC 3986) before the request leaves: sent as
    they are, get(".") read the session list and get("..") a 404 for /v1; escaped, they name no session."""
    _check_sid(session_id)  # a Session passed whole said "quote_from_bytes() expected bytes"
    if not session_id:
        raise ValueError("session_id must be a non-empty string")
    quoted = quote(session_id, safe="")
    return quoted.replace(".", "%2E") if quoted in (".", "..") else quoted


def _check_sid(session_id: object) -> None:
    if not isinstance(session_id, str):
        raise TypeError(f"session_id is a session's id, a str (session.id), not {type(session_id).__name__}")


def session_create_call(text: str | None, metadata: Mapping[str, str] | None) -> Call[AppendResult]:
    body = {k: v for k, v in (("text", text), ("metadata", dict(metadata) if metadata else None)) if v is not None}
    return Call("POST", "/v1/sessions", AppendResult.from_dict, json=body)


def session_get_call(session_id: str) -> Call[Session]:
    return Call("GET", f"/v1/sessions/{_sid(session_id)}", Session.from_dict, retry=True)


def _page(body: dict[str, Any]) -> dict[str, Any]:
    return {"data": [Session.from_dict(s) for s in body["data"]], "has_more": body["has_more"],
            "next_cursor": body.get("next_cursor")}


def session_list_call(limit: int | None, after: str | None, order: str | None = None) -> Call[dict[str, Any]]:
    """The fields of a page: the sync and async clients wrap them in their own page type."""
    params = {k: v for k, v in (("limit", limit), ("after", after), ("order", order)) if v is not None}
    return Call("GET", "/v1/sessions", _page, params=params, retry=True)


def session_update_call(session_id: str, metadata: Mapping[str, str | None]) -> Call[Session]:
    """Idempotent (the same keys set to the same values), so retried as a read is."""
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):  # JSON made 5 "5"
        raise ValueError(f"metadata is a mapping of str keys to strings (None removes a key), not {metadata!r:.80}")
    if session_id == "import":  # that path imports a session: no session the server made has this id
        raise ValueError("'import' is no session's id (POST /v1/sessions/import imports one): pass a session's id")
    return Call("POST", f"/v1/sessions/{_sid(session_id)}", Session.from_dict, json={"metadata": dict(metadata)},
                retry=True)


def session_delete_call(session_id: str) -> Call[SessionDeleted]:
    return Call("DELETE", f"/v1/sessions/{_sid(session_id)}", SessionDeleted.from_dict, retry=True,
                gone={"id": session_id, "object": "session.deleted", "deleted": True})


def session_append_call(session_id: str, text: str, logprobs: int | None = None) -> Call[AppendResult]:
    body: dict[str, Any] = {"text": text} if logprobs is None else {"text": text, "logprobs": logprobs}
    return Call("POST", f"/v1/sessions/{_sid(session_id)}/append", AppendResult.from_dict, json=body)


def session_fork_call(session_id: str, metadata: Mapping[str, str] | None) -> Call[Session]:
    body = {} if metadata is None else {"metadata": dict(metadata)}  # None keeps the source's; {} clears it
    return Call("POST", f"/v1/sessions/{_sid(session_id)}/fork", Session.from_dict, json=body)


def session_export_call(session_id: str) -> Call[dict[str, Any]]:
    return Call("GET", f"/v1/sessions/{_sid(session_id)}/export", dict, retry=True)


def session_import_call(document: Mapping[str, Any]) -> Call[AppendResult]:
    if not isinstance(document, Mapping):  # dict() of a list or a string raised a TypeError, or read it as pairs
        raise ValueError(f"a session's export document is a JSON object (what sessions.export returns), not "
                         f"{type(document).__name__}")
    return Call("POST", "/v1/sessions/import", AppendResult.from_dict, json=dict(document))


def models_call() -> Call[list[Model]]:
    return Call("GET", "/v1/models", lambda body: [Model.from_dict(m) for m in body["data"]], retry=True)


def error_from_response(response: httpx.Response) -> APIError:
    """The exception for a non-2xx answer whose body has been read."""
    location = response.headers.get("location")
    if 300 <= response.status_code < 400 and location:  # not followed (httpx's default): say where it points
        return APIStatusError(f"the server redirected to {location[:200]!r}, and this client follows no redirect: "
                              f"set base_url to the server's own URL (its scheme, host and port)",
                              status=response.status_code, response=response)
    try:
        body = response.json()
    except ValueError:
        body = None
    return error_from_body(body, response.status_code, response.text[:200] or response.reason_phrase,
                           response=response)


def stream_error(response: httpx.Response) -> APIError | None:
    """Why a 2xx answer to ``stream=True`` is no event stream (a proxy's page, JSON from a server that does not
    stream), or None: read as SSE, it held no event and raised "the stream ended before [DONE]", which blamed
    the connection for an answer of another kind."""
    kind = response.headers.get("content-type", "")
    if kind.split(";")[0].strip().lower() == "text/event-stream":
        return None
    return APIError(f"the answer to a streamed completion is {kind[:100] or 'of no content type'} (HTTP "
                    f"{response.status_code}), not an event stream (text/event-stream): is base_url the txlserve "
                    f"server's, with no proxy between that answers for it?", status=response.status_code,
                    response=response)


def timeout_with(timeout: float | httpx.Timeout | None, http_client: httpx.Client | httpx.AsyncClient | None
                 ) -> float | httpx.Timeout | None:
    """A client's timeout: an ``http_client``'s own where one was set on it and none was given here (as in
    openai-python); httpx's default of 5 s is not taken, which would cut a long prompt's wait for its first token."""
    if timeout is DEFAULT_TIMEOUT and http_client is not None and http_client.timeout != httpx.Timeout(5.0):
        return http_client.timeout
    return timeout


def unsendable(err: httpx.LocalProtocolError) -> APIError:
    """A request HTTP cannot carry (h11 refused it as it went out): never retried, as the same request fails the
    same way, and said without the bytes h11 quotes (a header's value may be a key)."""
    said = re.sub(r"b(['\"]).*?\1", "…", str(err))[:200]
    return APIError(f"the request could not be sent as HTTP ({type(err).__name__}: {said})", request=_request(err))


def connection_error(err: Exception, url: str | None = None) -> APIConnectionError:
    """``url``: the address tried, where ``err`` is not httpx's (a WebSocket's)."""
    where, request = _origin(err) or (_origin_of(url) if url else ""), _request(err)
    if isinstance(err, (httpx.TimeoutException, TimeoutError, asyncio.TimeoutError)):  # two classes before 3.11
        return APITimeoutError(f"the request{where} timed out ({type(err).__name__}: {err})", request=request)
    return APIConnectionError(f"could not talk to the txlserve server{where} ({type(err).__name__}: {err})",
                              request=request)


def decoding_error(err: Exception, response: httpx.Response | None = None) -> APIError:
    """A body that httpx could not decode: its Content-Encoding (gzip, deflate...) does not match it, as where a
    proxy labels plain text gzip. httpx's DecodingError is no TransportError, and reached the caller as itself."""
    return APIError(f"the answer{_origin(err)} could not be decoded: its Content-Encoding does not match its body "
                    f"({type(err).__name__}: {err})", status=response.status_code if response is not None else None,
                    response=response, request=_request(err))


def closed_error() -> APIConnectionError:
    """A call on a client after ``close()`` (or after its ``with`` block): httpx's bare RuntimeError, said plainly."""
    return APIConnectionError("this client is closed: make a new one (a client used in a `with` block is closed "
                              "when the block ends)")


async def closes_begun() -> None:
    """Wait (bounded) for the closes that finalizers began on this loop: an ``AsyncClient`` closed right after a
    stream was dropped (``break`` at the end of ``async with``) left them to ``asyncio.run``'s end, which
    cancelled them, an unclosed socket (found by a helper)."""
    await asyncio.sleep(0)  # those scheduled from a finalizer start now
    loop = asyncio.get_running_loop()
    if pending := [t for t in _CLOSING if t.get_loop() is loop and not t.done()]:
        await asyncio.wait(pending, timeout=5)


def close_soon(loop: asyncio.AbstractEventLoop | None, close: Callable[[], Awaitable[Any]]) -> None:
    """Run ``close()`` on ``loop`` from a finalizer, which cannot await: a dropped async stream or connection is
    closed as a dropped sync one is. Nothing where the loop is gone (its sockets closed with it)."""
    if loop is None or loop.is_closed():
        return

    async def quietly() -> None:
        with contextlib.suppress(Exception):  # a connection already broken: closed either way
            await close()

    def start() -> None:
        task = loop.create_task(quietly())
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)

    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(start)


def _request(err: Exception) -> httpx.Request | None:
    """The request that failed, where httpx knows it."""
    try:
        request = err.request  # type: ignore[attr-defined]  # httpx raises RuntimeError where it has none
    except (AttributeError, RuntimeError):
        return None
    return request if isinstance(request, httpx.Request) else None


def _origin(err: Exception) -> str:
    """`` at scheme://host:port`` of the request that failed, where httpx knows it (never its path or query,
    which may carry a key)."""
    if (request := _request(err)) is None:
        return ""
    url = request.url
    if not url.scheme or not url.host:  # not a URL at all (httpx says so in the error itself)
        return ""
    return f" at {url.scheme}://{url.netloc.decode('ascii', 'replace')}"


def _origin_of(url: str) -> str:
    """As ``_origin``, of a URL (its scheme, host and port alone)."""
    scheme, _, rest = url.partition("://")
    host = rest.split("/", 1)[0].rpartition("@")[2]  # never a user:password
    return f" at {scheme}://{host}" if scheme and host else ""


def _retry_after(response: Any) -> float | None:
    """The wait the server asks for: ``retry-after-ms`` (OpenAI's, first), else ``Retry-After`` in seconds or as
    a date; None where it names none, or one over ``MAX_RETRY_AFTER`` (the backoff applies instead)."""
    if (ms := response.headers.get("retry-after-ms")) is not None:
        with contextlib.suppress(ValueError):
            seconds = float(ms) / 1000
            return seconds if 0 <= seconds <= MAX_RETRY_AFTER else None
    raw = response.headers.get("retry-after")
    if raw is None:
        return None
    try:
        seconds = float(raw)
        if seconds < 0:  # no delay-seconds (RFC 9110 allows digits only): the normal backoff, not an instant retry
            return None
    except ValueError:  # an HTTP date
        try:
            seconds = email.utils.parsedate_to_datetime(raw).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):
            return None
    return max(seconds, 0.0) if seconds <= MAX_RETRY_AFTER else None


def should_retry(call: Call[Any], response: httpx.Response) -> bool:
    """Whether an error answer is worth sending ``call`` again for (the module docstring says why)."""
    said = response.headers.get("x-should-retry", "").strip().lower()
    if said == "false":
        return False
    if not call.retry:  # it may have run: only the server's word that it did not
        return response.status_code in NOT_RUN_STATUSES and ("retry-after" in response.headers
                                                            or "retry-after-ms" in response.headers)
    return said == "true" or response.status_code in RETRY_STATUSES or response.status_code >= 500


def may_have_run(err: Exception | None = None, response: httpx.Response | None = None) -> bool:
    """Whether a failed try may have done its work (its answer lost): a broken connection or a timeout after the
    request left, or a 5xx no ``Retry-After`` says ran nothing (a proxy's 502 or 504 after the server's work)."""
    if response is not None:
        return response.status_code >= 500 and "retry-after" not in response.headers
    return not isinstance(err, UNSENT)


def given_up(error: APIError, before: APIError | None) -> APIError:
    """``error``, the last try's, chained to the try's before it where it has no cause of its own."""
    if before is not None and error.__cause__ is None:
        error.__cause__ = before
    return error


# Visible ASCII: what a Bearer token can be sent as. Anything else failed in httpx or websockets with a message
# that quoted the whole header, key and all (found by a helper).
_HEADER_SAFE = re.compile(r"[\x21-\x7e]+")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header's name (RFC 9110's token)
_VALUE = re.compile(r"(?:[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*)?")  # h11's: visible ASCII, inner spaces and tabs
_FRAMING = frozenset({"content-length", "transfer-encoding"})  # a wrong one was h11's raw error as the body went


class BaseClient:
    """Configuration and retry policy; see the module docstring for what is retried and why."""

    initial_retry_delay = 0.5
    max_retry_delay = 8.0
    _http: httpx.Client | httpx.AsyncClient  # the subclass's
    _owns_http: bool  # closed with this client: not a with_options copy's, which is its parent's

    def __init__(self, *, base_url: str | None, api_key: str | None, timeout: float | httpx.Timeout | None,
                 max_retries: int, default_headers: Mapping[str, str] | None = None,
                 default_query: Mapping[str, Any] | None = None) -> None:
        if isinstance(max_retries, bool) or not isinstance(max_retries, int):
            raise TypeError(f"max_retries is an int, not {type(max_retries).__name__}")
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        for name, value in (("default_headers", default_headers), ("default_query", default_query)):
            if value is not None and not isinstance(value, Mapping):
                raise TypeError(f"{name} is a mapping, not {type(value).__name__}")
        merged_headers(default_headers)  # checked now, not at the first call
        self.default_headers: dict[str, str | None] = dict(default_headers or {})
        self.default_query: dict[str, Any] = dict(default_query or {})
        self.base_url = (base_url or os.environ.get("TXLSERVE_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            # "localhost:8000" parsed as scheme "localhost": httpx named it an unsupported protocol (after the
            # retries), and ws.connect() raised a bare ValueError from ws_url
            raise ValueError(f"base_url must be an http:// or https:// URL, such as http://127.0.0.1:8000 (got "
                             f"{self.base_url!r}" + ("" if "://" in self.base_url else
                                                     f"; did you mean 'http://{self.base_url}'?") + ")")
        if parts.path.endswith("/v1"):  # the OpenAI SDK's form of the same server's URL
            self.base_url = self.base_url.removesuffix("/v1")
        self.api_key = api_key if api_key is not None else os.environ.get("TXLSERVE_API_KEY") or None
        if self.api_key and not _HEADER_SAFE.fullmatch(self.api_key):  # the message never quotes the key
            raise ValueError("api_key holds a character an HTTP header cannot carry (a space, a newline, a "
                             "control or non-ASCII character; a key read from a file keeps its trailing newline: "
                             "strip it)")
        self.timeout = checked_timeout(timeout)
        self.max_retries = max_retries

    @property
    def is_closed(self) -> bool:
        """Whether ``close()`` has run (httpx's name for it): every later call raises APIConnectionError."""
        http = getattr(self, "_http", None)
        return http is not None and http.is_closed

    def _headers(self) -> httpx.Headers:
        """Every request's headers: ``default_headers`` last, so they may replace the User-Agent, or the
        Authorization of a gateway that wants its own."""
        headers = {"User-Agent": f"txlserve-client/{__version__}", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return merged_headers(headers, self.default_headers)

    def _options(self, changes: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments of a client like this one but for ``changes`` (``with_options``'s), checked by name: a
        misspelt one would otherwise be dropped without a word. Headers and query are added to this client's."""
        if unknown := sorted(set(changes) - ClientOptions.__optional_keys__):
            raise TypeError(f"with_options() got an unexpected keyword argument {unknown[0]!r}")
        return {"base_url": changes.get("base_url", self.base_url), "api_key": changes.get("api_key", self.api_key),
                "timeout": changes.get("timeout", self.timeout),
                "max_retries": changes.get("max_retries", self.max_retries),
                "default_headers": header_layers(self.default_headers, changes.get("default_headers")),
                "default_query": {**self.default_query, **(changes.get("default_query") or {})}}  # None: not sent

    def with_options(self: C, **changes: Unpack[ClientOptions]) -> C:
        """A client like this one but for ``changes`` (openai-python's): ``client.with_options(timeout=5,
        max_retries=0).sessions.get(sid)``. It shares this client's connections and ``http_client`` (its proxy,
        certificates and hooks), whatever its ``base_url``, and its ``close()`` leaves them open;
        ``default_headers`` and ``default_query`` add to this client's."""
        copy = type(self)(**self._options(changes), http_client=self._http)  # type: ignore[call-arg]
        copy._owns_http = False  # requests carry whole URLs: one pool serves any base_url
        return copy

    copy = with_options

    @property
    def ws_url(self) -> str:
        scheme, rest = self.base_url.split("://", 1)
        return {"http": "ws", "https": "wss"}.get(scheme, scheme) + "://" + rest + "/v1/ws"

    @staticmethod
    def _done_before(call: Call[Any], response: httpx.Response, lost: bool) -> httpx.Response | None:
        """The answer a 404 to ``call`` stands for where an earlier try's answer was ``lost`` (a connection that
        broke after the request was sent, not one that never connected): a retried DELETE whose first try deleted
        the session raised NotFoundError for a delete that succeeded (found by a helper). None: the 404 is the
        answer."""
        if not lost or call.gone is None or response.status_code != 404:
            return None
        return httpx.Response(200, json=call.gone, request=response.request)

    def _retry_delay(self, call: Call[Any], attempt: int, response: httpx.Response | None = None,
                     err: Exception | None = None) -> float | None:
        """Seconds to wait before sending ``call`` again after a failed ``attempt`` (its error answer, or the
        transport error ``err``), or None to give up."""
        if attempt >= self.max_retries:
            return None
        if response is not None:
            if not should_retry(call, response):
                return None
            if (after := _retry_after(response)) is not None:
                return after
        elif not call.retry and not isinstance(err, UNSENT):
            return None
        return self._backoff(attempt)

    def _backoff(self, attempt: int) -> float:
        return min(self.initial_retry_delay * 2.0**attempt, self.max_retry_delay) * (1 - 0.25 * random.random())

    def _reopen_delay(self, attempt: int, err: Exception) -> float | None:
        """Seconds before opening a WebSocket again after a failed ``attempt``, or None to give up. Opening one
        runs nothing on the server, so it is retried as a GET is: a connection refused, reset, dropped mid-handshake
        (InvalidMessage) or timed out, or an answer of 408, 409, 429 or 5xx, after its ``Retry-After`` where it
        names one (the README's "any call ... that could not connect" had not held for it)."""
        import websockets.exceptions  # (the client's own dependency; imported here, where a socket failed)

        if attempt >= self.max_retries:
            return None
        if isinstance(err, websockets.exceptions.InvalidStatus):
            status = err.response.status_code
            if not (status in (408, 409, 429) or status >= 500):
                return None
            after = _retry_after(err.response)
            return after if after is not None else self._backoff(attempt)
        lost = (OSError, TimeoutError, asyncio.TimeoutError, websockets.exceptions.InvalidMessage,
                websockets.exceptions.ConnectionClosed)
        return self._backoff(attempt) if isinstance(err, lost) else None
