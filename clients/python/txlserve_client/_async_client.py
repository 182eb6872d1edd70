"""The asynchronous client: ``AsyncClient`` and its resources over ``httpx.AsyncClient``.
It mirrors ``_client.py`` line for line; every request and answer is built and read by ``_base``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import httpx

from txlserve_client import _base as api
from txlserve_client._async_websocket import AsyncConnect, AsyncWebSocketConnection, AsyncWebSocketStream
from txlserve_client._base import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT, BaseClient, Call
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
                 max_retries: int = DEFAULT_MAX_RETRIES) -> None:
        super().__init__(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=max_retries)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self._headers(), timeout=self.timeout)
        self.completions = AsyncCompletions(self)
        self.sessions = AsyncSessions(self)
        self.models = AsyncModels(self)
        self.ws = AsyncWebSocket(self)

    async def _send(self, call: Call[Any], *, stream: bool = False) -> httpx.Response:
        """The answer to ``call``, retried as the policy allows; raises the APIError of a failure."""
        request = call.build(self._http)
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
        await api.closes_begun()
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
                     stream: Literal[False] = False) -> Completion: ...

    @overload
    async def create(self, *, model: str, prompt: api.Prompt = "", max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     stop: str | Sequence[str] | None = None, seed: int | None = None, logprobs: int | None = None,
                     echo: bool | None = None, n: int | None = None, user: str | None = None,
                     session_id: str | None = None, logit_bias: Mapping[str, float] | None = None,
                     frequency_penalty: float | None = None, presence_penalty: float | None = None,
                     stream_options: Mapping[str, bool] | None = None, extra_body: Mapping[str, Any] | None = None,
                     stream: Literal[True]) -> AsyncStream: ...

    @overload  # a flag known only at run time (openai-python's third)
    async def create(self, *, model: str, prompt: api.Prompt = "", max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     stop: str | Sequence[str] | None = None, seed: int | None = None, logprobs: int | None = None,
                     echo: bool | None = None, n: int | None = None, user: str | None = None,
                     session_id: str | None = None, logit_bias: Mapping[str, float] | None = None,
                     frequency_penalty: float | None = None, presence_penalty: float | None = None,
                     stream_options: Mapping[str, bool] | None = None, extra_body: Mapping[str, Any] | None = None,
                     stream: bool) -> Completion | AsyncStream: ...

    async def create(self, *, model: str, prompt: api.Prompt = "", max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     stop: str | Sequence[str] | None = None, seed: int | None = None, logprobs: int | None = None,
                     echo: bool | None = None, n: int | None = None, user: str | None = None,
                     session_id: str | None = None, logit_bias: Mapping[str, float] | None = None,
                     frequency_penalty: float | None = None, presence_penalty: float | None = None,
                     stream_options: Mapping[str, bool] | None = None, extra_body: Mapping[str, Any] | None = None,
                     stream: bool = False) -> Completion | AsyncStream:
        """See ``Client.completions.create``; ``stream=True`` gives an ``AsyncStream``."""
        call = api.completion_call(api.completion_body(model, prompt, stream, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed,
            logprobs=logprobs, echo=echo, n=n, user=user, session_id=session_id, stream_options=stream_options,
            logit_bias=logit_bias, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty), extra_body))
        if stream:
            return AsyncStream(await self._client._send(call, stream=True))
        return await self._client._call(call)


class AsyncSessions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, *, text: str | None = None, metadata: Mapping[str, str] | None = None) -> AppendResult:
        return await self._client._call(api.session_create_call(text, metadata))

    async def get(self, session_id: str) -> Session:
        return await self._client._call(api.session_get_call(session_id))

    def list(self, *, limit: int | None = None, after: str | None = None,
             order: Literal["asc", "desc"] | None = None) -> AsyncSessionPager:
        """``await`` it for one page (as the sync client's), or ``async for`` over it for every session."""
        async def page(cursor: str | None) -> AsyncSessionPage:
            return AsyncSessionPage(**await self._client._call(api.session_list_call(limit, cursor, order)),
                                    _fetch=page)

        return AsyncSessionPager(lambda: page(after))

    async def update(self, session_id: str, *, metadata: Mapping[str, str | None]) -> Session:
        """Change the session's metadata: the keys given are set, a key given as None is removed, the others
        stay (OpenAI's ``threads.update``). Its memory is untouched. A session a request is running on refuses
        it (``SessionBusyError``): that request's commit writes back the metadata it started with."""
        return await self._client._call(api.session_update_call(session_id, metadata))

    async def delete(self, session_id: str) -> SessionDeleted:
        return await self._client._call(api.session_delete_call(session_id))

    async def append(self, session_id: str, text: str, *, logprobs: int | None = None) -> AppendResult:
        return await self._client._call(api.session_append_call(session_id, text, logprobs))

    async def fork(self, session_id: str, *, metadata: Mapping[str, str] | None = None) -> Session:
        return await self._client._call(api.session_fork_call(session_id, metadata))

    async def export(self, session_id: str) -> dict[str, Any]:
        """The session as a small JSON document; see ``Client.sessions.export``."""
        return await self._client._call(api.session_export_call(session_id))

    async def import_(self, document: Mapping[str, Any]) -> AppendResult:
        """A new session rebuilt from an ``export`` document; retried only where it provably did not run."""
        return await self._client._call(api.session_import_call(document))


class AsyncModels:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self) -> list[Model]:
        return await self._client._call(api.models_call())


class AsyncWebSocket:
    """Completions over ``/v1/ws`` (see ``txlserve_client._websocket``)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    def connect(self) -> AsyncConnect:
        """``async with client.ws.connect() as conn`` (or ``conn = await client.ws.connect()``)."""
        return AsyncConnect(self._client)

    def stream(self, *, model: str, prompt: api.Prompt = "", **options: Any) -> AsyncWebSocketStream:
        """One completion on a connection of its own, opened when the stream is first read, closed with it."""
        body = api.completion_body(model, prompt, False, options, options.pop("extra_body", None))
        return AsyncWebSocketStream({"type": "completion.create", **body},
                                    open=lambda: AsyncWebSocketConnection.open(self._client))
