"""`txlserve bench serve`: load over loopback against a real server process, and the engine alone.

For each concurrency N, N clients stream completions, each continuing its own session,
for T seconds; in the same run the engine alone (same checkpoint, same thread count, no
HTTP) generates at batch N with full memories, and the ratio of the two is the server's
share of its engine. Between them, the engine loop alone (the server's scheduler thread fed
in-process: no HTTP, no store) splits that share into the engine loop's and the request
path's, and the engine alone waking a waiting thread once a step bounds the engine loop's
share on this host (what handing tokens to another thread or process costs at the least).
All alternate in rounds (``--rounds``), so that all see the same state of a machine whose
speed wanders. Where each loop's steps went is read from the loops themselves
(``server.scheduler.PHASES``; the server's from its /metrics at the load window's edges): the
microseconds a step in each phase, the tokens a step, and the share of its thread's wall time
spent on a CPU rather than waiting (for the GIL, the device or work). Then the product's reason
to exist: time to first token when continuing a long document from its session vs re-sending
the whole document.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import operator
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from txlserve.args import count, device, real
from txlserve.errors import CheckpointError, ConfigError

MODEL = "bench-model"  # the name a spawned server gets; with --url, read from /v1/models
PROMPT = " and"  # every request's prompt: each continues its own session


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Each request's ``max_tokens``: ``mean``, or with ``ratio`` r > 0 uniform over [mean (1 - r), mean (1 + r)]
    (vLLM's ``--random-range-ratio``). Requests of one length that start together end on the same step, so the
    bench's streams turn around in herds, all committing and asking again at once while the engine runs small
    batches; spread lengths do not stay in step, as a real load's do not. Each stream draws from its own seeded
    generator, so a run repeats."""

    mean: int
    ratio: float = 0.0
    seed: int = 0

    @property
    def bounds(self) -> tuple[int, int]:
        return max(1, round(self.mean * (1 - self.ratio))), max(1, round(self.mean * (1 + self.ratio)))

    def stream(self, i: int) -> Callable[[], int]:
        """Stream ``i``'s lengths, one per call."""
        lo, hi = self.bounds
        rng = random.Random(f"{self.seed}:{i}")
        return lambda: rng.randint(lo, hi)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] * 1e3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server:
    def __init__(self, checkpoint: str, data_dir: str, extra: list[str], workers: int = 1,
                 processes: int | None = None) -> None:
        """``processes``: how many answer /ready on the port (its workers or API servers; default ``workers``)."""
        processes = processes or workers
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "server.cli", "serve", "--checkpoint", checkpoint, "--port", str(self.port),
               "--data-dir", data_dir, "--model-name", MODEL, "--log-level", "warning", "--workers", str(workers),
               *extra]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (the server's stderr while it runs; shown if it fails)
        self.proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                                     stderr=self.log, env={**os.environ})
        deadline, ready = time.monotonic() + 120, set()
        # one client for every poll (each new one built a TLS context: 37 ms of CPU, taken from the starting
        # server), and a new connection for each (each connection is one worker's: ask on new ones until every
        # worker has answered)
        with httpx.Client(timeout=1, trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    r = http.get(self.url + "/ready")
                    if r.status_code == 200:
                        ready.add(r.json().get("worker"))
                        if len(ready) == processes:
                            return
                except httpx.HTTPError:
                    time.sleep(0.2)
        code = self.proc.poll()
        self.log.seek(0)
        tail = self.log.read().decode(errors="replace").strip().splitlines()[-20:]
        self.stop()
        state = f"exited with {code}" if code is not None else "was not ready within 120 s"
        raise ConfigError(f"the server {state} ({' '.join(cmd[2:])}); its log ends: " + " | ".join(tail[-5:]))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


class _Connection:
    """One keep-alive HTTP/1.1 connection that streams completions: the load generator's client, a few lines
    of asyncio. httpx (h11, anyio, line decoding) took ~0.4 of a core at 64 streams on the two cores the
    server shares with it (`client_cpu_s` reports what this one takes), and a starved client delays the very
    events it times. Plain ``http://`` only; every read has a deadline."""

    def __init__(self, url: str, model: str, timeout: float = 120, api_key: str | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        self.auth = b"Authorization: Bearer %s\r\n" % api_key.encode() if api_key else b""
        if parts.scheme != "http":
            raise ValueError(f"bench serve streams over plain http://, not {url!r}")
        self.host, self.port, self.model, self.timeout = parts.hostname, parts.port or 80, model, timeout
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> _Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()

    async def _read(self, read: Awaitable[bytes]) -> bytes:
        return await asyncio.wait_for(read, self.timeout)

    async def _send(self, raw: bytes) -> tuple[int, dict[str, str]]:
        """Send one request; its status and headers. A kept-alive connection the server has closed meanwhile
        (uvicorn closes idle ones after 5 s) is replaced once, before anything of the answer was read."""
        fresh = False
        while True:
            if self.writer is None or self.writer.is_closing() or self.reader.at_eof():
                await self.__aexit__()
                self.reader, self.writer = await asyncio.wait_for(
                    asyncio.open_connection(self.host, self.port), self.timeout)
                fresh = True
            self.writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\n%sContent-Type: application/json"
                              b"\r\nContent-Length: %d\r\n\r\n%s" % (self.host.encode(), self.port, self.auth,
                                                                      len(raw), raw))
            try:
                head = (await self._read(self.reader.readuntil(b"\r\n\r\n"))).decode("latin-1").split("\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as err:
                if fresh or getattr(err, "partial", b""):
                    raise
                self.writer.close()  # closed under us before it answered: once more, on a new connection
                continue
            return int(head[0].split()[1]), dict(h.lower().split(": ", 1) for h in head[1:] if h)

    async def _chunks(self) -> AsyncIterator[bytes]:
        while size := int((await self._read(self.reader.readuntil(b"\r\n")))[:-2], 16):
            yield (await self._read(self.reader.readexactly(size + 2)))[:-2]
        await self._read(self.reader.readuntil(b"\r\n"))  # the end of the chunked body

    async def events(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """POST ``body`` to /v1/completions and yield each ``data: {...}`` event of the stream, parsed; an
        answer other than 200 is raised with its status."""
        reusable = False
        try:
            status, headers = await self._send(json.dumps(body).encode())
            chunked = "chunked" in headers.get("transfer-encoding", "")
            if status != 200:
                text = b"".join([c async for c in self._chunks()]) if chunked else await self._read(
                    self.reader.readexactly(int(headers.get("content-length", 0))))
                reusable = headers.get("connection") != "close"
                raise RuntimeError(f"{status} {text[:200].decode(errors='replace')}")
            buffer = b""
            async for chunk in self._chunks():
                *complete, buffer = (buffer + chunk).split(b"\n\n")
                for event in complete:
                    if event.startswith(b"data: {"):
                        yield json.loads(event[6:])
            reusable = headers.get("connection") != "close"
        finally:
            if not reusable:  # a body left half read (an error, a timeout, a caller that stopped) or a close
                await self.__aexit__()
                self.writer = None


async def _stream(conn: _Connection, body: dict[str, Any], *, arrivals_of_tokens: bool = False
                  ) -> tuple[float, list[float], int, list[float]]:
    """Time to first token, the gaps between chunks with text, tokens (from the usage the server reports), and
    with ``arrivals_of_tokens`` when each token arrived (``perf_counter``): a chunk carries the tokens that were
    waiting when it was written (one, while the client keeps up), so each is counted by its ids
    (``return_token_ids``, which the first chunk answers with the prompt's: left out where not needed)."""
    t0 = time.perf_counter()
    ttft, gaps, last, n, arrivals, final_at = None, [], None, 0, [], None
    body = {"model": conn.model, "stream": True, "stream_options": {"include_usage": True}, **body,
            **({"return_token_ids": True} if arrivals_of_tokens else {})}
    async with contextlib.aclosing(conn.events(body)) as events:  # closed at once if this stops early
        async for chunk in events:
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            if not chunk["choices"]:
                continue
            now = time.perf_counter()
            choice = chunk["choices"][0]
            arrivals += [now] * len(choice.get("token_ids") or ())
            if choice["finish_reason"] is not None:
                final_at = now  # an event that says why it ended
            if not choice["text"]:
                continue
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
    if arrivals_of_tokens and len(arrivals) < n and final_at is not None:  # (a server that gives no ids)
        arrivals += [final_at] * (n - len(arrivals))
    return ttft or 0.0, gaps, n, arrivals


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _refused(what: str, r: httpx.Response) -> ConfigError:
    """A setup request the server refused, in one line: its status and message (a 401 without --api-key)."""
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:200]
    hint = " (give --api-key, or set TXLSERVE_API_KEY)" if r.status_code == 401 else ""
    return ConfigError(f"{what} answered {r.status_code}: {message}{hint}")


def served_model(url: str, api_key: str | None = None, checkpoint: str | None = None) -> str:
    """The model a running server serves (its first in /v1/models); with ``checkpoint``, refused unless it is
    that checkpoint's (its fingerprint): the engine alone runs ``checkpoint``, and a server of another model made
    a ratio of two models without a word (found by a helper)."""
    try:
        r = httpx.get(url + "/v1/models", timeout=30, headers=_auth(api_key))
    except httpx.HTTPError as err:
        raise ConfigError(f"no txlserve server answered /v1/models at {url}: {err or type(err).__name__}") from None
    if r.status_code != 200:
        raise _refused(f"{url}/v1/models", r)
    try:
        card = r.json()["data"][0]
        model = card["id"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise ConfigError(f"{url}/v1/models is not a txlserve server's answer: {err or type(err).__name__}") from None
    if checkpoint is not None and isinstance(card, dict) and card.get("fingerprint"):
        from model.checkpoint import read_meta

        try:
            mine = read_meta(checkpoint).get("fingerprint")
        except CheckpointError:  # not ours to read here (a Hugging Face directory): the engine's load says why
            mine = None
        theirs = str(card["fingerprint"]).split(":")[0]
        if mine and mine != theirs:  # (the weights' part: the server's adds its mem_len and clamp_len)
            raise ConfigError(f"the server at {url} serves another model than --checkpoint {checkpoint} (weights "
                              f"{theirs}, not {mine}), which the engine alone runs: give the server's checkpoint")
    return model


class EngineAlone:
    """The engine alone: ``batch`` sessions with full memories generating requests of ``tokens`` tokens (decode
    step plus sampling, as the server's loop does). :meth:`run` is timed like the load: tokens over wall time
    for a while, called before and after it so that both see the same state of a noisy machine."""

    def __init__(self, checkpoint: str, batch: int, tokens: int = 64, device: str = "auto",
                 enforce_eager: bool = False, overlap: bool = True) -> None:
        import torch

        from model.engine import Engine
        from model.graphs import GraphedStep, GraphedTable
        from model.train import auto_dtype, pick_device

        dev = pick_device(device)  # as the server picks its device and dtype
        self.engine = Engine.from_checkpoint(checkpoint, device=dev, dtype=auto_dtype(dev), enforce_eager=enforce_eager)
        self.batch, self.tokens = batch, tokens
        self.state = self.engine.new_state(batch)
        ids = torch.randint(32, 127, (batch, self.engine.mem_len), device=dev)
        self.engine.decoder.prefill(self.state, ids, chunk_size=self.engine.prefill_chunk)
        # the step at its fastest, as the server runs it: on a GPU one CUDA graph of this batch, and with overlap
        # (the server's default there) the step and its tokens' draw replayed on a graphed table of the batch's
        # rows, the host accepting one step's tokens while the next step runs
        self.overlap, self.table = overlap, None
        if self.engine.decoder.cuda_graphs and overlap:
            self.table = GraphedTable(self.engine.decoder, batch)
            self.table.capture_all()
            for r in range(batch):
                self.table.join(self.state.rows([r]))
        elif self.engine.decoder.cuda_graphs:
            self.step = GraphedStep(self.engine.decoder, self.state)
        else:
            self.step = lambda tokens: self.engine.decoder.step(self.state, tokens)
        self.generate(0)  # one request untimed, as the load warms up: the first steps trace and profile the
        # step's graph (at batch 1 the first half second read 808 against 1,040 tokens/s, and biased round 1)
        self.generated, self.elapsed = 0, 0.0

    def run(self, seconds: float) -> None:
        generated, elapsed = self.generate(seconds)
        self.generated += generated
        self.elapsed += elapsed

    def generate(self, seconds: float, wake: Callable[[], None] | None = None) -> tuple[int, float]:
        """Generate for at least ``seconds``; the tokens and seconds it took (not added to this timer's totals).
        With ``wake``, it is called once a step where the server's loop hands the step's tokens over (after
        sampling, before the step)."""
        from model.engine import Generation
        from model.sampling import SamplingParams

        t0, generated = time.perf_counter(), 0
        request = self._overlapped if self.table is not None else self._host_drawn
        while True:
            request([Generation(SamplingParams(max_tokens=self.tokens, temperature=0.8), self.engine.tokenizer)
                     for _ in range(self.batch)], wake)
            generated += self.batch * self.tokens
            if time.perf_counter() - t0 >= seconds:
                break
        return generated, time.perf_counter() - t0

    def _host_drawn(self, gens: list[Any], wake: Callable[[], None] | None) -> None:
        """One request a row, each step's tokens drawn on the host before the next step runs."""
        import torch

        from model.engine import Generation

        for _ in range(self.tokens):
            logits = self.state.last_logits.float().cpu()  # [batch, vocab]
            chosen = Generation.choose(gens, logits)  # as the server's loop samples
            for r, g in enumerate(gens):
                g.accept(chosen[r], logits, r)
            if wake is not None:
                wake()
            self.step(torch.tensor(chosen, device=self.engine.device)[:, None])

    def _overlapped(self, gens: list[Any], wake: Callable[[], None] | None) -> None:
        """One request a row, each step queued before the last one's tokens are accepted (the tokens drawn on the
        device), as the server's engine loop runs on a GPU."""
        temps, off = [0.8] * self.batch, [False] * self.batch
        drawn = self.table.draw([True] * self.batch, temps, [g.rng.random() for g in gens])
        for _ in range(self.tokens):
            queued = self.table.launch([0] * self.batch, off, temps, [g.rng.random() for g in gens])
            for g, token in zip(gens, drawn.tolist()):
                g.accept(token, None)
            if wake is not None:
                wake()
            drawn = queued

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.elapsed


class EngineWakeup:
    """The engine alone waking a thread that waits on a pipe once a step, as the server's loop wakes its event loop
    to hand each step's tokens over: the least any hand-off to another thread or process can cost, so its ratio to
    the engine alone bounds the engine loop's. The waiting thread does nothing when it wakes. On a host where waking
    an idle CPU is dear (a VM whose idle vCPUs halt at once) this read 0.90-0.91 of the engine at batch 1, and a
    reader in another process cost as much as a thread (BENCHMARKS.md, "The hand-off's floor")."""

    def __init__(self, alone: EngineAlone) -> None:
        self.alone = alone
        self.generated, self.elapsed = 0, 0.0

    def run(self, seconds: float) -> None:
        import threading

        read_end, write_end = os.pipe()

        def wait() -> None:
            while os.read(read_end, 4096):  # blocks (GIL released) until the engine writes; b"" once closed
                pass

        reader = threading.Thread(target=wait, name="bench-wakeup-reader", daemon=True)
        reader.start()
        try:
            generated, elapsed = self.alone.generate(seconds, wake=lambda: os.write(write_end, b"t"))
        finally:
            os.close(write_end)
            reader.join(10)
            os.close(read_end)
        self.generated += generated
        self.elapsed += elapsed

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.elapsed


class EngineLoop:
    """The server's engine loop (:class:`server.scheduler.Scheduler`, its own thread) fed from this process's
    event loop: ``batch`` clients each continuing its own full-memory session with the load's requests (the same
    prompt and lengths), every token handed to its client as the server hands it to a stream, but no HTTP,
    no store and no hot states. It sits between the engine alone and the server, so the gap between those two
    splits into the engine loop's share (threads, the hand-off of every token to the event loop, joining and
    leaving the batch, reading each prompt) and the request path's (HTTP, leases, commits, SSE)."""

    def __init__(self, alone: EngineAlone, prompt: str, lengths: Lengths | None = None,
                 stream_interval: int = 1) -> None:
        from server.scheduler import Scheduler

        self.engine, self.prompt = alone.engine, alone.engine.encode(prompt)
        self.lengths = lengths or Lengths(alone.tokens)
        self.states = [alone.state.rows([r]) for r in range(alone.batch)]  # each client's own session
        self.scheduler = Scheduler(self.engine, prefill_chunk=self.engine.prefill_chunk,  # the server's defaults
                                   stream_interval=stream_interval, overlap=alone.overlap)
        self.scheduler.start()
        self.generated, self.elapsed = 0, 0.0
        self.time = ZERO  # its loop over the runs' windows
        try:
            self.run(0)  # one request a client untimed, as the load and the engine alone warm up
        except BaseException:
            self.scheduler.stop()
            raise
        self.generated, self.elapsed, self.time = 0, 0.0, ZERO

    def run(self, seconds: float) -> None:
        asyncio.run(self._run(seconds))

    async def _run(self, seconds: float) -> None:
        from model.sampling import SamplingParams
        from server.scheduler import Finished

        t0 = time.perf_counter()
        end, counted = t0 + seconds, 0

        async def client(i: int) -> None:
            nonlocal counted
            draw = self.lengths.stream(i)
            while True:  # at least one request, as the engine alone runs at least one
                params = SamplingParams(max_tokens=draw(), temperature=0.8)
                stream: asyncio.Queue = asyncio.Queue()  # every token but the last, as a run hands them to SSE
                reader = asyncio.create_task(_drain(stream))
                async for item in self.scheduler.submit(self.states[i], self.prompt, params, stream=stream):
                    if isinstance(item, Finished):  # after the last token: the session to continue
                        self.states[i] = item.state
                        counted += item.completion_tokens
                reader.cancel()
                if time.perf_counter() >= end:
                    break

        async def window() -> None:  # from the start to ``end``: not the last requests' tail, when rows leave
            start = LoopTime.of(self.scheduler)
            await asyncio.sleep(seconds)
            self.time = self.time + (LoopTime.of(self.scheduler) - start)

        await asyncio.gather(window(), *(client(i) for i in range(len(self.states))))
        self.generated += counted
        self.elapsed += time.perf_counter() - t0

    def close(self) -> None:
        self.scheduler.stop()

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.elapsed


async def _drain(stream: asyncio.Queue) -> None:
    while True:
        await stream.get()


@dataclasses.dataclass
class _Window:
    """What one timed window of load saw, kept raw so that windows (rounds) add up."""

    duration: float
    tokens: int = 0  # token events that arrived inside the window
    reported: int = 0  # completion tokens of the requests that ran in it, as the server counted them
    requested: int = 0  # the max_tokens those requests asked for
    errors: int = 0
    samples: list[str] = dataclasses.field(default_factory=list)
    ttfts: list[float] = dataclasses.field(default_factory=list)
    gaps: list[float] = dataclasses.field(default_factory=list)
    cpu: float = 0.0
    engine: LoopTime | None = None  # the server's engine loop(s) over the window (/metrics), where it reports them


async def _session(setup: httpx.AsyncClient, text: str) -> str:
    r = await setup.post("/v1/sessions", json={"text": text})
    if r.status_code != 201:
        raise _refused("creating a session, the server", r)
    return r.json()["id"]


async def _sessions(url: str, concurrency: int, api_key: str | None = None) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=_auth(api_key)) as setup:
        return [await _session(setup, f"Client {i} writes: ") for i in range(concurrency)]


async def _engine_at(url: str, api_key: str | None, when: float) -> LoopTime | None:
    """The server's engine loop at ``when`` (``time.perf_counter``), read from its /metrics."""
    await asyncio.sleep(max(0.0, when - time.perf_counter()))
    return await asyncio.to_thread(LoopTime.scrape, url, api_key)


async def _load(url: str, model: str, sessions: list[str], duration: float, lengths: Lengths,
                api_key: str | None = None, first: int = 0, together: Callable[[], object] | None = None,
                scrape: bool = True) -> _Window:
    """Steady state: every stream first completes one unmeasured request (sessions, connections and the
    server's batch warm up), then all start together, and for ``duration`` seconds the tokens that arrive
    are counted. A request still running at the end is finished but counts only its tokens that arrived in
    the window, so the figure is the rate while all ``len(sessions)`` streams run, as the engine's is.
    ``first``: the first stream's number (its lengths' seed); ``together``: blocks until the other load
    processes' streams have warmed up too (:func:`_load_split`); ``scrape``: read the server's engine loop over
    the window from its /metrics (one process of a split load does)."""
    out = _Window(duration)
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(_Connection(url, model, api_key=api_key)) for _ in sessions]
        body = {"prompt": PROMPT, "max_tokens": lengths.mean, "temperature": 0.8}
        warm, go = asyncio.Semaphore(0), asyncio.Event()
        window: list[float] = []

        def failed(err: Exception, when: str = "") -> None:
            out.errors += 1
            if len(out.samples) < 3:
                out.samples.append(f"{when}{str(err)[:200]}")

        async def worker(i: int, c: _Connection, sid: str) -> None:
            draw = lengths.stream(first + i)
            try:
                await _stream(c, {**body, "session_id": sid})
            except Exception as err:
                failed(err, "warm-up: ")
            finally:
                warm.release()
            await go.wait()
            while time.perf_counter() < window[1]:
                asked = draw()
                try:
                    ttft, g, n, arrivals = await _stream(c, {**body, "session_id": sid, "max_tokens": asked},
                                                         arrivals_of_tokens=True)
                except Exception as err:
                    failed(err)
                    continue
                out.ttfts.append(ttft)
                out.gaps.extend(g)
                out.reported += n
                out.requested += asked
                out.tokens += sum(window[0] <= t <= window[1] for t in arrivals)

        tasks = [asyncio.create_task(worker(i, c, s)) for i, (c, s) in enumerate(zip(clients, sessions))]
        for _ in sessions:
            await warm.acquire()
        if together is not None:
            await asyncio.to_thread(together)
        # the engine loop read once every stream waits to start (its time until the start counts as idle), and at
        # the window's end: a reading within the window would leave out its start
        start = await asyncio.to_thread(LoopTime.scrape, url, api_key) if scrape else None
        if together is not None:  # the other load processes start once it is read
            await asyncio.to_thread(together)
        window.extend([time.perf_counter(), time.perf_counter() + duration])
        cpu0 = time.process_time()
        go.set()
        end = None if start is None else asyncio.create_task(_engine_at(url, api_key, window[1]))
        await asyncio.gather(*tasks)
        out.cpu = time.process_time() - cpu0  # this process: the load generator alone while the load runs
        if end is not None and (at_end := await end) is not None:
            out.engine = at_end - start
    return out


def _load_part(args: tuple[Any, ...], first: int, barrier: Any, results: Any) -> None:
    """One load process of :func:`_load_split` (spawned): its streams' window, as a dict, on ``results``."""
    window = asyncio.run(_load(*args, first=first, together=lambda: barrier.wait(SPLIT_TIMEOUT_S), scrape=first == 0))
    results.put(dataclasses.asdict(window))


SPLIT_TIMEOUT_S = 300.0  # a load process's warm-up, and its whole window's wait beyond the duration


def _load_split(url: str, model: str, sessions: list[str], duration: float, lengths: Lengths,
                api_key: str | None = None, processes: int = 1) -> _Window:
    """:func:`_load` over ``processes`` processes, the streams dealt among them, the windows added up: one
    asyncio client runs out at ~60,000 streamed tokens/s (``client_cpu_s`` at 16,000: ~0.25 of a core), under
    what a GPU's engine makes. The processes' streams start together, once every one has warmed up."""
    processes = min(processes, len(sessions))
    if processes <= 1:
        return asyncio.run(_load(url, model, sessions, duration, lengths, api_key))
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # this process runs threads (the engine alone's)
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    parts = [sessions[i::processes] for i in range(processes)]
    firsts = [sum(len(p) for p in parts[:i]) for i in range(processes)]  # streams numbered as in one process
    procs = [ctx.Process(target=_load_part, args=((url, model, part, duration, lengths, api_key), first, barrier,
                                                  results), daemon=True) for part, first in zip(parts, firsts)]
    for proc in procs:
        proc.start()
    try:
        windows = [_Window(**results.get(timeout=duration + SPLIT_TIMEOUT_S)) for _ in procs]
        for w in windows:  # came back as a dict
            w.engine = None if w.engine is None else LoopTime(**w.engine)
    except Exception as err:  # a load process that died (it printed why) or hung
        raise ConfigError(f"a load process of bench serve failed or hung ({type(err).__name__}); its error is "
                          "above") from None
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    total = _Window(duration)  # the same window, seen by every process: its counts add up, its samples join
    for w in windows:
        for f in dataclasses.fields(_Window):
            if f.name not in ("duration", "engine"):
                setattr(total, f.name, getattr(total, f.name) + getattr(w, f.name))
    total.samples = total.samples[:3]
    total.engine = next((w.engine for w in windows if w.engine is not None), None)  # one process read it
    return total


def _summary(concurrency: int, windows: list[_Window]) -> dict[str, Any]:
    duration = sum(w.duration for w in windows)
    ttfts = [t for w in windows for t in w.ttfts]
    gaps = [g for w in windows for g in w.gaps]
    tokens = sum(w.tokens for w in windows)
    return {"concurrency": concurrency, "duration_s": duration, "tokens": tokens, "tokens_per_s": tokens / duration,
            "requests": len(ttfts), "completion_tokens": sum(w.reported for w in windows),
            "requested_tokens": sum(w.requested for w in windows),
            "errors": sum(w.errors for w in windows), "error_samples": [s for w in windows for s in w.samples][:3],
            "ttft_p50_ms": _pct(ttfts, 0.5), "ttft_p99_ms": _pct(ttfts, 0.99),
            "itl_p50_ms": _pct(gaps, 0.5), "itl_p99_ms": _pct(gaps, 0.99),
            "client_cpu_s": sum(w.cpu for w in windows)}


@dataclasses.dataclass(frozen=True)
class LoopTime:
    """An engine loop's counters (``server.scheduler``): its thread's wall time by phase, its CPU time, its steps;
    the difference of two readings says where a window's steps went."""

    phases: dict[str, float]
    cpu: float | None
    steps: int
    tokens: int = 0  # generated
    # a server's: its requests' seconds and count by lifecycle phase (server.metrics.LIFECYCLE), and "ttft" and
    # "e2e", as its histograms sum them
    requests: dict[str, tuple[float, int]] = dataclasses.field(default_factory=dict)

    @staticmethod
    def of(scheduler: Any) -> LoopTime:
        return LoopTime(scheduler.loop_seconds(), scheduler.cpu_seconds(), scheduler.steps, scheduler.generated)

    @staticmethod
    def scrape(url: str, api_key: str | None = None) -> LoopTime | None:
        """A running server's, from /metrics (every engine's added up: ``--workers`` has one each, and the
        figures a step are then each engine's on average); None where it reports none (an older server) or does
        not answer."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            r = httpx.get(url + "/metrics", timeout=30, headers=_auth(api_key))
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        phases: dict[str, float] = {}
        cpu, steps, tokens = None, 0, 0
        requests: dict[str, list[float]] = {}
        histograms = {"txlserve_time_to_first_token_seconds": "ttft", "txlserve_e2e_request_latency_seconds": "e2e"}
        try:
            samples = [s for family in text_string_to_metric_families(r.text) for s in family.samples]
        except ValueError:  # not Prometheus's text: not a server that reports its loop
            return None
        for sample in samples:
            if sample.name == "txlserve_engine_loop_seconds_total":
                phases[sample.labels["phase"]] = phases.get(sample.labels["phase"], 0.0) + sample.value
            elif sample.name == "txlserve_engine_loop_cpu_seconds_total":
                cpu = (cpu or 0.0) + sample.value
            elif sample.name == "txlserve_decode_steps_total":
                steps += int(sample.value)
            elif sample.name == "txlserve_engine_loop_tokens_total":
                tokens += int(sample.value)
            elif sample.name.endswith(("_sum", "_count")):
                base, _, kind = sample.name.rpartition("_")
                what = (sample.labels.get("phase") if base == "txlserve_request_lifecycle_seconds"
                        else histograms.get(base))
                if what is not None:
                    requests.setdefault(what, [0.0, 0])[kind == "count"] += sample.value
        return LoopTime(phases, cpu, steps, tokens, {k: (v[0], int(v[1])) for k, v in requests.items()}) \
            if phases else None

    def _with(self, other: LoopTime, op: Callable[[Any, Any], Any]) -> LoopTime:
        """Field by field (a phase either lacks counts 0; a CPU time either lacks is unknown)."""
        cpu = None if self.cpu is None or other.cpu is None else op(self.cpu, other.cpu)
        phases = {k: op(self.phases.get(k, 0.0), other.phases.get(k, 0.0)) for k in self.phases | other.phases}
        requests = {k: tuple(op(a, b) for a, b in zip(self.requests.get(k, (0.0, 0)), other.requests.get(k, (0.0, 0))))
                    for k in self.requests | other.requests}
        return LoopTime(phases, cpu, op(self.steps, other.steps), op(self.tokens, other.tokens), requests)

    def __sub__(self, other: LoopTime) -> LoopTime:
        return self._with(other, operator.sub)

    def __add__(self, other: LoopTime) -> LoopTime:
        return self._with(other, operator.add)

    def report(self, prefix: str) -> dict[str, Any]:
        """What a load's JSON says of a loop over its windows: steps/s, the tokens a step (the rows generating,
        on average), each phase's microseconds a step, and the share of its wall time the thread ran on a CPU
        (the rest it waited: for the GIL, the device or work)."""
        wall = sum(self.phases.values())
        return {f"{prefix}_steps_per_s": self.steps / wall if wall else None,
                f"{prefix}_tokens_per_step": self.tokens / self.steps if self.steps else None,
                f"{prefix}_phase_us_per_step": {k: round(1e6 * v / self.steps, 1) for k, v in self.phases.items()}
                if self.steps else {},
                f"{prefix}_cpu_share": None if self.cpu is None or not wall else self.cpu / wall}

    def request_ms(self) -> dict[str, float]:
        """A server's requests that ended in the window: each lifecycle phase's mean milliseconds (they add up to
        a request's run), and the mean time to first token and end to end (HTTP: first byte in to last out). A
        phase left negative (a ``--workers`` worker that answered one of the window's two scrapes and not the
        other) is unknown, as one no request reached."""
        return {k: round(1e3 * seconds / n, 2) for k, (seconds, n) in self.requests.items() if n > 0 and seconds >= 0}


ZERO = LoopTime({}, 0.0, 0)  # what a sum of loop readings starts from


def _rate_since(timer: EngineAlone | EngineLoop | EngineWakeup, generated: int, elapsed: float) -> float:
    """Tokens/s of an engine-alone, engine-loop or wake-up timer since it stood at (``generated``, ``elapsed``)."""
    return (timer.generated - generated) / (timer.elapsed - elapsed)


def _against_engine(url: str, model: str, alone: EngineAlone, concurrency: int, duration: float, lengths: Lengths,
                    rounds: int, stream_interval: int = 1, api_key: str | None = None,
                    client_processes: int = 1) -> dict[str, Any]:
    """The load, the engine alone and the engine loop alone in ``rounds`` alternations (engine, engine loop,
    load, engine loop, engine; the next round...), each round's load compared with the slices on either side of
    it: on a machine whose speed wanders (a shared host's neighbours), a ratio of two figures taken seconds apart
    is steadier than of two taken a minute apart, and the rounds' spread shows how steady it was."""
    sessions = asyncio.run(_sessions(url, concurrency, api_key))
    engine_loop = EngineLoop(alone, PROMPT, lengths, stream_interval)
    wakeup = EngineWakeup(alone)
    try:
        windows, ratios, loop_ratios, wakeup_ratios = [], [], [], []
        for _ in range(rounds):
            before = {timer: (timer.generated, timer.elapsed) for timer in (alone, engine_loop, wakeup)}
            alone.run(duration / rounds / 4)
            wakeup.run(duration / rounds / 8)
            engine_loop.run(duration / rounds / 4)
            windows.append(_load_split(url, model, sessions, duration / rounds, lengths, api_key, client_processes))
            engine_loop.run(duration / rounds / 4)
            wakeup.run(duration / rounds / 8)
            alone.run(duration / rounds / 4)
            engine, looped, woken = (_rate_since(timer, *before[timer]) for timer in (alone, engine_loop, wakeup))
            ratios.append(windows[-1].tokens / windows[-1].duration / engine)
            loop_ratios.append(looped / engine)
            wakeup_ratios.append(woken / engine)
    finally:
        engine_loop.close()
    load = _summary(concurrency, windows)
    load["engine_tokens_per_s"] = alone.tokens_per_s
    load["server_over_engine"] = load["tokens_per_s"] / load["engine_tokens_per_s"]
    load["server_over_engine_rounds"] = ratios
    load["server_over_engine_median"] = statistics.median(ratios)
    load["engine_loop_tokens_per_s"] = engine_loop.tokens_per_s
    load["engine_loop_over_engine"] = engine_loop.tokens_per_s / alone.tokens_per_s
    load["engine_loop_over_engine_rounds"] = loop_ratios
    load["server_over_engine_loop"] = load["tokens_per_s"] / engine_loop.tokens_per_s
    load["engine_wakeup_tokens_per_s"] = wakeup.tokens_per_s  # the engine waking a waiting thread once a step
    load["engine_wakeup_over_engine"] = wakeup.tokens_per_s / alone.tokens_per_s  # bounds engine_loop_over_engine
    load["engine_wakeup_over_engine_rounds"] = wakeup_ratios
    # where each loop's steps went (server.scheduler.PHASES): the server's engine loop during the load (its
    # /metrics; absent from a server that reports none), and the engine loop alone during its slices
    if all(w.engine is not None for w in windows):
        server = sum((w.engine for w in windows), ZERO)
        load.update(server.report("server_engine_loop"))
        load["server_request_ms"] = server.request_ms()  # where its requests' time went
    load.update(engine_loop.time.report("engine_loop"))
    return load


async def _continue_vs_resend(url: str, model: str, doc: str, repeats: int,
                              api_key: str | None = None) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=_auth(api_key)) as setup:
        sid = await _session(setup, doc)  # a document over the server's limits: its 413, in one line
    async with _Connection(url, model, timeout=600, api_key=api_key) as c:
        cont, resend = [], []
        for _ in range(repeats):
            cont.append((await _stream(c, {"prompt": "\n", "max_tokens": 1, "session_id": sid}))[0])
            resend.append((await _stream(c, {"prompt": doc + "\n", "max_tokens": 1}))[0])
    c50, r50 = statistics.median(cont), statistics.median(resend)
    return {"doc_bytes": len(doc.encode()), "continue_ttft_ms": c50 * 1e3, "resend_ttft_ms": r50 * 1e3,
            "continue_speedup": r50 / c50}


async def _scored_beside_streams(url: str, model: str, sessions: list[str], text: str, logprobs: int,
                                 api_key: str | None = None) -> dict[str, Any]:
    """A long prompt scored (``echo`` with ``logprobs``: the largest response a request can ask for) while streams
    run, against the same streams alone for as long, in the same run: the streams' inter-token gaps and /health's
    latency beside it. A server that builds such a response on its event loop stalls every stream and probe for
    as long (it held them a second for a 47,000-token prompt)."""
    async def side(stop: asyncio.Event) -> tuple[list[float], list[float]]:
        gaps: list[float] = []
        health: list[float] = []

        async def stream(sid: str) -> None:
            async with _Connection(url, model, api_key=api_key) as c:
                while not stop.is_set():
                    gaps.extend((await _stream(c, {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.8,
                                                   "session_id": sid}))[1])

        async def probe(http: httpx.AsyncClient) -> None:
            while not stop.is_set():
                t = time.perf_counter()
                await http.get("/health")
                health.append(time.perf_counter() - t)
                await asyncio.sleep(0.005)
        async with httpx.AsyncClient(base_url=url, timeout=120, headers=_auth(api_key)) as http:
            await asyncio.gather(*(stream(sid) for sid in sessions), probe(http))
        return gaps, health

    def figures(gaps: list[float], health: list[float]) -> dict[str, Any]:
        return {"itl_p99_ms": _pct(gaps, 0.99), "itl_max_ms": _pct(gaps, 1.0), "health_p99_ms": _pct(health, 0.99),
                "health_max_ms": _pct(health, 1.0), "health_probes": len(health)}

    stop = asyncio.Event()
    running = asyncio.create_task(side(stop))
    await asyncio.sleep(0.5)  # the streams under way
    body = {"model": model, "prompt": text, "echo": True, "logprobs": logprobs, "max_tokens": 0}
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=_auth(api_key)) as http:
        t0 = time.perf_counter()
        r = await http.post("/v1/completions", json=body)
        scored_s = time.perf_counter() - t0
    stop.set()
    beside = figures(*await running)
    if r.status_code != 200:
        raise _refused("scoring the long prompt, the server", r)
    stop = asyncio.Event()
    running = asyncio.create_task(side(stop))
    await asyncio.sleep(0.5 + scored_s)
    stop.set()
    alone = figures(*await running)
    ratio = {f"{k[:-3]}_ratio": beside[k] / alone[k] for k in ("itl_max_ms", "health_max_ms") if alone[k]}
    return {"prompt_tokens": r.json()["usage"]["prompt_tokens"], "logprobs": logprobs, "streams": len(sessions),
            "scored_s": scored_s, "response_bytes": len(r.content), "beside": beside, "alone": alone, **ratio}


