from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live import LiveServer, tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def server(checkpoint: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One shared server (no API keys) for tests that do not restart it."""
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("srv")).start()
    yield srv
    srv.stop()
