from __future__ import annotations

import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.clients.scripted_http import Scripted
from tests.live import LiveServer

# The client is its own distribution (clients/python); test the working tree's copy even where
# only the server was installed.
CLIENT_SRC = Path(__file__).resolve().parents[2] / "clients" / "python"
if str(CLIENT_SRC) not in sys.path:
    sys.path.insert(0, str(CLIENT_SRC))

from txlserve_client import AsyncClient, Client  # noqa: E402


@pytest.fixture
def client(server: LiveServer) -> Iterator[Client]:
    with Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture
async def aclient(server: LiveServer) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def grouped_server(checkpoint: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[LiveServer]:
    """A server whose streams send a chunk per 100,000 tokens: after the first, a reader waits in a read."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("grouped"),
                     args=("--stream-interval", "100000")).start()
    yield srv
    srv.stop()


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    srv = Scripted()
    thread = threading.Thread(target=srv.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()
