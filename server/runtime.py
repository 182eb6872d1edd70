"""What the server opens at start-up and closes at shutdown: engine, scheduler, store, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from memory_store import MemoryStore, ModelIdentity
from model.bundled import resolve_checkpoint
from model.engine import Engine
from model.train import auto_dtype, pick_device
from server.core_spawn import core_settings
from server.cpu_latency import CpuLatencyQos, guest_halt_poll_ns
from server.engine_core import EngineCore
from server.hot_states import HotStates
from server.metrics import Metrics
from server.scheduler import Scheduler
from server.settings import Settings
from txlserve import version

if TYPE_CHECKING:
    from server.service import Run

log = logging.getLogger("txlserve")

# How long a drain waits for the engine process to answer a ping once it cancelled the runs still going: its reader
# thread answers within milliseconds even while a long prompt is read; a stopped or wedged one is killed past it.
DRAIN_PING_S = 5.0


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    scheduler: Scheduler
    store: MemoryStore
    metrics: Metrics
    hot: HotStates
    ready: bool = False
    draining: bool = False
    closed: bool = False
    runs: set = field(default_factory=set)  # in-flight request runs, awaited at shutdown
    # WebSocket completions until their last message is sent: a run's end comes before it, and the drain's close
    # of every socket must not cut it (Server.shutdown in server/serve.py)
    ws_streams: set = field(default_factory=set)
    drain_started: asyncio.Event = field(default_factory=asyncio.Event)  # idle WebSockets close at once
    cpu_latency: CpuLatencyQos = field(default_factory=lambda: CpuLatencyQos(None))  # held while runs run
    core: EngineCore | None = None  # the engine's process (--engine-process); engine and scheduler are then it
    worker: int | None = None  # this process's index among --workers (server.workers); None: the only one
    peers: str | None = None  # with workers: the directory of their metrics sockets (server.workers.all_metrics)
    started: int = field(default_factory=lambda: int(time.time()))  # when this server loaded its model (/v1/models)
    _draining: asyncio.Task | None = field(default=None, repr=False)
    sweeper: asyncio.Task | None = field(default=None, repr=False)
    watchdog: asyncio.Task | None = field(default=None, repr=False)

    def track(self, run: Run) -> None:
        """A request's run is in flight until its task ends: awaited by the drain, and the CPU latency request
        (``cpu_latency_qos_us``) held meanwhile."""
        self.runs.add(run)
        self.cpu_latency.busy()
        run.task.add_done_callback(lambda _: self._untrack(run))

    def _untrack(self, run: Run) -> None:
        self.runs.discard(run)
        self.cpu_latency.idle()

    def store_died(self, why: str) -> None:
        """The embedded Redis this server started is gone and nothing starts it again: what a request makes on a
        session can no longer be stored, so each one that holds a lease stops now (its commit then fails: a 503
        event) rather than streaming until its end or its lease's next renewal (a helper's 4,096-token streams ran
        8 s past the death, every token thrown away)."""
        held = [run for run in self.runs if run.lease is not None and not run.lease.released]
        if held:
            log.error("%s: stopping the %d request(s) on sessions (nothing they make can be stored)", why, len(held))
        for run in held:
            run.cancel()

    def start_watchdog(self) -> None:
        """Ping the engine's process while requests run; one that answers none for ``engine_timeout_s`` is hung
        (stopped, wedged): its requests waited with no end and its sessions stayed leased, with /health 200."""
        if self.core is not None and self.settings.engine_timeout_s:
            self.watchdog = asyncio.get_running_loop().create_task(self._watch_engine())

    async def _watch_engine(self) -> None:
        timeout, core = self.settings.engine_timeout_s, self.core
        while core.dead is None:
            await asyncio.sleep(min(5.0, timeout / 2))
            if self.runs and not await core.answers(timeout) and self.runs and core.dead is None:
                why = f"the engine process answered nothing for {timeout:g} s (hung or stopped)"
                log.error("%s: it is killed", why)
                core.kill(why)

    def start_sweeper(self) -> None:
        """Every ``cold_sweep_s``, check Redis's eviction policy and run the cold-tier policy where it is set: idle
        sessions, then any over the warm byte budget, keep only their token window in Redis. Every replica may
        run it (a demotion is compare-and-set). The check runs without a cold tier too: an evicting policy set
        while the server ran went unsaid there (found by a review)."""
        self.sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        """A failure is logged once, and its end once: with Redis gone for good (a dead embedded one), a warning on
        every tick filled the log (every second with ``--cold-sweep-s 1``, found by a helper)."""
        s = self.settings
        failing = False
        while True:
            await asyncio.sleep(s.cold_sweep_s)
            try:
                await self.store.check_eviction_policy()
                moved = await self.store.sweep(idle_s=s.cold_after_s or None, warm_budget_bytes=(
                    s.warm_budget_mb << 20) or None) if s.cold_after_s or s.warm_budget_mb else 0
            except Exception as err:  # Redis away: try again next time
                if not failing:
                    log.warning("cold-tier sweep failed (retried every %g s, logged again once it works): %s",
                                s.cold_sweep_s, err)
                failing = True
                continue
            if failing:
                log.info("cold-tier sweep works again")
                failing = False
            if moved:
                log.info("cold tier: %d sessions now keep only their token window", moved)

    def drain(self) -> asyncio.Task:
        """The one drain: refuse new work, let in-flight runs finish within ``shutdown_timeout_s``, then cancel
        the rest (they commit what they generated). One task, whoever asks first: SIGTERM, which must not wait
        for open connections to close first, or the lifespan shutdown."""
        if self._draining is None:
            self.ready, self.draining = False, True
            self.drain_started.set()
            self._draining = asyncio.get_running_loop().create_task(self._drain_runs())
        return self._draining

    async def _drain_runs(self) -> None:
        runs = list(self.runs)
        if not runs:
            return
        # said at once: an operator's SIGTERM was otherwise met by silence until the streams ended (found by a helper)
        # "now": the Ctrl-C that began a drain printed this line, which read as if that one should have stopped it
        log.info("draining: waiting up to %g s for %d request(s) running (new connections are refused; a Ctrl-C "
                 "now stops the server at once)", self.settings.shutdown_timeout_s, len(runs))
        _, pending = await asyncio.wait([r.task for r in runs], timeout=self.settings.shutdown_timeout_s)
        if not pending:
            return
        log.info("draining: %d request(s) still running after %g s; cancelling them (each commits what it "
                 "generated)", len(pending), self.settings.shutdown_timeout_s)
        for r in runs:
            if r.task in pending:
                r.cancel()
        core = self.core
        if core is not None and core.dead is None and not await core.answers(
                min(DRAIN_PING_S, self.settings.engine_timeout_s or DRAIN_PING_S)):
            # a stopped or wedged engine never hears the cancels: its runs would wait out the drain's 10 s, then
            # uvicorn's cut their streams mid-event and the process exited ~25 s past --shutdown-timeout-s, longer
            # than a container's stop grace; killed, its runs end now, each stream with a 503 event and [DONE]
            core.kill("the engine process answered nothing while the server drained (hung or stopped)")
        await asyncio.wait(pending, timeout=10)

    @property
    def most_runs(self) -> int:
        """Runs this server process holds at once, whatever their phase: the batch, and ``--max-queue`` beyond it
        (past it a request is a 429; a request's choices are runs). A request waiting beyond the batch holds its
        session's state (restored as it is submitted), so at most as many wait as ``--batch-mb`` holds rows: the
        waiting states take no more memory than the batch's own (256 of the bundled model's took 800 MB beside a
        2 MB batch, and a model of 354 MB a session would have held 90 GB; found by a helper). With
        ``--api-server-count`` N sharing one engine, each takes 1/N of the whole, or N of them held N times it."""
        held = max(1, (self.settings.batch_mb << 20) // max(1, self.engine.row_bytes))
        n = max(1, self.settings.api_server_count)  # API servers sharing one engine: each its share of the whole
        return max(1, (self.scheduler.capacity + min(n * self.settings.max_queue, held)) // n)

    @property
    def engine_dead(self) -> str | None:
        """Why the engine's process is gone (it died), else None."""
        return None if self.core is None else self.core.dead

    async def render_metrics(self) -> bytes:
        """This process's /metrics text, with the engine's figures as of now."""
        if self.core is not None:
            await self.core.refresh()
        return self.metrics.render()

    @property
    def storage_dtype(self) -> torch.dtype:
        return getattr(torch, self.settings.storage_dtype)


WARM_UP_TIMEOUT_S = 300.0


async def open_runtime(settings: Settings) -> Runtime:
    cpu_latency = CpuLatencyQos(settings.cpu_latency_qos_us)
    cpu_latency.check()  # before the model loads
    # so is a Redis URL that cannot be parsed, or a Redis that does not answer
    await MemoryStore.check_reachable(settings.redis_url, settings.store_timeout_s)
    device = pick_device(settings.device)
    dtype = auto_dtype(device) if settings.dtype == "auto" else getattr(torch, settings.dtype)
    checkpoint = resolve_checkpoint(settings.checkpoint)
    if settings.engine_process:
        return await _open_with_core(settings, checkpoint, device, dtype, cpu_latency)
    engine = await asyncio.to_thread(Engine.from_checkpoint, checkpoint, device=device, dtype=dtype,
                                     mem_len=settings.mem_len, clamp_len=settings.clamp_len,
                                     prefill_chunk=settings.prefill_chunk, enforce_eager=settings.enforce_eager,
                                     prefill_products=settings.prefill_products)
    store = await _open_store(settings, engine, device)
    scheduler = Scheduler(engine, max_batch=settings.max_batch, batch_bytes=settings.batch_mb << 20,
                          prefill_chunk=engine.prefill_chunk, stream_interval=settings.stream_interval,
                          overlap=not settings.disable_overlap_schedule)
    scheduler.start()
    # the engine thread traces (CPU) or captures (GPU) its steps before the server listens: a capture must not
    # meet other threads' work on the GPU, and the first requests must not wait for them
    if not await asyncio.to_thread(scheduler.warmed.wait, WARM_UP_TIMEOUT_S):
        log.warning("the engine's warm-up took over %.0f s; serving meanwhile", WARM_UP_TIMEOUT_S)
    hot = HotStates(settings.hot_cache_mb << 20)
    rt = Runtime(settings, engine, scheduler, store, Metrics(scheduler, store, hot, cpu_latency), hot,
                 cpu_latency=cpu_latency)
    return _opened(rt, checkpoint, device, torch.get_num_threads())


async def _open_store(settings: Settings, engine: Engine | EngineCore, device: torch.device) -> MemoryStore:
    identity = ModelIdentity(fingerprint=engine.fingerprint, n_layer=engine.config.n_layer,
                             d_model=engine.config.d_model, tokenizer=engine.tokenizer_id,
                             window_len=engine.window_len)
    store = MemoryStore.from_url(settings.redis_url, identity=identity, device=device,
                                 hot_cache_mb=0, ttl_s=settings.session_ttl_s,  # hot sessions: HotStates
                                 data_dir=settings.data_dir, lease_ttl_ms=settings.lease_ttl_ms,
                                 op_timeout_s=settings.store_timeout_s,
                                 legacy_format=settings.legacy_store_format)
    await store.start()
    return store


async def _open_with_core(settings: Settings, checkpoint: str, device: torch.device, dtype: torch.dtype,
                          cpu_latency: CpuLatencyQos) -> Runtime:
    """The engine in its own process (server/engine_core.py): this process keeps HTTP, the store and the
    requests' leases and commits; the engine, its scheduler and the hot sessions live there."""
    core = EngineCore(core_settings(settings, checkpoint, device, dtype))
    await asyncio.to_thread(core.start)
    try:
        store = await _open_store(settings, core, torch.device("cpu"))  # tensors here only cross the wire
    except BaseException:
        await asyncio.to_thread(core.stop)
        raise
    rt = Runtime(settings, core, core, store, Metrics(core, store, core.hot, cpu_latency), core.hot,  # type: ignore[arg-type]
                 cpu_latency=cpu_latency, core=core)

    def died(why: str) -> None:  # /ready turns 503 and new requests are refused; an orchestrator restarts us
        rt.ready = False

    def deleted(session_id: str) -> None:  # through another API server of the engine: as a DELETE here
        for run in list(rt.runs):
            if run.session_id == session_id:
                run.lease_lost(deleted=True)
    core.on_death, core.on_deleted = died, deleted
    core.listen(asyncio.get_running_loop())
    return _opened(rt, checkpoint, device, core.threads)


def _opened(rt: Runtime, checkpoint: str, device: torch.device, threads: int) -> Runtime:
    settings, engine, store = rt.settings, rt.engine, rt.store
    loop = asyncio.get_running_loop()

    def store_died(why: str) -> None:  # on the store's watcher thread
        with contextlib.suppress(RuntimeError):  # the loop has closed: the server is gone already
            loop.call_soon_threadsafe(rt.store_died, why)

    store.on_embedded_exit(store_died)
    rt.metrics.serving(version(), settings.model_name, engine.fingerprint)
    where = "in its own process, " if rt.core is not None else ""
    log.info("loaded %s (%s, %d layers, d_model %d, mem_len %d) on %s, %s%d torch threads; sessions in %s; "
             "http://%s:%d", checkpoint, settings.model_name, engine.config.n_layer, engine.config.d_model,
             engine.mem_len, device, where, threads, store.where, settings.host, settings.port)
    if settings.cpu_latency_qos_us is None and device.type == "cpu" and guest_halt_poll_ns() == 0:
        log.info("tip: --cpu-latency-qos-us 0 streams one request 10-15% faster on this VM, whose idle CPUs halt at "
                 "once (README, Deployment)")
    rt.start_sweeper()
    rt.start_watchdog()
    rt.ready = True
    return rt


async def close_runtime(rt: Runtime, *, at_once: bool = False) -> None:
    """Drain (:meth:`Runtime.drain`), then stop the engine and close the store. Idempotent. ``at_once`` (a second
    Ctrl-C): no drain; the runs are cancelled where they stand, and the engine and the store (its embedded Redis,
    which a forced exit had left running) are closed."""
    if rt.closed:
        return
    rt.closed = True
    for task in (rt.sweeper, rt.watchdog):
        if task is not None:
            task.cancel()
    if at_once:
        for r in list(rt.runs):
            r.cancel()
    else:
        await rt.drain()
    rt.cpu_latency.close()
    await asyncio.to_thread(rt.scheduler.stop)
    await rt.store.aclose()