async def _batch_scored(url: str, model: str, prompts: list[str], repeats: int,
                        api_key: str | None = None) -> dict[str, Any]:
    """``prompts`` scored as lm-evaluation-harness's ``local-completions`` scores them (``echo``, ``logprobs`` 1,
    ``max_tokens`` 0): in one request (a batch), against the same prompts as requests one after another (its
    batch size 1) and all at once, in the same run; the median of ``repeats`` of each, alternated. The batch's
    scores are checked against the single requests'."""
    body = {"model": model, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    times: dict[str, list[float]] = {"batch": [], "sequential": [], "concurrent": []}
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=_auth(api_key)) as http:
        async def score(prompt: str | list[str]) -> list[dict[str, Any]]:
            r = await http.post("/v1/completions", json={**body, "prompt": prompt})
            if r.status_code != 200:
                raise _refused("scoring a batch of prompts, the server", r)
            return r.json()["choices"]

        async def timed(kind: str, work: Any) -> Any:
            t0 = time.perf_counter()
            out = await work
            times[kind].append(time.perf_counter() - t0)
            return out

        async def one_by_one() -> list[dict[str, Any]]:
            return [(await score(p))[0] for p in prompts]

        async def together() -> list[dict[str, Any]]:
            return [c[0] for c in await asyncio.gather(*(score(p) for p in prompts))]

        await score(prompts)  # warm: the first request's edges
        for _ in range(repeats):
            batch = await timed("batch", score(prompts))
            alone = await timed("sequential", one_by_one())
            await timed("concurrent", together())
    if [c["logprobs"]["tokens"] for c in batch] != [c["logprobs"]["tokens"] for c in alone]:
        raise ConfigError("the batch's choices read other tokens than its prompts alone")
    diff = max((abs(a - b) for x, y in zip(batch, alone, strict=True) for a, b in
                zip(x["logprobs"]["token_logprobs"][1:], y["logprobs"]["token_logprobs"][1:], strict=True)),
               default=0.0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"prompts": len(prompts), "prompt_chars": len(prompts[0]),
            "prompt_tokens": sum(len(c["logprobs"]["tokens"]) for c in batch),
            **{f"{k}_s": v for k, v in med.items()}, "batch_over_sequential": med["sequential"] / med["batch"],
            "batch_over_concurrent": med["concurrent"] / med["batch"], "max_logprob_diff": diff}


