"""The OpenAPI document says what the server answers, and gives "Try it out" bodies it takes. FastAPI's lists, for
every operation that reads input, a 422 with its own ``{"detail": [...]}`` body, where this server answers 400 in
OpenAI's error shape; it names none of the other errors the routes answer, nor the Bearer keys. Clients generated
from the document (and fuzzers that read it) followed it."""

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


def _examples(model: str) -> dict[tuple[str, str], dict[str, Any]]:
    """A body each of these operations takes as it is: the docs' "Try it out" made its own from the schemas, which
    the server refused (a seed of -2^63, rounded by JavaScript past the bound; "model": "string"; beam search)."""
    return {
        ("/v1/completions", "post"): {"model": model, "prompt": "ROMEO:", "max_tokens": 32, "temperature": 0.8},
        ("/v1/sessions", "post"): {"text": "ROMEO:\nBut soft, what light through yonder window breaks?\n",
                                   "metadata": {"title": "balcony"}},
        ("/v1/sessions/{session_id}", "post"): {"metadata": {"title": "balcony, act 2", "draft": None}},
        ("/v1/sessions/{session_id}/append", "post"): {"text": "JULIET:\nAy me!\n"},
        ("/v1/sessions/{session_id}/fork", "post"): {"metadata": {"title": "balcony (fork)"}},
        ("/tokenize", "post"): {"prompt": "ROMEO:"},
        ("/detokenize", "post"): {"tokens": [82, 79, 77, 69, 79, 58]},  # "ROMEO:" in bytes (the bundled model's)
    }


def describe_errors(app: FastAPI, routers: list[APIRouter], *, model: str) -> None:
    generate: Callable[[], dict[str, Any]] = app.openapi
    examples = _examples(model)

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
                if (path, method) in examples:
                    op["requestBody"]["content"]["application/json"]["example"] = examples[path, method]
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
