"""The engine in a process of its own (``--engine-process``), as vLLM runs its EngineCore: the scheduler's loop,
the model and the hot sessions on one side; HTTP, the store, tokenizing and each request's lease and commit on
the other.

Why: in one process the engine thread shares the interpreter with the event loop. Every Python tensor the step
frees hands the GIL over, and the engine thread then waits for the event loop to give it back, so a 64-stream
step took 12.8-14 ms in the server against 11.4 ms alone (BENCHMARKS.md, "Workers"). Here the engine process's
interpreter does nothing else, and what crosses is one message per step for all its tokens.

The wire: ``multiprocessing.connection.Connection`` byte messages (never its pickling ``send``), each a JSON head
and a blob: a session's tensors as safetensors, a prompt's ids as int32. A session's state never crosses: it
stays in the engine process, as the running request's rows and then in its hot set. A request names its session
by (id, revision); on a hot miss the engine asks for the stored tensors (``need``), the server reads them from Redis
and sends them (``state``). A finished request's state waits in the engine until the server has committed it and
says ``keep`` (under the committed revision) or ``drop``.

    server                                   engine process
      run {rid, key, ids, params, ...}  ->
                                        <-   need {rid}                (hot miss)
      state {rid, tokens_seen, ...}+blob ->
                                        <-   events {items: tokens, prompt scores, failures; stats}
                                        <-   finished {rid, ...}+blob  (what to commit)
      keep {rid, sid, revision} | drop   ->
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from memory_store.codec import INLINE_BYTES, safetensors_bytes
from model.bundled import resolve_checkpoint
from model.checkpoint import read_meta
from model.config import TXLConfig
from model.engine import Engine, Score, TokenEvent, readable_ids
from model.sampling import SamplingParams
from model.tokenizer import tokenizer_from_dict
from model.train import auto_dtype, pick_device
from server import core_spawn, logs
from server.hot_states import HotStates, Revision
from server.leave import leave_without_finalizing
from server.scheduler import Finished, Job, JobFailed, PromptScores, Scheduler, streamed
from server.session_state import extend_window, importable, persisted, rebuild_window, restore, stored_window
from txlserve import errors
from txlserve.errors import EngineDead, TxlError, Unavailable

log = logging.getLogger("txlserve.engine_core")

READY_TIMEOUT_S = 600.0  # load, kernel builds and the warm-up of the steps


# -- the wire -----------------------------------------------------------------------------------------
_ENCODE = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode  # a step's 64 tokens: 24 us, not 35


def pack(head: dict[str, Any], blob: bytes = b"") -> bytes:
    raw = _ENCODE(head).encode()
    return struct.pack("<I", len(raw)) + raw + blob


def unpack(data: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack_from("<I", data)
    return json.loads(data[4:4 + n]), data[4 + n:]


def ids_blob(ids: list[int]) -> bytes:
    """Token ids as int32 bytes: a long prompt packs ~50x faster than as JSON."""
    return array("i", ids).tobytes()


def ids_from(blob: bytes) -> list[int]:
    ids = array("i")
    ids.frombytes(blob)
    return ids.tolist()


def tensors_from(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load
    return load(blob) if blob else {}


def error_head(err: BaseException) -> dict[str, Any]:
    if isinstance(err, TxlError):
        return {"error": type(err).__name__, "message": err.message, "param": err.param}
    return {"error": None, "message": f"{type(err).__name__}: {err}", "param": None}


def error_from(head: dict[str, Any]) -> BaseException:
    """The engine's error as the server raises it: the same class of the one tree, or, for a bug, an error the
    server answers with a 500 (the engine logged its traceback)."""
    cls = getattr(errors, head.get("error") or "", None)
    if isinstance(cls, type) and issubclass(cls, TxlError):
        return cls(head["message"], param=head.get("param"))
    return RuntimeError(head["message"])


# -- the engine process ---------------------------------------------------------------------------------
@dataclass
class _Spec:
    """One request as the engine process holds it."""

    rid: int
    key: tuple[str, Revision] | None  # (session id, revision) to take from the hot set; None: a new state
    ids: list[int]
    params: SamplingParams | None
    prompt_logprobs: int | None
    persist: bool  # export what the server commits, and keep the state for its ``keep``
    scored: bool = True  # without params: score the text (an append), or only read it (max_tokens 0)
    prompt_ranks: bool = False  # each scored token's rank in the vocabulary too (vLLM's prompt_logprobs)
    window: list[int] | None = None
    window_span: int = 0  # the stored session's (its header's): what its window is cut to, at least
    tokens_before: int = 0
    source: str | None = None  # "hot" | "redis" | "rebuild" | None (a new state)
    rebuild_seen: int | None = None  # while its window is read: the tokens_seen to renumber it to
    job: Any = None
    cancelled: bool = False
    abandoned: bool = False  # the server will not read its end: nothing is kept for it
    started: float = field(default_factory=time.monotonic)
    restore_s: float | None = None  # until its state was ready (hot, imported or rebuilt): /metrics' restore time
    copies: list[_Spec] = field(default_factory=list)  # the other choices of its prompt, which it reads once


class Sender:
    """The engine process's end of the connection, shared by its threads. A small message (a step's tokens, a
    notice) is queued and sent by whichever thread holds the connection, in the order queued, so the engine's
    thread never waits for another's send; a large one (a finished session's tensors) is sent by the thread that
    made it, after what was queued before it. The engine's step hand-off (a few KB) used to wait ~0.5 ms behind
    the io thread's export of a session (a few hundred KB, which the server reads in turns): 5% of the engine
    thread's time at 64 streams."""

    LARGE = 1 << 16  # bytes: sent by its own thread, which may wait for the connection

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()  # held by the thread sending now
        self.queued: deque[bytes] = deque()

    def send(self, data: bytes) -> None:
        if len(data) > self.LARGE:
            with self.lock:
                self._drain()  # what was queued before it goes first
                self._write(data)
                self._drain()
        else:
            self.queued.append(data)
        while self.queued and self.lock.acquire(blocking=False):  # else the holder sends it after its own
            try:
                self._drain()
            finally:
                self.lock.release()  # then look again: a message queued just before the release is ours to send

    def _drain(self) -> None:
        while self.queued:
            self._write(self.queued.popleft())

    def stalled(self, stall_s: float | None) -> bool:
        """The one server of an engine is never dropped: a stall holds up only that server."""
        return False

    def close(self) -> None:
        """Nothing to stop: sends run on the callers' threads."""

    def _write(self, data: bytes) -> None:
        with contextlib.suppress(OSError):  # the server is gone: the reader thread ends this process
            self.conn.send_bytes(data)


