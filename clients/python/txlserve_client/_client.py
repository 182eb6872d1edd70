"""The synchronous client: ``Client`` and its resources over ``httpx.Client``."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import httpx

from txlserve_client import _base as api
from txlserve_client._base import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    BaseClient,
    BodyRequestOptions,
    Call,
    RequestOptions,
)
from txlserve_client._exceptions import APIError
from txlserve_client._streaming import Stream
from txlserve_client._types import AppendResult, Completion, Model, Session, SessionDeleted, SessionPage
from txlserve_client._websocket import WebSocketConnection, WebSocketStream

if TYPE_CHECKING:  # typing_extensions: in every type checker, not needed at run time
    from typing_extensions import Unpack

log = logging.getLogger("txlserve_client")
T = TypeVar("T")


class Client(BaseClient):
    """A txlserve server over HTTP and WebSocket.

    ``base_url`` defaults to ``$TXLSERVE_BASE_URL`` (else http://127.0.0.1:8000), ``api_key`` to
    ``$TXLSERVE_API_KEY``; ``timeout`` is an ``httpx.Timeout`` or seconds (None: wait forever);
    ``max_retries`` applies where a second try cannot apply a call twice (see ``txlserve_client._base``);
    ``default_headers`` and ``default_query`` go with every request; ``http_client``: an ``httpx.Client`` of your
    own (a proxy, certificates), closed with this client. Every call takes ``RequestOptions`` (``extra_headers``,
    ``extra_query``, ``timeout``, and ``extra_body`` where it sends a body); ``with_options()`` makes a copy.
    """

    completions: Completions
    sessions: Sessions
    models: Models
    ws: WebSocket

    def __init__(self, *, base_url: str | None = None, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
                 max_retries: int = DEFAULT_MAX_RETRIES, default_headers: Mapping[str, str] | None = None,
                 default_query: Mapping[str, Any] | None = None, http_client: httpx.Client | None = None) -> None:
        if http_client is not None and not isinstance(http_client, httpx.Client):
            raise TypeError(f"http_client is an httpx.Client (AsyncClient takes an httpx.AsyncClient), not "
                            f"{type(http_client).__name__}")
        super().__init__(base_url=base_url, api_key=api_key, timeout=api.timeout_with(timeout, http_client),
                         max_retries=max_retries,
                         default_headers=default_headers, default_query=default_query)
        # headers, query and timeout go on each request (Call.build), so that with_options' copies share this pool
        self._http = http_client if http_client is not None else httpx.Client()
        self._owns_http = True  # a copy's close() leaves its parent's pool open
        self.completions = Completions(self)
        self.sessions = Sessions(self)
        self.models = Models(self)
        self.ws = WebSocket(self)

    def _send(self, call: Call[Any], *, stream: bool = False) -> httpx.Response:
        """The answer to ``call``, retried as the policy allows; raises the APIError of a failure."""
        request = call.build(self._http, self)
        attempt, lost = 0, False
        before: APIError | None = None  # the last try's failure, the cause of the next one's
        while True:
            if self._http.is_closed:  # before the first try, or closed while a retry waited
                raise api.closed_error()
            try:
                response = self._http.send(request, stream=stream)
                if not response.is_success:
                    response.read()  # the error body, even of a stream
            except httpx.DecodingError as err:  # never retried: the same answer comes again
                if stream:  # an error body read here (httpx closes the response of a call without stream)
                    response.close()
                raise api.decoding_error(err, response if stream else None) from err
            except httpx.LocalProtocolError as err:  # never retried: it fails the same way
                raise api.given_up(api.unsendable(err), before) from None
            except httpx.TransportError as err:
                before = api.connection_error(err)
                before.__cause__ = err
                if (delay := self._retry_delay(call, attempt, err=err)) is None:
                    raise before from err
                lost = lost or api.may_have_run(err)
            else:
                if response.is_success:
                    if stream and (wrong := api.stream_error(response)) is not None:
                        response.close()
                        raise api.given_up(wrong, before)
                    return response
                response.close()
                if (done := self._done_before(call, response, lost)) is not None:
                    return done
                failed = api.given_up(api.error_from_response(response), before)
                if (delay := self._retry_delay(call, attempt, response)) is None:
                    raise failed
                before, lost = failed, lost or api.may_have_run(response=response)
            log.info("retrying %s %s in %.2f s (attempt %d)", call.method, call.path, delay, attempt + 1)
            time.sleep(delay)
            attempt += 1

    def _call(self, call: Call[T]) -> T:
        return call.answer(self._send(call))

    def close(self) -> None:
        """Close the connections (an ``http_client`` given too); a ``with_options`` copy's are its parent's."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class Completions:
    def __init__(self, client: Client) -> None:
        self._client = client

    @overload
    def create(self, *, model: str, prompt: api.Prompt = "", max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
               stop: str | Sequence[str] | None = None,
               seed: int | None = None, logprobs: int | None = None, echo: bool | None = None, n: int | None = None,
               user: str | None = None, session_id: str | None = None,
               logit_bias: Mapping[str, float] | None = None,
               frequency_penalty: float | None = None, presence_penalty: float | None = None,
               stream_options: Mapping[str, bool] | None = None, extra_body: Mapping[str, Any] | None = None,
               stream: Literal[False] = False, **options: Unpack[RequestOptions]) -> Completion: ...

    @overload
    def create(self, *, model: str, prompt: api.Prompt = "", max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
               stop: str | Sequence[str] | None = None,
               seed: int | None = None, logprobs: int | None = None, echo: bool | None = None, n: int | None = None,
               user: str | None = None, session_id: str | None = None,
               logit_bias: Mapping[str, float] | None = None,
               frequency_penalty: float | None = None, presence_penalty: float | None = None,
               stream_options: Mapping[str, bool] | None = None, extra_body: Mapping[str, Any] | None = None,
               stream: Literal[True], **options: Unpack[RequestOptions]) -> Stream: ...

    @overload  # a flag known only at run time (openai-python's third)
    def create(self, *, model: str, prompt: api.Prompt = "", max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
               stop: str | Sequence[str] | None = None,
               seed: int | None = None, logprobs: int | None = None, echo: bool | None = None, n: int | None = None,
               user: str | None = None, session_id: str | None = None,
               logit_bias: Mapping[str, float] | None = None,
               frequency_penalty: float | None = None, presence_penalty: float | None = None,
               stream_options: Mapping[str, bool] | None = None, extra_body: Mapping[str, Any] | None = None,
               stream: bool, **options: Unpack[RequestOptions]) -> Completion | Stream: ...

    def create(self, *, model: str, prompt: api.Prompt = "", max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
               stop: str | Sequence[str] | None = None,
               seed: int | None = None, logprobs: int | None = None, echo: bool | None = None, n: int | None = None,
               user: str | None = None, session_id: str | None = None,
               logit_bias: Mapping[str, float] | None = None,
               frequency_penalty: float | None = None, presence_penalty: float | None = None,
               stream_options: Mapping[str, bool] | None = None, extra_body: Mapping[str, Any] | None = None,
               stream: bool = False, **options: Unpack[RequestOptions]) -> Completion | Stream:
        """A completion of ``prompt``; in ``session_id``, of the session's text so far followed by ``prompt``
        (and the prompt and completion are then added to the session). ``stream=True``: a ``Stream``.
        ``extra_body``: more fields for the body, as OpenAI's SDK takes them (vLLM's ``min_tokens``, say)."""
        call = api.completion_call(api.completion_body(model, prompt, stream, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed,
            logprobs=logprobs, echo=echo, n=n, user=user, session_id=session_id, stream_options=stream_options,
            logit_bias=logit_bias, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty),
            extra_body)).using(options)
        if stream:
            return Stream(self._client._send(call, stream=True))
        return self._client._call(call)


