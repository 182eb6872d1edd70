"""The listening socket, in a module of its own: `txlserve serve` binds it before anything heavy is imported,
so a port in use is one line at once rather than after the model loads."""

from __future__ import annotations

import errno
import socket
import sys

from txlserve.errors import ConfigError

REUSE_PORT = hasattr(socket, "SO_REUSEPORT") and sys.platform == "linux"  # where the kernel spreads connections
# Where a port can be claimed (claim_port: Linux's abstract sockets), a server holds it bound but not listening until
# it can answer; elsewhere it listens at once (two sockets with SO_REUSEADDR that do not listen may share a port).
HOLDS_PORT = sys.platform == "linux"
BACKLOG = 2048


def bind(host: str, port: int, *, group: bool = False, listen: bool = True) -> socket.socket:
    """The listening socket, bound before the model loads. Its protocol is named (IPPROTO_TCP, not 0): asyncio
    turns Nagle's algorithm off only on connections accepted from such a socket, and with it on, every response
    after the first on a kept-alive connection waited ~40 ms for the client's delayed ACK.

    ``group``: one of several sockets on the port (``SO_REUSEPORT``, Linux), each worker's own, among which the
    kernel spreads new connections evenly; ``listen=False`` holds the port for the group without taking any
    (the supervisor's, and a worker's until it can serve: :func:`start_listening`). One shared socket instead let
    the worker that woke first take a whole burst of connections: libuv accepts until none is left."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if group:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        port_taken = err.errno in (errno.EADDRINUSE, errno.EACCES)  # else the host: not a name or not this machine's
        raise ConfigError(f"cannot listen on {host}:{port}: {err.strerror or err} "
                          f"({'choose another --port' if port_taken else 'check --host'})") from None
    if listen:
        sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


def start_listening(sock: socket.socket) -> None:
    """Take connections from now on, once the server can serve them: before, a connection is refused, where one
    that listened during the load hung unanswered until it ended (a newcomer's first curl, a probe's timeout); and
    a worker's socket in the port's group joins the kernel's share of connections only then (a loading worker
    would hold its share unanswered while another's /ready says 200). On a socket already listening it only sets
    the backlog again."""
    try:
        sock.listen(BACKLOG)
    except OSError as err:  # a process that is not a txlserve (no claim) took the port since it was bound
        raise ConfigError(f"cannot listen on port {sock.getsockname()[1]}: {err.strerror or err} (choose another "
                          "--port)") from None


def claim_port(port: int) -> socket.socket | None:
    """A Linux abstract unix socket named after ``port``, held by ``txlserve serve`` (a supervisor of ``--workers``)
    while it runs: the sockets of a group share their port with any process of the same user that asks as they do,
    and two bound sockets that do not listen yet share it too, so without it a second ``txlserve serve`` on the port
    would join the first's group, or load beside the first until one of them failed to listen, rather than fail as
    a port in use does. Named after the port alone (``localhost`` and ``127.0.0.1`` are one address), so two servers
    on one port of two addresses of a machine are one too many. The kernel drops it when the process exits. None
    where it cannot be made (a sandbox that refuses abstract sockets): the caller listens at once then."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0txlserve-port-{port}")
    except OSError as err:
        sock.close()
        if err.errno != errno.EADDRINUSE:
            return None
        raise ConfigError(f"cannot listen on port {port}: it is in use by another txlserve serve (on this machine, "
                          "whatever its host; choose another --port)") from None
    return sock
