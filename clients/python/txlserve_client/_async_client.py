"""The asynchronous client: ``AsyncClient`` and its resources over ``httpx.AsyncClient``.
It mirrors ``_client.py`` line for line; every request and answer is built and read by ``_base``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import httpx

from txlserve_client import _base as api
from txlserve_client._async_websocket import AsyncConnect, AsyncWebSocketConnection, AsyncWebSocketStream
from txlserve_client._base import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    BaseClient,
    BodyRequestOptions,
    Call,
    RequestOptions,
)
from txlserve_client._exceptions import APIError
from txlserve_client._streaming import AsyncStream
from txlserve_client._types import (
    AppendResult,
    AsyncSessionPage,
    AsyncSessionPager,
    Completion,
    Model,
    Session,
    SessionDeleted,
)

if TYPE_CHECKING:  # typing_extensions: in every type checker, not needed at run time
    from typing_extensions import Unpack

log = logging.getLogger("txlserve_client")
T = TypeVar("T")


class AsyncClient(BaseClient):
    """``Client`` for asyncio: the same options, and every method a coroutine."""

    completions: AsyncCompletions
    sessions: AsyncSessions
    models: AsyncModels
    ws: AsyncWebSocket

    def __init__(self, *, base_url: str | None = None, api_key: str | None = None,
                 timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
                 max_retries: int = DEFAULT_MAX_RETRIES, default_headers: Mapping[str, str] | None = None,
                 default_query: Mapping[str, Any] | None = None,
                 http_client: httpx.AsyncClient | None = None) -> None:
        if http_client is not None and not isinstance(http_client, httpx.AsyncClient):
            raise TypeError(f"http_client is an httpx.AsyncClient (Client takes an httpx.Client), not "
                            f"{type(http_client).__name__}")
        super().__init__(base_url=base_url, api_key=api_key, timeout=api.timeout_with(timeout, http_client),
                         max_retries=max_retries,
                         default_headers=default_headers, default_query=default_query)
        self._http = http_client if http_client is not None else httpx.AsyncClient()  # as Client's
        self._owns_http = True
        self.completions = AsyncCompletions(self)
        self.sessions = AsyncSessions(self)
        self.models = AsyncModels(self)
        self.ws = AsyncWebSocket(self)

    async def _send(self, call: Call[Any], *, stream: bool = False) -> httpx.Response:
        """The answer to ``call``, retried as the policy allows; raises the APIError of a failure."""
        request = call.build(self._http, self)
        attempt, lost = 0, False
        before: APIError | None = None  # the last try's failure, the cause of the next one's
        while True:
            if self._http.is_closed:  # before the first try, or closed while a retry waited
                raise api.closed_error()
            try:
                response = await self._http.send(request, stream=stream)
                if not response.is_success:
                    await response.aread()  # the error body, even of a stream
            except httpx.DecodingError as err:  # never retried: the same answer comes again
                if stream:  # an error body read here (httpx closes the response of a call without stream)
                    await response.aclose()
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
                        await response.aclose()
                        raise api.given_up(wrong, before)
                    return response
                await response.aclose()
                if (done := self._done_before(call, response, lost)) is not None:
                    return done
                failed = api.given_up(api.error_from_response(response), before)
                if (delay := self._retry_delay(call, attempt, response)) is None:
                    raise failed
                before, lost = failed, lost or api.may_have_run(response=response)
            log.info("retrying %s %s in %.2f s (attempt %d)", call.method, call.path, delay, attempt + 1)
            await asyncio.sleep(delay)
            attempt += 1

    async def _call(self, call: Call[T]) -> T:
        return call.answer(await self._send(call))

    async def close(self) -> None:
        """See ``Client.close``."""
        await api.closes_begun()
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class AsyncCompletions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def create(self, *, model: str, prompt: api.Prompt = "", max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     stop: str | Sequence[str] | None = None, seed: int | None = None, logprobs: int | None = None,
                     echo: bool | None = None, n: int | None = None, user: str | None = None,
                     session_id: str | None = None, logit_bias: Mapping[str, float] | None = None,
                     frequency_penalty: float | None = None, presence_penalty: float | None = None,
                     stream_options: Mapping[str, bool] | None = None, extra_body: Mapping[str, Any] | None = None,
                     stream: Literal[False] = False, **options: Unpack[RequestOptions]) -> Completion: ...

    @overload
    async def create(self, *, model: str, prompt: api.Prompt = "", max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     stop: str | Sequence[str] | None = None, seed: int | None = None, logprobs: int | None = None,
                     echo: bool | None = None, n: int | None = None, user: str | None = None,
                     session_id: str | None = None, logit_bias: Mapping[str, float] | None = None,
                     frequency_penalty: float | None = None, presence_penalty: float | None = None,
                     stream_options: Mapping[str, bool] | None = None, extra_body: Mapping[str, Any] | None = None,
                     stream: Literal[True], **options: Unpack[RequestOptions]) -> AsyncStream: ...

    @overload  # a flag known only at run time (openai-python's third)
    async def create(self, *, model: str, prompt: api.Prompt = "", max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     stop: str | Sequence[str] | None = None, seed: int | None = None, logprobs: int | None = None,
                     echo: bool | None = None, n: int | None = None, user: str | None = None,
                     session_id: str | None = None, logit_bias: Mapping[str, float] | None = None,
                     frequency_penalty: float | None = None, presence_penalty: float | None = None,
                     stream_options: Mapping[str, bool] | None = None, extra_body: Mapping[str, Any] | None = None,
                     stream: bool, **options: Unpack[RequestOptions]) -> Completion | AsyncStream: ...

    async def create(self, *, model: str, prompt: api.Prompt = "", max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     stop: str | Sequence[str] | None = None, seed: int | None = None, logprobs: int | None = None,
                     echo: bool | None = None, n: int | None = None, user: str | None = None,
                     session_id: str | None = None, logit_bias: Mapping[str, float] | None = None,
                     frequency_penalty: float | None = None, presence_penalty: float | None = None,
                     stream_options: Mapping[str, bool] | None = None, extra_body: Mapping[str, Any] | None = None,
                     stream: bool = False, **options: Unpack[RequestOptions]) -> Completion | AsyncStream:
        """See ``Client.completions.create``; ``stream=True`` gives an ``AsyncStream``."""
        call = api.completion_call(api.completion_body(model, prompt, stream, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed,
            logprobs=logprobs, echo=echo, n=n, user=user, session_id=session_id, stream_options=stream_options,
            logit_bias=logit_bias, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty),
            extra_body)).using(options)
        if stream:
            return AsyncStream(await self._client._send(call, stream=True))
        return await self._client._call(call)


class AsyncSessions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, *, text: str | None = None, metadata: Mapping[str, str] | None = None,
                     **options: Unpack[BodyRequestOptions]) -> AppendResult:
        return await self._client._call(api.session_create_call(text, metadata).using(options))

    async def get(self, session_id: str, **options: Unpack[RequestOptions]) -> Session:
        return await self._client._call(api.session_get_call(session_id).using(options))

    def list(self, *, limit: int | None = None, after: str | None = None,
             order: Literal["asc", "desc"] | None = None, **options: Unpack[RequestOptions]) -> AsyncSessionPager:
        """``await`` it for one page (as the sync client's), or ``async for`` over it for every session."""
        api.session_list_call(limit, after, order).using(options)  # checked now, not when first awaited

        async def page(cursor: str | None, first: bool = False) -> AsyncSessionPage:
            call = api.session_list_call(limit, cursor, order).using(options if first else api.next_page(options))
            return AsyncSessionPage(**await self._client._call(call), _fetch=page)

        return AsyncSessionPager(lambda: page(after, first=True))

    async def update(self, session_id: str, *, metadata: Mapping[str, str | None],
                     **options: Unpack[BodyRequestOptions]) -> Session:
        """Change the session's metadata: the keys given are set, a key given as None is removed, the others
        stay (OpenAI's ``threads.update``). Its memory is untouched. A session a request is running on refuses
        it (``SessionBusyError``): that request's commit writes back the metadata it started with."""
        return await self._client._call(api.session_update_call(session_id, metadata).using(options))

    async def delete(self, session_id: str, **options: Unpack[RequestOptions]) -> SessionDeleted:
        return await self._client._call(api.session_delete_call(session_id).using(options))

    async def append(self, session_id: str, text: str, *, logprobs: int | None = None,
                     **options: Unpack[BodyRequestOptions]) -> AppendResult:
        return await self._client._call(api.session_append_call(session_id, text, logprobs).using(options))

    async def fork(self, session_id: str, *, metadata: Mapping[str, str] | None = None,
                   **options: Unpack[BodyRequestOptions]) -> Session:
        return await self._client._call(api.session_fork_call(session_id, metadata).using(options))

    async def export(self, session_id: str, **options: Unpack[RequestOptions]) -> dict[str, Any]:
        """The session as a small JSON document; see ``Client.sessions.export``."""
        return await self._client._call(api.session_export_call(session_id).using(options))

    async def import_(self, document: Mapping[str, Any], **options: Unpack[BodyRequestOptions]) -> AppendResult:
        """A new session rebuilt from an ``export`` document; retried only where it provably did not run."""
        return await self._client._call(api.session_import_call(document).using(options))


class AsyncModels:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self, **options: Unpack[RequestOptions]) -> list[Model]:
        return await self._client._call(api.models_call().using(options))


class AsyncWebSocket:
    """Completions over ``/v1/ws`` (see ``txlserve_client._websocket``)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    def connect(self, **options: Unpack[RequestOptions]) -> AsyncConnect:
        """``async with client.ws.connect() as conn`` (or ``conn = await client.ws.connect()``); ``options`` as
        ``Client.ws.connect``'s."""
        api.check_options(options, body=False, where="ws.connect()")
        return AsyncConnect(self._client, options)

    def stream(self, *, model: str, prompt: api.Prompt = "", **options: Any) -> AsyncWebSocketStream:
        """One completion on a connection of its own, opened when the stream is first read, closed with it;
        ``options`` as ``Client.ws.stream``'s."""
        request = api.request_options(options)
        api.check_options(request, body=False, where="ws.stream()")
        body = api.ws_completion_body(model, prompt, options, where="ws.stream()")
        return AsyncWebSocketStream({"type": "completion.create", **body},
                                    open=lambda: AsyncWebSocketConnection.open(self._client, request))
