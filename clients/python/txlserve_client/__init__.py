"""Python client for txlserve: OpenAI-style completions, persistent sessions, and WebSocket streaming.

    from txlserve_client import Client

    with Client(base_url="http://127.0.0.1:8000") as client:
        session = client.sessions.create(text="ROMEO: ")
        with client.completions.create(model="txl-shakespeare-small", prompt="But soft", max_tokens=64,
                                       session_id=session.id, stream=True) as stream:
            for chunk in stream:
                print(chunk.text, end="", flush=True)

Light on purpose: it needs httpx and websockets only, never torch or the server.
"""

from httpx import Timeout

from txlserve_client._async_client import AsyncClient, AsyncCompletions, AsyncModels, AsyncSessions, AsyncWebSocket
from txlserve_client._async_websocket import AsyncWebSocketConnection, AsyncWebSocketStream
from txlserve_client._base import BodyRequestOptions, ClientOptions, RequestOptions, __version__
from txlserve_client._client import Client, Completions, Models, Sessions, WebSocket
from txlserve_client._exceptions import (
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    RequestCancelledError,
    ServiceUnavailableError,
    SessionBusyError,
    UnprocessableEntityError,
)
from txlserve_client._streaming import AsyncStream, Stream
from txlserve_client._types import (
    AppendResult,
    AsyncSessionPage,
    AsyncSessionPager,
    Choice,
    Completion,
    CompletionChunk,
    Logprobs,
    Model,
    Session,
    SessionDeleted,
    SessionPage,
    SessionRef,
    Usage,
)
from txlserve_client._websocket import WebSocketConnection, WebSocketStream

__all__ = [
    # clients
    "Client", "AsyncClient", "Timeout", "__version__",
    # what calls and with_options() take, for type hints
    "RequestOptions", "BodyRequestOptions", "ClientOptions",
    # their resources (client.completions, .sessions, .models, .ws)
    "Completions", "Sessions", "Models", "WebSocket", "AsyncCompletions", "AsyncSessions", "AsyncModels",
    "AsyncWebSocket",
    # results
    "Completion", "Choice", "CompletionChunk", "Usage", "Logprobs", "SessionRef", "Session", "AppendResult",
    "SessionDeleted", "SessionPage", "AsyncSessionPage", "AsyncSessionPager", "Model",
    # streams
    "Stream", "AsyncStream", "WebSocketConnection", "WebSocketStream", "AsyncWebSocketConnection",
    "AsyncWebSocketStream",
    # errors
    "APIError", "APIConnectionError", "APITimeoutError", "APIStatusError", "BadRequestError", "AuthenticationError",
    "PermissionDeniedError", "NotFoundError", "ConflictError", "SessionBusyError", "PayloadTooLargeError",
    "UnprocessableEntityError", "RateLimitError", "RequestCancelledError", "ServiceUnavailableError",
    "InternalServerError",
]
