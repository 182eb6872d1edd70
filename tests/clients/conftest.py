from __future__ import annotations

import secrets
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.live import LiveServer

# The client is its own distribution (clients/python); test the working tree's copy even where
# only the server was installed.
CLIENT_SRC = Path(__file__).resolve().parents[2] / "clients" / "python"
if str(CLIENT_SRC) not in sys.path:
    sys.path.insert(0, str(CLIENT_SRC))

from txlserve_client import AsyncClient, Client  # noqa: E402


@dataclass(frozen=True)
class KeyedServer:
    live: LiveServer
    keys: tuple[str, str]  # random, so the sessions of these keys are only this run's

    @property
    def url(self) -> str:
        return self.live.url


@pytest.fixture(scope="session")
def keyed_server(checkpoint: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedServer]:
    """A server that requires one of two API keys; sessions belong to the key that made them."""
    keys = ("k1-" + secrets.token_hex(8), "k2-" + secrets.token_hex(8))
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("srv-keyed"),
                     args=("--api-keys", *keys)).start()
    yield KeyedServer(srv, keys)
    srv.stop()


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