async def _samples(url: str, model: str, prompt: str, n: int, max_tokens: int, repeats: int,
                   api_key: str | None = None) -> dict[str, Any]:
    """``n`` samples of one prompt (best-of-n, self-consistency): one request with ``n``, whose choices read the
    prompt once, against ``n`` requests at once with seeds ``seed + j`` (which each read it: what a client without
    ``n`` sends, and what a request's choices did before they shared a read), in the same run; the median of
    ``repeats`` of each, alternated. Each choice's text is checked against its own request's."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0, "seed": 7}
    times: dict[str, list[float]] = {"n": [], "concurrent": []}
    async with httpx.AsyncClient(base_url=url, timeout=600, headers=_auth(api_key)) as http:
        async def complete(**extra: Any) -> dict[str, Any]:
            r = await http.post("/v1/completions", json={**body, **extra})
            if r.status_code != 200:
                raise _refused("sampling a prompt n times, the server", r)
            return r.json()

        async def timed(kind: str, work: Any) -> Any:
            t0 = time.perf_counter()
            out = await work
            times[kind].append(time.perf_counter() - t0)
            return out

        async def apart() -> list[str]:
            done = await asyncio.gather(*(complete(seed=7 + j) for j in range(n)))
            return [d["choices"][0]["text"] for d in done]

        await complete(n=n)  # warm: the first request's edges
        for _ in range(repeats):
            together = await timed("n", complete(n=n))
            alone = await timed("concurrent", apart())
    if [c["text"] for c in together["choices"]] != alone:
        raise ConfigError("a request's n choices drew other text than their own requests")
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"n": n, "prompt_chars": len(prompt), "prompt_tokens": together["usage"]["prompt_tokens"],
            "max_tokens": max_tokens, **{f"{k}_s": v for k, v in med.items()},
            "n_over_concurrent": med["concurrent"] / med["n"]}


def run(checkpoint: str, *, concurrency: tuple[int, ...] = (1, 16, 64), duration: float = 10, max_tokens: int = 64,
        doc_kb: float = 50, url: str | None = None, repeats: int = 3, device: str = "auto",
        rounds: int = 3, random_range_ratio: float = 0.0, seed: int = 0, stream_interval: int = 1,
        cpu_latency_qos_us: int | None = None, enforce_eager: bool = False, workers: int = 1,
        engine_process: bool = True, api_key: str | None = None, overlap: bool = True, api_server_count: int = 1,
        client_processes: int = 1, scored_kb: float = 0, scored_logprobs: int = 20,
        batch_prompts: int = 0, batch_prompt_chars: int = 512, samples: int = 0,
        sample_prompt_chars: int = 4096, sample_tokens: int = 16) -> dict[str, Any]:
    from bench.store import _document
    from model.threads import set_threads
    from server.cpu_latency import guest_halt_poll_ns

    set_threads(None)  # the server's default thread count, for the engine measured here
    qos_us = None if url else _spawned_qos(cpu_latency_qos_us)  # a bad value fails now, not after the run
    doc = _document(int(doc_kb * 1000)).decode("utf-8", errors="replace")
    lengths = Lengths(max_tokens, random_range_ratio, seed)
    loads = []
    with tempfile.TemporaryDirectory(prefix="txl-bench-serve-") as data_dir:
        qos = [] if cpu_latency_qos_us is None else ["--cpu-latency-qos-us", str(cpu_latency_qos_us)]
        qos += ["--enforce-eager"] if enforce_eager else []
        qos += [] if overlap else ["--disable-overlap-schedule"]
        qos += ["--engine-process" if engine_process else "--no-engine-process"]
        qos += ["--api-server-count", str(api_server_count)] if api_server_count > 1 else []
        server = None if url else _Server(checkpoint, data_dir, ["--device", device,
                                                                 "--stream-interval", str(stream_interval), *qos],
                                          workers, max(workers, api_server_count))
        target = url or server.url
        model = served_model(target, api_key, checkpoint if url else None)
        try:
            for n in concurrency:
                alone = EngineAlone(checkpoint, n, max_tokens, device, enforce_eager, overlap)
                loads.append(_against_engine(target, model, alone, n, duration, lengths, rounds, stream_interval,
                                             api_key, client_processes))
            result: dict[str, Any] = {"loads": loads}
            result.update(asyncio.run(_continue_vs_resend(target, model, doc, repeats, api_key)))
            if scored_kb:
                scored = _document(int(scored_kb * 1000)).decode("utf-8", errors="replace")
                result["scored_beside_streams"] = asyncio.run(_scored_beside_streams(
                    target, model, asyncio.run(_sessions(target, 4, api_key)), scored, scored_logprobs, api_key))
            if batch_prompts:
                size = batch_prompt_chars
                text = _document(size * batch_prompts).decode("utf-8", errors="replace")
                prompts = [text[i * size:(i + 1) * size] for i in range(batch_prompts)]
                result["batch_scored"] = asyncio.run(_batch_scored(target, model, prompts, repeats, api_key))
            if samples:
                prompt = _document(sample_prompt_chars).decode("utf-8", errors="replace")
                result["samples"] = asyncio.run(_samples(target, model, prompt, samples, sample_tokens, repeats,
                                                         api_key))
        finally:
            if server is not None:
                server.stop()
    result.update({"checkpoint": checkpoint, "model": model, "max_tokens": max_tokens, "rounds": rounds,
                   "random_range_ratio": random_range_ratio, "max_tokens_range": list(lengths.bounds), "seed": seed,
                   "url": url or "spawned", "engine_device": str(alone.engine.device),
                   "guest_halt_poll_ns": guest_halt_poll_ns(),
                   "stream_interval": stream_interval,  # the engine loop's, and the spawned server's
                   "enforce_eager": enforce_eager,  # the engine's and the spawned server's (no CUDA graphs)
                   "overlap_schedule": overlap,  # the same three's, on a GPU's graphed steps
                   "server_stream_interval": None if url else stream_interval,  # a running server's: unknown
                   # the spawned server's CPU latency QoS request (a flag, or its environment), in microseconds
                   "server_cpu_latency_qos_us": qos_us,
                   "server_workers": None if url else workers,
                   "server_api_server_count": None if url else api_server_count,
                   "client_processes": client_processes,
                   "server_engine_process": None if url else engine_process})  # the engine alone is always one process
    return result


def _spawned_qos(flag: int | None) -> int | None:
    """What the spawned server will hold: the flag, else the environment it inherits."""
    if flag is not None:
        return flag
    raw = os.environ.get("TXLSERVE_CPU_LATENCY_QOS_US", "").strip()
    try:
        return int(raw) if raw else None
    except ValueError:
        raise ConfigError(f"TXLSERVE_CPU_LATENCY_QOS_US={raw!r} is not a whole number") from None


def _counts(text: str) -> tuple[int, ...]:
    """Stream counts, e.g. 1,16,64."""
    return tuple(count(1)(x) for x in text.split(","))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="default: the bundled checkpoint (the engine alone runs it too)")
    p.add_argument("--url", default=None, help="an already running server (default: start one)")
    p.add_argument("--api-key", default=None, help="Bearer key for --url's server (default: $TXLSERVE_API_KEY)")
    p.add_argument("--concurrency", type=_counts, default=(1, 16, 64), help="streams, e.g. 1,16,64")
    p.add_argument("--duration", type=real(0, above=True), default=10, help="seconds of load per concurrency")
    p.add_argument("--rounds", type=count(1), default=3,
                   help="alternations of the engine alone, the engine waking a thread once a step, the engine loop "
                        "alone and the load per concurrency, the duration split among them (each round's ratios "
                        "are reported, and their median)")
    p.add_argument("--max-tokens", type=count(1), default=64,
                   help="each request's (its mean with --random-range-ratio)")
    p.add_argument("--random-range-ratio", type=real(0, 1, below=True), default=0.0,
                   help="spread each request's max_tokens uniformly over max-tokens x [1 - r, 1 + r] (as vLLM's "
                        "bench does); 0: every request the same length, so the streams end together and turn "
                        "around in herds")
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths --random-range-ratio draws")
    p.add_argument("--stream-interval", type=count(1), default=1,
                   help="the spawned server's and the engine loop's --stream-interval (with --url: the engine "
                        "loop's only; give the server the same)")
    p.add_argument("--cpu-latency-qos-us", type=int, default=None,
                   help="the spawned server's --cpu-latency-qos-us (a Linux CPU latency request held while "
                        "requests run; 0: idle CPUs poll instead of halting; needs write access to "
                        "/dev/cpu_dma_latency)")
    p.add_argument("--doc-kb", type=real(0, above=True), default=50,
                   help="kilobytes of the document timed two ways: continued from a session, and re-sent as a "
                        "prompt (time to first token of each)")
    p.add_argument("--scored-kb", type=real(0), default=0,
                   help="kilobytes of a prompt scored (echo with --scored-logprobs) while 4 streams run, against "
                        "those streams alone: their inter-token gaps and /health's latency beside the largest "
                        "response a request can ask for (0: not measured; the server's --max-logprobs-values "
                        "bounds it: 47 KB of a byte model's text at 20 logprobs)")
    p.add_argument("--scored-logprobs", type=count(0, 20), default=20, help="the scored prompt's logprobs")
    p.add_argument("--batch-prompts", type=count(0, 128), default=0,
                   help="prompts of --batch-prompt-chars scored as lm-evaluation-harness scores them (echo, "
                        "logprobs 1, max_tokens 0) in one request, against the same prompts as requests one after "
                        "another and all at once (0: not measured)")
    p.add_argument("--batch-prompt-chars", type=count(1), default=512,
                   help="each --batch-prompts prompt's length (a benchmark question's few sentences)")
    p.add_argument("--samples", type=count(0, 128), default=0,
                   help="n of one request sampling a --sample-prompt-chars prompt n times (its choices read the "
                        "prompt once), against n requests at once, each reading it (0: not measured)")
    p.add_argument("--sample-prompt-chars", type=count(1), default=4096, help="the --samples prompt's length")
    p.add_argument("--sample-tokens", type=count(1), default=16, help="each --samples choice's max_tokens")
    p.add_argument("--device", type=device, default="auto",
                   help="the spawned server's and the engine's (auto: cuda when present)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="the engine alone, the engine loop and the spawned server run their steps op by op (as "
                        "the server's --enforce-eager): no CUDA graphs, no traced graphs, no C kernels")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="the engine alone, the engine loop and the spawned server draw each step's tokens on the "
                        "host once the step is done (as the server's --disable-overlap-schedule); on a GPU they "
                        "are drawn on the device while the next step is queued by default")
    p.add_argument("--workers", type=count(1), default=1,
                   help="the spawned server's --workers (its threads default to each worker's share); the engine "
                        "alone stays one process, so with N > 1 the ratios compare N engines with one")
    p.add_argument("--api-server-count", type=count(1), default=1,
                   help="the spawned server's --api-server-count: N API server processes sharing one engine "
                        "process (the engine alone is that one engine)")
    p.add_argument("--client-processes", type=count(1), default=1,
                   help="processes the load generator's streams are dealt among (one asyncio client runs out at "
                        "~60,000 streamed tokens/s); client_cpu_s adds theirs up")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="the spawned server's engine in a process of its own (its default), or, with "
                        "--no-engine-process, on a thread of its process")
    p.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")


def main(ns: argparse.Namespace) -> int:
    from model.bundled import resolve_checkpoint

    print(json.dumps(run(resolve_checkpoint(ns.checkpoint), concurrency=ns.concurrency, duration=ns.duration,
                         max_tokens=ns.max_tokens, doc_kb=ns.doc_kb, url=ns.url, device=ns.device,
                         rounds=ns.rounds, random_range_ratio=ns.random_range_ratio, seed=ns.seed,
                         stream_interval=ns.stream_interval, cpu_latency_qos_us=ns.cpu_latency_qos_us,
                         enforce_eager=ns.enforce_eager, workers=ns.workers, engine_process=ns.engine_process,
                         overlap=not ns.disable_overlap_schedule, api_server_count=ns.api_server_count,
                         client_processes=ns.client_processes, scored_kb=ns.scored_kb,
                         scored_logprobs=ns.scored_logprobs, batch_prompts=ns.batch_prompts,
                         batch_prompt_chars=ns.batch_prompt_chars, samples=ns.samples,
                         sample_prompt_chars=ns.sample_prompt_chars, sample_tokens=ns.sample_tokens,
                         api_key=ns.api_key or os.environ.get("TXLSERVE_API_KEY") or None)))
    return 0