class QueuedSender:
    """One connection of an engine process that several API servers share: every message is queued and sent by
    this connection's own thread, so a server that stops reading (stopped, or wedged) holds up only its own
    messages: never the engine's thread, the io thread, or another server's requests (a finished session's export,
    larger than the socket's buffer, had blocked the io thread and with it every server's commits). A send blocked
    for ``stall_s`` marks the server stalled (:meth:`stalled`), and the engine drops it."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self.queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.blocked_since: float | None = None  # when the send under way began
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def send(self, data: bytes) -> None:
        self.queue.put(data)

    def stalled(self, stall_s: float | None) -> bool:
        since = self.blocked_since
        return since is not None and stall_s is not None and time.monotonic() - since > stall_s

    def close(self) -> None:
        """Stop sending; a send blocked on a server that reads nothing is woken (its socket is shut down)."""
        self.queue.put(None)
        with contextlib.suppress(OSError):  # closed already
            _shut_down(self.conn)

    def _run(self) -> None:
        while (data := self.queue.get()) is not None:
            self.blocked_since = time.monotonic()
            try:
                self.conn.send_bytes(data)
            except OSError:  # that server is gone: the reader thread hears it too
                return
            finally:
                self.blocked_since = None


def _shut_down(conn: Connection) -> None:
    """Shut down ``conn``'s socket (both ways), waking a thread blocked sending on it; the descriptor stays open."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.close()


class _Box:
    """A job's inbox in the engine process: where its items go is its request id."""

    def __init__(self, spec: _Spec) -> None:
        self.spec = spec


