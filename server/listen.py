"""The listening socket, in a module of its own: `txlserve serve` binds it before anything heavy is imported,
so a port in use is one line at once rather than after the model loads."""

from __future__ import annotations

import socket

from txlserve.errors import ConfigError


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads. Its protocol is named (IPPROTO_TCP, not 0): asyncio
    turns Nagle's algorithm off only on connections accepted from such a socket, and with it on, every response
    after the first on a kept-alive connection waited ~40 ms for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror or err} (choose another --port)") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock
