"""Liveness, readiness, metrics and the model list."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from server.completion import check_model
from server.deps import owner, runtime
from server.errors import error_body
from server.runtime import Runtime
from server.workers import all_metrics
from txlserve import version
from txlserve.errors import EngineDead, StoreUnavailable

router = APIRouter()
log = logging.getLogger("txlserve.health")
_said = [""]  # the store's last failure /ready logged
_VERSION = version()


@router.get("/health")  # HEAD too (app.HeadAsGet), as monitors and some load balancers probe
async def health(request: Request) -> Response:
    """Alive unless the engine's process (--engine-process) or the embedded Redis this server started has died:
    then a liveness probe restarts us (/ready alone said a dead Redis, and nothing restarted the server)."""
    rt: Runtime | None = getattr(request.app.state, "runtime", None)
    if rt is not None and rt.engine_dead:
        return JSONResponse(error_body(rt.engine_dead, EngineDead.type, None, EngineDead.code), 503)
    if rt is not None and (gone := rt.store.embedded_exited):
        return JSONResponse(error_body(gone, "service_unavailable_error", None, "store_dead"), 503)
    return JSONResponse({"status": "ok"})


@router.get("/ping")  # vLLM's (SageMaker's probe): /health's answer
@router.post("/ping")  # a route each, so each method has its own operation id in the OpenAPI schema
async def ping(request: Request) -> Response:
    return await health(request)


@router.get("/ready")
async def ready(request: Request) -> Response:
    rt: Runtime | None = getattr(request.app.state, "runtime", None)
    if rt is None or not rt.ready:
        why = "starting" if rt is None else "draining" if rt.draining else EngineDead.code if rt.engine_dead else \
            "starting"
        return JSONResponse(error_body(f"not ready: {why}", "service_unavailable_error", None, why), 503)
    try:
        await rt.store.ping()
    except StoreUnavailable as err:  # why, in the log: this route is open, and the message named Redis's address
        if str(err) != _said[0]:  # once per cause, not once per probe
            log.warning("not ready: %s", err)
            _said[0] = str(err)
        return JSONResponse(error_body("not ready: the session store (Redis) does not answer; the server's log "
                                       "says why", "service_unavailable_error", None, err.code), 503)
    _said[0] = ""
    body = {"status": "ready", "model": rt.settings.model_name}
    if rt.worker is not None:  # which of the --workers answered (each connection stays with one)
        body["worker"] = rt.worker
    return JSONResponse(body)


@router.get("/version")  # vLLM's; open, as its /health is
async def version() -> dict:
    return {"version": _VERSION}


@router.get("/metrics")
async def metrics(rt: Runtime = Depends(runtime)) -> Response:
    body = await all_metrics(rt, rt.peers) if rt.peers else await rt.render_metrics()  # --workers: every worker's
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def _served(rt: Runtime) -> dict:
    cfg = rt.engine.config
    return {"id": rt.settings.model_name, "object": "model", "created": rt.started, "owned_by": "txlserve",
            "root": rt.settings.model_name, "parent": None,  # vLLM's card, without max_model_len: no context
            "n_layer": cfg.n_layer, "d_model": cfg.d_model,  # length bounds a Transformer-XL's prompt and output
            "mem_len": rt.engine.mem_len, "clamp_len": rt.engine.clamp_len, "fingerprint": rt.engine.fingerprint,
            "max_tokens_limit": rt.settings.max_tokens_limit}  # a client checks max_tokens before it makes anything


@router.get("/v1/models")
async def models(rt: Runtime = Depends(runtime), _owner: str | None = Depends(owner)) -> dict:
    return {"object": "list", "data": [_served(rt)]}


@router.get("/v1/models/{model:path}")  # OpenAI's retrieve (client.models.retrieve); a name may hold '/'
async def model(model: str, rt: Runtime = Depends(runtime), _owner: str | None = Depends(owner)) -> dict:
    check_model(rt, model)
    return _served(rt)