class _Core:
    """The engine process: the reader thread (this one) takes requests; the scheduler's thread steps and sends
    each step's items through :meth:`call_soon_threadsafe` (the scheduler's hand-off to an event loop).

    It serves one connection per API server process (``--api-server-count``, as vLLM's API servers share one
    engine core): one batch, one hot set. Each server numbers its requests on its own, so here request ``rid`` of
    connection ``i`` of ``n`` is ``rid * n + i``, and every message about it goes back to connection ``i`` with its
    own number. A connection that closes (its server stopped, or died) abandons its requests; the process exits
    once every connection has."""

    def __init__(self, conns: list[Connection], settings: dict[str, Any]) -> None:
        self.conns, self.settings = conns, settings
        self.senders: list[Sender | QueuedSender] = [Sender(conns[0])] if len(conns) == 1 else [
            QueuedSender(conn, f"txlserve-engine-send-{i}") for i, conn in enumerate(conns)]
        self.stall_s = settings.get("stall_timeout_s") or None  # a server reading nothing this long is dropped
        self.live = set(range(len(conns)))  # connections not yet closed
        self.guard = threading.Lock()  # a request's start against its cancel, from different threads
        device = pick_device(settings["device"])
        self.checkpoint = resolve_checkpoint(settings["checkpoint"])
        self.engine = Engine.from_checkpoint(
            self.checkpoint, device=device,
            dtype=auto_dtype(device) if settings["dtype"] == "auto" else getattr(torch, settings["dtype"]),
            mem_len=settings["mem_len"], clamp_len=settings["clamp_len"], prefill_chunk=settings["prefill_chunk"],
            enforce_eager=settings["enforce_eager"], prefill_products=settings["prefill_products"])
        self.storage_dtype = getattr(torch, settings["storage_dtype"])
        self.scheduler = Scheduler(self.engine, max_batch=settings["max_batch"], batch_bytes=settings["batch_bytes"],
                                   prefill_chunk=self.engine.prefill_chunk,
                                   stream_interval=settings["stream_interval"],
                                   overlap=settings["overlap"])
        self.hot = HotStates(settings["hot_bytes"], report_evictions=True)
        # a large session's import (reading its stored tensors, projecting its keys and values) and export run
        # here, off the reader thread (which then still takes other requests' messages) and off the engine thread
        # (whose steps every stream waits for), as the in-process server runs them off its event loop; so does
        # every export while other requests run (_finished)
        self.large = self.engine.persisted_nbytes(self.storage_dtype) > INLINE_BYTES
        self.io = ThreadPoolExecutor(1, thread_name_prefix="txlserve-engine-io")
        self.specs: dict[int, _Spec] = {}  # accepted, not yet finished
        self.kept: dict[int, tuple[Any, list[int] | None]] = {}  # finished: state and window, awaiting keep/drop

    def send(self, head: dict[str, Any], blob: bytes = b"", to: int | None = None) -> None:
        """To the connection of the request it names (``rid``), the one each token came from (``items``), ``to``
        the one given, or else to every connection."""
        n = len(self.conns)
        if "items" in head and n > 1:
            split: dict[int, list[Any]] = {}
            for item in head["items"]:
                split.setdefault(item[0] % n, []).append([item[0] // n, *item[1:]])
            for i, items in split.items():
                self._send(i, pack({**head, "items": items}, blob))
            return
        if "items" in head:
            to = 0
        elif "rid" in head:
            to, head = head["rid"] % n, {**head, "rid": head["rid"] // n}
        data = pack(head, blob)
        for i in range(n) if to is None else (to,):
            self._send(i, data)

    def _send(self, i: int, data: bytes) -> None:
        if i in self.live:
            self.senders[i].send(data)

    def stats(self) -> list[int]:
        s, h = self.scheduler, self.hot
        return [s.batch_size, s.waiting, s.steps, h.nbytes, len(h), h.hits, h.misses, h.evictions]

    def serve(self) -> None:
        e = self.engine
        self.scheduler.start()
        self.scheduler.warmed.wait()
        self.send({"op": "ready", "fingerprint": e.fingerprint, "mem_len": e.mem_len, "clamp_len": e.clamp_len,
                   "window_len": e.window_len, "tokenizer_id": e.tokenizer_id, "capacity": self.scheduler.capacity,
                   "device": str(e.device), "prefill_chunk": e.prefill_chunk, "threads": torch.get_num_threads(),
                   "row_bytes": e.row_bytes, "checkpoint": self.checkpoint, "pid": os.getpid()})
        n = len(self.conns)
        look = 1.0 if n > 1 and self.stall_s else None  # how often a stalled server is looked for
        while self.live:
            for conn in wait([self.conns[i] for i in sorted(self.live)], look):
                i = self.conns.index(conn)  # type: ignore[arg-type]
                try:
                    head, blob = unpack(conn.recv_bytes())  # type: ignore[union-attr]
                except (EOFError, OSError):  # that server is gone
                    head, blob = {"op": "stop"}, b""
                if head["op"] == "stop":
                    self._left(i)
                    continue
                if "rid" in head:
                    head["rid"] = head["rid"] * n + i
                head["from"] = i
                self._handle(head, blob)
            for i in sorted(self.live) if look else ():
                if self.senders[i].stalled(self.stall_s):
                    log.error("engine process: API server %d has read nothing for %.0f s; dropping its connection "
                              "and its requests", i, self.stall_s)
                    self._left(i)
        self.scheduler.stop()
        self.io.shutdown(wait=False, cancel_futures=True)

    def _handle(self, head: dict[str, Any], blob: bytes) -> None:
        try:
            getattr(self, "_on_" + head["op"])(head, blob)
        except Exception as err:  # one request's bad input or bug fails that request alone
            rid = head.get("rid")
            if rid is None:
                log.exception("engine process: %s failed", head["op"])
                return
            if not isinstance(err, TxlError):
                log.exception("engine process: request %s failed", rid)
            self._fail(rid, err)

    def _left(self, i: int) -> None:
        """Connection ``i``'s server stopped (or stalled): its running requests are cancelled and nothing is kept
        for them. The scheduler's and io threads add and remove requests meanwhile: the connection leaves ``live``
        and the requests are listed under ``guard``, which an export holds to keep a state (:meth:`_export`)."""
        n = len(self.conns)
        with self.guard:
            self.live.discard(i)  # first: nothing more is sent or kept there
            running = [rid for rid in list(self.specs) if rid % n == i]
            for rid in [rid for rid in list(self.kept) if rid % n == i]:
                self.kept.pop(rid, None)
        for rid in running:
            self._on_cancel({"rid": rid, "abandon": True}, b"")
        self.senders[i].close()
        with contextlib.suppress(OSError):
            self.conns[i].close()

    def _work(self, rid: int, work: Callable[[], None], *, off_thread: bool) -> None:
        """A request's import, renumbering or export: on the io thread, or at once; a failure fails that request."""
        def run() -> None:
            try:
                work()
            except Exception as err:
                if not isinstance(err, TxlError):
                    log.exception("engine process: request %s failed", rid)
                self._fail(rid, err)
        if off_thread:
            self.io.submit(run)
        else:
            run()

    def _fail(self, rid: int, err: BaseException) -> None:
        if self.specs.pop(rid, None) is not None:
            self.send({"op": "events", "stats": self.stats(), "items": [[rid, "x", error_head(err)]]})

    # -- requests ------------------------------------------------------------------------------------------
    def _on_run(self, head: dict[str, Any], blob: bytes) -> None:
        key = (head["key"][0], tuple(head["key"][1])) if head["key"] else None  # JSON made the revision a list
        spec = _Spec(head["rid"], key, [], None, head["prompt_logprobs"], head["persist"], head.get("scored", True),
                     prompt_ranks=head.get("prompt_ranks", False))
        spec.window_span = head.get("window_span", 0)
        self.specs[spec.rid] = spec  # first: whatever fails below is answered (_fail)
        n = len(self.conns)
        copies = [_Spec(rid * n + head["from"], None, [], None, spec.prompt_logprobs, False, spec.scored,
                        prompt_ranks=spec.prompt_ranks)
                  for rid, _ in head.get("copies", ())]  # the prompt's other choices: each answered on its own
        self.specs.update((copy.rid, copy) for copy in copies)
        try:
            if copies and (key is not None or head.get("history")):
                raise RuntimeError("a prompt's choices share a new state, never a session's")
            spec.ids = ids_from(blob)
            spec.params = None if head["params"] is None else SamplingParams(**head["params"])
            for copy, (_, params) in zip(copies, head.get("copies", ())):
                copy.params = None if params is None else SamplingParams(**params)
            spec.copies = copies
            if spec.key is not None:
                hot = self.hot.take(*spec.key)
                if hot is None:
                    self.send({"op": "need", "rid": spec.rid})
                    return
                state, spec.window = hot
                spec.source, spec.tokens_before = "hot", int(state.seen[0])
                self._submit(spec, state)
            elif head.get("history"):
                window, seen = head["history"]
                spec.window = window
                self._rebuild(spec, window, seen)
            else:
                self._submit(spec, self.engine.new_state())
        except Exception as err:
            for copy in copies:
                self._fail(copy.rid, err)
            raise

    def _on_state(self, head: dict[str, Any], blob: bytes) -> None:
        self._work(head["rid"], lambda: self._state(head, blob), off_thread=self.large)

    def _state(self, head: dict[str, Any], blob: bytes) -> None:
        """The stored session the engine asked for: its hidden states (imported) or only its window (rebuilt)."""
        spec = self.specs.get(head["rid"])
        if spec is None:  # cancelled meanwhile
            return
        tensors, seen = tensors_from(blob), head["tokens_seen"]
        spec.window = stored_window(tensors)
        if importable(self.engine, tensors, head["fingerprint"]):
            spec.source, spec.tokens_before = "redis", seen
            self._submit(spec, restore(self.engine, tensors, seen, head["fingerprint"]))
        else:
            self._rebuild(spec, spec.window or [], seen)

    def _rebuild(self, spec: _Spec, window: list[int], seen: int) -> None:
        """Read the window into an empty state through the loop (batched with everything else); the request
        proper starts once it is read (:meth:`_finished`)."""
        window = rebuild_window(self.engine, window, seen, spec.key[0] if spec.key else None)
        spec.source, spec.tokens_before, spec.rebuild_seen = "rebuild", seen, seen
        self._enqueue(spec, self.engine.new_state(), window, None, scored=False, prompt_logprobs=None)

    def _submit(self, spec: _Spec, state: Any) -> None:
        spec.restore_s = time.monotonic() - spec.started
        self.scheduler.check(state, spec.ids, spec.params)
        self._enqueue(spec, state, spec.ids, spec.params, scored=spec.scored, prompt_logprobs=spec.prompt_logprobs,
                      prompt_ranks=spec.prompt_ranks)

    def _enqueue(self, spec: _Spec, state: Any, ids: list[int], params: SamplingParams | None, *, scored: bool,
                 prompt_logprobs: int | None, prompt_ranks: bool = False) -> None:
        last = ids[-1] if ids else spec.window[-1] if spec.window else None  # an empty prompt: the session's last
        job = Job(state, list(ids), params, self, _Box(spec), None, prev=last,  # type: ignore[arg-type]
                  scored=scored, prompt_logprobs=prompt_logprobs, prompt_ranks=prompt_ranks)
        # copies are a new state's, enqueued as their run message is read: never cancelled and answered below
        jobs = [(spec, job), *((copy, job.add_copy(copy.params, self, _Box(copy))) for copy in spec.copies)]
        spec.copies = []
        with self.guard:
            if self.specs.get(spec.rid) is not spec:  # cancelled and answered while its state was made
                return
            for each, each_job in jobs:
                each.job = each_job
                if each.cancelled:
                    each_job.cancel()
        self.scheduler.enqueue(job)

    def _on_cancel(self, head: dict[str, Any], _: bytes) -> None:
        """Stop a request within a step. ``abandon``: the server will not read its end either, so its state is
        not kept. A request that already ended is the server's to keep or drop."""
        with self.guard:
            spec = self.specs.get(head["rid"])
            if spec is None:
                return
            spec.cancelled, spec.abandoned = True, spec.abandoned or bool(head.get("abandon"))
            if spec.job is not None:
                spec.job.cancel()
                return
            self.specs.pop(spec.rid, None)  # waiting for its stored state: nothing was read
        self.send({"op": "finished", "rid": spec.rid, "state": False, "tokens_seen": spec.tokens_before,
                   "finish_reason": "cancelled", "stats": self.stats()})

    def _on_stats(self, head: dict[str, Any], _: bytes) -> None:
        """A scrape's figures: with the batch and hot set, where the engine loop's time went (only here: they
        would cost every step's message)."""
        self.send({"op": "stats", "qid": head["qid"], "stats": self.stats(),
                   "phases": self.scheduler.loop_seconds(), "cpu": self.scheduler.cpu_seconds(),
                   "generated": self.scheduler.generated, "prompt_tokens": self.scheduler.prompt_tokens},
                  to=head["from"])

    def _on_keep(self, head: dict[str, Any], _: bytes) -> None:
        kept = self.kept.pop(head["rid"], None)
        hot = kept is not None and self.hot.put(head["sid"], tuple(head["revision"]), *kept)  # JSON's list
        if not hot:
            self.hot.evicted.append(head["sid"])  # too big for the budget, or deleted meanwhile
        # to every server (/metrics' hot figures; a session's tier, whichever server is asked)
        self.send({"op": "evicted", "sids": self.hot.evicted, "kept": [head["sid"], head["revision"]] if hot else None,
                   "stats": self.stats()})
        self.hot.evicted.clear()

    def _on_drop(self, head: dict[str, Any], _: bytes) -> None:
        self.kept.pop(head["rid"], None)

    def _on_hot(self, head: dict[str, Any], _: bytes) -> None:
        if head["what"] == "deleted":
            self.hot.deleted(head["sid"])
            if len(self.conns) > 1:  # a request on it through another API server stops now, not at its lease's
                self.send({"op": "deleted", "sid": head["sid"]})  # next renewal (as one on the same server)
        else:
            self.hot.discard(head["sid"])

    # -- the scheduler's hand-off (its thread) -------------------------------------------------------------
    def call_soon_threadsafe(self, _deliver: Callable, items: list[tuple[_Box, Any]]) -> None:
        """What the scheduler hands an event loop once a step: here, one message for all its tokens (then one
        per finished request, with what to commit)."""
        out, finished = [], []
        for box, item in items:
            rid = box.spec.rid
            if isinstance(item, TokenEvent):
                event = [item.token, item.text, item.logprob, item.top_logprobs, item.finish_reason]
                if item.prev is not None or item.stop_reason is not None:  # a first token's, a last one's
                    event += [item.prev, item.stop_reason]
                out.append([rid, "t", event])
            elif isinstance(item, PromptScores):  # after the items before it, as arrays (ScoredTokens.to_bytes):
                if out:  # as JSON a long prompt's were parsed in 1.1 s, the GIL held, the event loop stalled
                    self.send({"op": "events", "stats": self.stats(), "items": out})
                    out = []
                self.send({"op": "scores", "rid": rid}, item.to_bytes())
            elif isinstance(item, JobFailed):
                if self.specs.pop(rid, None) is not None:
                    out.append([rid, "x", error_head(item.error)])
            elif isinstance(item, Finished):
                finished.append((box.spec, item))
        if out:
            self.send({"op": "events", "stats": self.stats(), "items": out})
        for spec, done in finished:
            try:
                self._finished(spec, done)
            except Exception as err:
                log.exception("engine process: finishing request %s failed", spec.rid)
                self._fail(spec.rid, err)

    def _finished(self, spec: _Spec, done: Any) -> None:
        if spec.rebuild_seen is not None:  # the window is read: place it at the session's positions, then run
            seen, spec.rebuild_seen = spec.rebuild_seen, None
            if done.state is None and spec.cancelled:  # as a request cancelled before its prompt was read
                done.tokens_seen = spec.tokens_before
            elif done.state is None:
                raise Unavailable("the session could not be rebuilt: the request was cancelled or the server is "
                                  "shutting down")
            else:
                def resume() -> None:
                    self.engine.renumber(done.state, seen)  # rolls every ring: a large one off the engine thread
                    self._submit(spec, done.state)
                self._work(spec.rid, resume, off_thread=self.large)
                return
        head = {"op": "finished", "rid": spec.rid, "state": done.state is not None, "tokens_seen": done.tokens_seen,
                "finish_reason": done.finish_reason, "completion_tokens": done.completion_tokens,
                "score": None if done.score is None else [done.score.tokens, done.score.logprob],
                "generated": done.generated, "queue_s": done.queue_s, "prefill_s": done.prefill_s,
                "text": done.text, "source": spec.source, "restore_s": spec.restore_s, "ended": done.ended}
        if done.state is None or not spec.persist or spec.abandoned:
            self.specs.pop(spec.rid, None)
            self.send({**head, "state": False if spec.abandoned else head["state"], "stats": self.stats(),
                       "sent": time.monotonic()})
        else:  # while other requests run, off the engine's thread: their steps do not wait for this export; an
            # idle engine's at once, without a thread's wake-up
            self._work(spec.rid, lambda: self._export(spec, done, head),
                       off_thread=self.large or self.scheduler.busy)

    def _export(self, spec: _Spec, done: Any, head: dict[str, Any]) -> None:
        """What the server commits, sent with the request's end; the state waits for its keep or drop."""
        window = extend_window(spec.window, spec.ids + done.generated, spec.tokens_before, self.engine.window_len,
                               spec.window_span)
        blob = safetensors_bytes(persisted(self.engine, done.state, window, self.storage_dtype))
        with self.guard:  # against a server leaving (_left): nothing is kept for a server that is gone
            if spec.rid % len(self.conns) in self.live:
                self.kept[spec.rid] = (done.state, window)
        self.specs.pop(spec.rid, None)  # only now: an export that fails is still answered (_fail)
        self.send({**head, "stats": self.stats(), "sent": time.monotonic()}, blob)  # its export done


def core_main() -> None:
    """The engine process: its connections' descriptors are argv[1], comma-separated; its settings come on stdin
    (they may hold nothing secret, but a command line is world-readable anyway)."""
    from model.threads import set_threads
    line = sys.stdin.readline()
    if not line:  # started early by a server that never took it (it failed first, or died): nothing to do
        return
    settings = json.loads(line)
    logs.configure(settings["log_level"], settings.get("log_format", "text"))
    set_threads(settings["threads"], processes=settings["processes"])
    sys.setswitchinterval(settings["switch_interval_ms"] / 1000)
    conns = [Connection(int(fd)) for fd in sys.argv[1].split(",")]
    try:
        core = _Core(conns, settings)
    except TxlError as err:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pack({"op": "failed", **error_head(err)}))
        sys.exit(2)  # as the servers will: a supervisor waits for their one line, not this exit's
    core.serve()
    leave_without_finalizing()  # its work answered; the teardown only delayed every stop


# -- the server's side -----------------------------------------------------------------------------------
@dataclass
class CoreFinished(Finished):
    """A request's end as the engine process reports it: ``state`` is True where the engine holds the session's
    state for the server's keep or drop (None: nothing was read, as a Finished's); ``tensors``: what to commit."""

    rid: int = 0
    source: str | None = None
    tensors: dict[str, torch.Tensor] | None = None
    restore_s: float | None = None
    sent: float | None = None  # time.monotonic() as the engine process sent it (its export done)


class Need:
    """The engine process missed the session in its hot set: send its stored tensors (:meth:`CoreRequest.provide`)."""


class CoreRequest:
    """One request in the engine process; ``async for`` yields (PromptScores,) TokenEvents, maybe one
    :class:`Need`, and ends with a :class:`CoreFinished`, or raises what failed it."""

    def __init__(self, core: EngineCore, rid: int, stream: asyncio.Queue | None) -> None:
        self.core, self.rid, self.stream = core, rid, stream
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.ended = False  # its CoreFinished or error came
        self.settled = False  # its state was kept or dropped
        self.abandoned = False  # closed before its end came: whatever state that end holds is dropped
        self.copies: list[CoreRequest] = []  # the other choices of its prompt (EngineCore.submit's ``copies``)

    def cancel(self, abandon: bool = False) -> None:
        """Stop it within a step (it still ends, with what it made). Never raises: a dead engine process has
        already failed the request."""
        if not self.ended:
            with contextlib.suppress(Unavailable):
                self.core.send({"op": "cancel", "rid": self.rid, "abandon": abandon})

    def provide(self, tensors: dict[str, torch.Tensor], *, tokens_seen: int, fingerprint: str | None) -> None:
        """Send the session's stored tensors (serialized by the writer thread, off the event loop)."""
        head = {"op": "state", "rid": self.rid, "tokens_seen": tokens_seen, "fingerprint": fingerprint}
        self.core.send(head, lambda: safetensors_bytes(tensors) if tensors else b"")

    def keep(self, session_id: str, revision: Revision) -> None:
        """The committed state goes into the engine's hot set as ``revision``. The hot set is a cache: with the
        engine process gone, the commit still stands."""
        self.settled = True
        with contextlib.suppress(Unavailable):
            self.core.send({"op": "keep", "rid": self.rid, "sid": session_id, "revision": revision})
            if self.core.row_bytes <= self.core.hot_bytes:  # what HotStates.put refuses stays out of the copy
                self.core.hot.revisions[session_id] = revision

    def close(self) -> None:
        """However the request ends on this side: a state the engine holds for it is dropped, and a request still
        running there (this side failed, say while reading its session from Redis) is cancelled and abandoned,
        so neither process keeps anything for it."""
        if not self.ended:
            self.abandoned = True
            self.cancel(abandon=True)  # its end still comes: the reader drops what it holds
        elif not self.settled:
            self.drop()

    def drop(self) -> None:
        self.settled = True
        with contextlib.suppress(Unavailable):
            self.core.send({"op": "drop", "rid": self.rid})

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            item = await self.inbox.get()
            if isinstance(item, BaseException):
                self.ended = True
                raise item
            if isinstance(item, CoreFinished):
                self.ended = True
                yield item
                return
            yield item


class EngineCore:
    """The server's handle on its engine process: the facts requests need (fingerprint, window), submission, the
    hot set's counters for /metrics, and the process's life (started with the server, stopped with it; if it
    dies, every request fails with a 503 and /ready says so)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.requests: dict[int, CoreRequest] = {}
        self.stats_waiting: dict[int, asyncio.Future] = {}  # refresh() calls, by query id
        self._out: queue.SimpleQueue[tuple[dict[str, Any], Any] | None] = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self.batch_size = self.waiting = self.steps = 0
        self._loop_seconds: dict[str, float] = {}  # the engine loop's, as of the last refresh (a scrape)
        self.generated = 0  # the tokens its loop generated, as of the last refresh
        self.prompt_tokens = 0  # the prompt tokens its loop read, as of the last refresh
        self._cpu_seconds: float | None = None
        self.hot = _HotCounters(self)
        self.dead: str | None = None
        self.on_death: Callable[[str], None] | None = None
        self.on_deleted: Callable[[str], None] | None = None  # a session deleted through another API server
        self.proc: subprocess.Popen[bytes] | None = None  # None: a shared engine process, the supervisor's
        self.pid: int | None = None

    def loop_seconds(self) -> dict[str, float]:
        """The engine loop thread's wall time by phase, as of the last refresh."""
        return self._loop_seconds

    def cpu_seconds(self) -> float | None:
        """The engine loop thread's CPU time, as of the last refresh."""
        return self._cpu_seconds

    # facts the server reads as it reads an Engine's
    def encode(self, text: str | bytes) -> list[int]:
        return readable_ids(self.tokenizer.encode(text), self.config.vocab_size, self.tokenizer.vocab_size)

    check_window = Engine.check_window  # needs only window_len, mem_len and config.vocab_size

    def start(self) -> None:
        """Spawn the engine process, or take the shared one's connection (an API server of a supervisor's engine
        process, :func:`core_spawn.attach`), and wait until it has warmed its steps (blocking: run it in a
        thread)."""
        head: dict[str, Any] | None = None
        shared = core_spawn.take_attached()
        if shared is not None:  # the supervisor started it and gave it its settings
            self.conn = Connection(shared.detach())
        else:
            self.proc, ours = core_spawn.take() or core_spawn.spawn()  # started early by `txlserve serve`, or now
            self.conn = Connection(ours.detach())
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps(self.settings).encode() + b"\n")
                self.proc.stdin.close()
            except OSError:  # it died before it read them (a broken pipe): as one that died loading
                head = {"op": "exited"}
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while head is None:
            if self.conn.poll(1.0):
                try:
                    head, _ = unpack(self.conn.recv_bytes())
                except (EOFError, OSError):
                    head = {"op": "exited"}
            elif (self.proc is not None and self.proc.poll() is not None) or time.monotonic() > deadline:
                head = {"op": "exited"}
        if head["op"] == "failed":
            self.stop()
            raise error_from(head)
        if head["op"] != "ready":
            self.stop()
            status = "" if self.proc is None else f" (status {self.proc.poll()})"
            raise Unavailable(f"the engine process exited while loading{status}; its log says why")
        self.pid = head["pid"]
        self.fingerprint, self.mem_len, self.clamp_len = head["fingerprint"], head["mem_len"], head["clamp_len"]
        self.window_len, self.tokenizer_id, self.capacity = head["window_len"], head["tokenizer_id"], head["capacity"]
        self.device, self.prefill_chunk = torch.device(head["device"]), head["prefill_chunk"]
        self.threads, self.row_bytes, self.hot_bytes = head["threads"], head["row_bytes"], self.settings["hot_bytes"]
        meta = read_meta(head["checkpoint"])
        self.config = TXLConfig.from_dict(meta["model"]).replace(mem_len=self.mem_len, clamp_len=self.clamp_len)
        self.tokenizer = tokenizer_from_dict(meta.get("tokenizer", {"type": "byte"}))

    def listen(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's messages on a thread of ours, handing them to ``loop`` in batches."""
        self.loop = loop
        self._reader = threading.Thread(target=self._read, name="txlserve-engine-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="txlserve-engine-writer", daemon=True)
        self._writer.start()

    def _read(self) -> None:
        why = "the engine process exited" if self.proc is not None else (
            "the shared engine process closed this API server's connection (it exited, or it dropped this server "
            "after it read nothing for --engine-timeout-s)")
        try:
            while True:
                batch = [self._next()]
                while self.conn.poll(0):
                    batch.append(self._next())
                with contextlib.suppress(RuntimeError):
                    self.loop.call_soon_threadsafe(self._dispatch, batch)
        except (EOFError, OSError):
            pass
        except Exception as err:  # pragma: no cover - a bug in the wire
            why = f"the engine process's messages could not be read: {err}"
            log.exception("reading the engine process failed")
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._died, why)

    def _next(self) -> dict[str, Any]:
        head, blob = unpack(self.conn.recv_bytes())
        if head["op"] == "scores":  # read here, off the event loop, as a commit's tensors
            head["scores"] = PromptScores.from_bytes(blob)
        elif blob:  # what a finished request commits
            head["tensors"] = tensors_from(blob)
        return head

    def _died(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        self.hot.revisions.clear()  # its hot copies died with it: a session's tier is what Redis holds
        code = None if self.proc is None else self.proc.poll()
        if not getattr(self, "stopping", False):
            log.error("%s (status %s): failing its requests", why, code)
        err = EngineDead.because(why)
        for req in self.requests.values():
            req.inbox.put_nowait(err)
        self.requests.clear()
        if self.on_death is not None and not getattr(self, "stopping", False):
            self.on_death(why)

    def _dispatch(self, batch: list[dict[str, Any]]) -> None:
        for head in batch:
            op = head["op"]
            if "stats" in head:
                self.hot.update(head["stats"])
            if op == "events":
                for rid, kind, payload in head["items"]:
                    req = self.requests.get(rid)
                    if req is None:
                        continue
                    if kind == "t":
                        token, text, logprob, top, reason, *ends = payload
                        item: Any = TokenEvent(token, text, logprob, None if top is None else [tuple(t) for t in top],
                                               reason, *ends)  # (prev, stop_reason) where either is known
                        (req.stream if req.stream is not None and streamed(item) else req.inbox).put_nowait(item)
                    else:
                        self.requests.pop(rid, None)
                        req.inbox.put_nowait(error_from(payload))
            elif op == "scores":
                req = self.requests.get(head["rid"])
                if req is not None:
                    (req.stream or req.inbox).put_nowait(head["scores"])
            elif op == "need":
                req = self.requests.get(head["rid"])
                if req is not None:
                    req.inbox.put_nowait(Need())
            elif op == "finished":
                req = self.requests.pop(head["rid"], None)
                if req is None:
                    continue
                if req.abandoned:  # nobody reads this end
                    req.ended = True
                    if head["state"]:
                        req.drop()
                    continue
                score = None if head.get("score") is None else Score(*head["score"])
                req.inbox.put_nowait(CoreFinished(
                    head["state"] or None, head["tokens_seen"], head["finish_reason"],
                    head.get("completion_tokens", 0), score, head.get("generated") or [], head.get("queue_s"),
                    head.get("prefill_s"), head.get("text", ""), head.get("ended"), rid=head["rid"],
                    source=head.get("source"), tensors=head.get("tensors"), restore_s=head.get("restore_s"),
                    sent=head.get("sent")))
            elif op == "stats":
                self._loop_seconds, self._cpu_seconds = head.get("phases", {}), head.get("cpu")
                self.generated = head.get("generated", 0)
                self.prompt_tokens = head.get("prompt_tokens", 0)
                fut = self.stats_waiting.pop(head["qid"], None)
                if fut is not None and not fut.done():
                    fut.set_result(None)
            elif op == "deleted":  # through another API server of this engine
                if self.on_deleted is not None:
                    self.on_deleted(head["sid"])
            elif op == "evicted":
                for sid in head["sids"]:
                    self.hot.revisions.pop(sid, None)
                if head.get("kept"):  # another API server's commit, kept hot by the engine they share
                    self.hot.revisions[head["kept"][0]] = tuple(head["kept"][1])

    async def answers(self, timeout_s: float) -> bool:
        """Whether the engine process answers a ping within ``timeout_s`` (its reader thread answers, so a long
        prompt being read does not keep it from it; a stopped or wedged process does)."""
        qid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self.stats_waiting[qid] = fut
        try:
            self.send({"op": "stats", "qid": qid})
            await asyncio.wait_for(fut, timeout_s)
            return True
        except (Unavailable, asyncio.TimeoutError):
            return False
        finally:
            self.stats_waiting.pop(qid, None)

    def kill(self, why: str) -> None:
        """Take a hung engine process for dead: kill it and fail its requests. A shared one too: its supervisor
        then stops every API server, for whatever supervises the server to restart it."""
        with contextlib.suppress(OSError):
            if self.proc is not None:
                self.proc.kill()
            elif self.pid is not None:
                os.kill(self.pid, signal.SIGKILL)
        self._died(why)

    async def refresh(self, timeout_s: float = 2.0) -> None:
        """Ask the engine for its batch and hot-set figures now (a scrape of /metrics): they otherwise come with its
        messages, and none comes while it only reads a long prompt. An engine that does not answer in time leaves
        the last figures."""
        await self.answers(timeout_s)

    def send(self, head: dict[str, Any], blob: bytes | Callable[[], bytes] = b"") -> None:
        """Queue a message for the writer thread (``blob``: its bytes, or what makes them there), in order: the
        event loop never waits for a long prompt's or a large session's packing and sending."""
        if self.dead is not None:
            raise EngineDead.because(self.dead)
        self._out.put((head, blob))

    def _write(self) -> None:
        while (item := self._out.get()) is not None:
            head, blob = item
            try:
                self.conn.send_bytes(pack(head, blob() if callable(blob) else blob))
            except OSError:  # the engine process is gone: the reader thread says so
                return
            except Exception:  # pragma: no cover - a bug in packing fails that message alone
                log.exception("sending %s to the engine process failed", head.get("op"))

    def submit(self, ids: list[int], params: SamplingParams | None, *, key: tuple[str, Revision] | None = None,
               history: tuple[list[int], int] | None = None, persist: bool, prompt_logprobs: int | None = None,
               prompt_ranks: bool = False, scored: bool = True, stream: asyncio.Queue | None = None,
               window_span: int = 0,
               copies: Sequence[tuple[SamplingParams | None, asyncio.Queue | None]] = ()) -> CoreRequest:
        """Start a request in the engine: on session ``key`` (id, revision) or a new state (``history``: a
        window to rebuild from, and its tokens_seen); ``persist``: it ends with what to commit. ``copies``: the
        same prompt's other choices (their sampling and stream) on new states, each a request of its own (the
        result's ``copies``, never persisted); the engine reads the prompt once for all of them."""
        rid = next(self._ids)
        if key is not None:  # the engine takes it out of its hot set
            self.hot.revisions.pop(key[0], None)
        req = CoreRequest(self, rid, stream)
        req.copies = [CoreRequest(self, next(self._ids), s) for _, s in copies]
        for each in (req, *req.copies):
            self.requests[each.rid] = each
        try:
            self.send({"op": "run", "rid": rid, "key": list(key) if key else None,
                       "params": None if params is None else asdict(params), "prompt_logprobs": prompt_logprobs,
                       "prompt_ranks": prompt_ranks, "history": list(history) if history else None,
                       "persist": persist, "scored": scored, "window_span": window_span,
                       "copies": [[c.rid, None if p is None else asdict(p)] for c, (p, _) in zip(req.copies, copies)]},
                      lambda: ids_blob(ids))
        except BaseException:
            for each in (req, *req.copies):
                self.requests.pop(each.rid, None)
            raise
        return req

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine process to stop (it fails what is still running), wait, then kill it."""
        self.stopping = True
        with contextlib.suppress(Exception):
            self.send({"op": "stop"})
        self._out.put(None)
        writer = getattr(self, "_writer", None)
        if writer is None:  # stopped before it listened (a failed start): nothing else is queued
            with contextlib.suppress(Exception):
                self.conn.send_bytes(pack({"op": "stop"}))
        else:
            writer.join(timeout)
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not stop within %.0f s; killing it", timeout)
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            self.conn.close()


class _HotCounters:
    """The engine process's batch and hot-set figures, as its last message said, read by /metrics, and the hot
    set's operations the server asks for."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.nbytes = self.count = self.hits = self.misses = self.evictions = 0
        self.revisions: dict[str, Revision] = {}  # the engine's hot set's keys, as this side's requests left them

    def revision(self, session_id: str) -> Revision | None:
        return self.revisions.get(session_id)

    def __len__(self) -> int:
        return self.count

    def update(self, stats: list[int]) -> None:
        c = self.core
        c.batch_size, c.waiting, c.steps, self.nbytes, self.count, self.hits, self.misses, self.evictions = stats

    def deleted(self, session_id: str) -> None:
        self.revisions.pop(session_id, None)
        with contextlib.suppress(Unavailable):
            self.core.send({"op": "hot", "what": "deleted", "sid": session_id})

    def discard(self, session_id: str) -> None:
        self.revisions.pop(session_id, None)
        with contextlib.suppress(Unavailable):
            self.core.send({"op": "hot", "what": "discard", "sid": session_id})
