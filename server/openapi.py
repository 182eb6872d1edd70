"""The OpenAPI document says what the server answers. FastAPI's lists, for every operation that reads input, a 422
with its own ``{"detail": [...]}`` body, where this server answers 400 in OpenAI's error shape; it names none of
the other errors the routes answer, nor the Bearer keys. Clients generated from the document (and fuzzers that
read it) followed it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from server.deps import takes_key
from server.protocol import ErrorResponse

_REF = "#/components/schemas/ErrorResponse"


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": _REF}}}}


def _keyed(routers: list[APIRouter]) -> set[tuple[str, str]]:
    """(path, method) of the operations that take an API key (the app's own routes are the routers', included
    in ways that differ between FastAPI's versions)."""
    return {(route.path_format, method.lower()) for router in routers for route in router.routes
            if isinstance(route, APIRoute) and takes_key(route)
            for method in route.methods}


def describe_errors(app: FastAPI, routers: list[APIRouter]) -> None:
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        error = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error.pop("$defs", {}))
        schemas["ErrorResponse"] = error
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer", "description":
                                                    "an API key, where the server has any (--api-keys)"}}
        keyed = _keyed(routers)
        for path, item in schema.get("paths", {}).items():
            for method, op in item.items():
                responses = op.setdefault("responses", {})
                reads = responses.pop("422", None) is not None or "requestBody" in op
                if reads:
                    responses["400"] = _error("the request is not valid (its message names the field)")
                if (path, method) in keyed:
                    responses["401"] = _error("no API key, or not one of the server's (where it has keys)")
                    op["security"] = [{"bearer": []}]
                if "{" in path:
                    responses["404"] = _error("no such session (or model)")
                if "requestBody" in op:
                    responses["413"] = _error("the body is larger than the server's --max-body-bytes, or its prompt "
                                              "or document more tokens than --max-prompt-bytes or --max-append-bytes "
                                              "(code payload_too_large: where OpenAI and vLLM answer an over-long "
                                              "prompt with a 400, this is the operator's limit, not a context window)")
                if reads or (path, method) in keyed:
                    responses["default"] = _error("any other error, e.g. 409 session_busy, 429 (retry after "
                                                  "Retry-After), 503 while the server starts or stops")
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