class Sessions:
    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, *, text: str | None = None, metadata: Mapping[str, str] | None = None,
               **options: Unpack[BodyRequestOptions]) -> AppendResult:
        """A new session, its memory built from ``text`` (none: empty)."""
        return self._client._call(api.session_create_call(text, metadata).using(options))

    def get(self, session_id: str, **options: Unpack[RequestOptions]) -> Session:
        return self._client._call(api.session_get_call(session_id).using(options))

    def list(self, *, limit: int | None = None, after: str | None = None,
             order: Literal["asc", "desc"] | None = None, **options: Unpack[RequestOptions]) -> SessionPage:
        """One page of sessions, oldest first (``order="desc"``: newest first); ``page.iter_all()`` continues
        through the later pages, with the same ``options``."""
        def fetch(cursor: str) -> SessionPage:
            return self.list(limit=limit, after=cursor, order=order, **api.next_page(options))

        call = api.session_list_call(limit, after, order).using(options)
        return SessionPage(**self._client._call(call), _fetch=fetch)

    def update(self, session_id: str, *, metadata: Mapping[str, str | None],
               **options: Unpack[BodyRequestOptions]) -> Session:
        """Change the session's metadata: the keys given are set, a key given as None is removed, the others
        stay (OpenAI's ``threads.update``). Its memory is untouched. A session a request is running on refuses
        it (``SessionBusyError``): that request's commit writes back the metadata it started with."""
        return self._client._call(api.session_update_call(session_id, metadata).using(options))

    def delete(self, session_id: str, **options: Unpack[RequestOptions]) -> SessionDeleted:
        return self._client._call(api.session_delete_call(session_id).using(options))

    def append(self, session_id: str, text: str, *, logprobs: int | None = None,
               **options: Unpack[BodyRequestOptions]) -> AppendResult:
        """Feed ``text`` to the session's memory (nothing is generated); retried only where it provably did not
        run (see ``txlserve_client._base``). With ``logprobs``, the result's ``logprobs`` scores each token of it
        (with that many alternatives)."""
        return self._client._call(api.session_append_call(session_id, text, logprobs).using(options))

    def fork(self, session_id: str, *, metadata: Mapping[str, str] | None = None,
             **options: Unpack[BodyRequestOptions]) -> Session:
        """A new session with a copy of this one's memory; the two then go their own ways."""
        return self._client._call(api.session_fork_call(session_id, metadata).using(options))

    def export(self, session_id: str, **options: Unpack[RequestOptions]) -> dict[str, Any]:
        """The session as a small JSON document (its last tokens, tokens seen, metadata, tokenizer id): save
        it anywhere, and ``import_`` it into any server whose model reads text the same way."""
        return self._client._call(api.session_export_call(session_id).using(options))

    def import_(self, document: Mapping[str, Any], **options: Unpack[BodyRequestOptions]) -> AppendResult:
        """A new session (this client's key owns it) rebuilt from an ``export`` document; retried only where it
        provably did not run."""
        return self._client._call(api.session_import_call(document).using(options))


class Models:
    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self, **options: Unpack[RequestOptions]) -> list[Model]:
        return self._client._call(api.models_call().using(options))


class WebSocket:
    """Completions over ``/v1/ws`` (see ``txlserve_client._websocket``)."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def connect(self, **options: Unpack[RequestOptions]) -> WebSocketConnection:
        """``options``' headers, query and timeout (its read timeout: the longest wait for a message) hold for the
        connection's life."""
        return WebSocketConnection.open(self._client, options)

    def stream(self, *, model: str, prompt: api.Prompt = "", **options: Any) -> WebSocketStream:
        """One completion on a connection of its own, closed with the stream; ``options`` are the completion's
        fields and ``extra_body``, and the connection's ``RequestOptions``."""
        request = api.request_options(options)
        body = api.ws_completion_body(model, prompt, options, where="ws.stream()")  # a misspelt field before a socket
        conn = self.connect(**request)
        try:
            return conn._start(body, owns_connection=True)
        except BaseException:
            conn.close()
            raise
