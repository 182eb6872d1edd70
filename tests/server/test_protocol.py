"""The response models render OpenAI's shapes; the per-token SSE fast path renders the same bytes."""

from __future__ import annotations

import json

import pytest

from server.completion import Completion
from server.protocol import CompletionRequest
from server.routes.completions import _sse


@pytest.mark.parametrize("text", ["a", " the", "\n", 'quote " and \\ backslash', "é ü 中文 🎉", "\u0000", "\t\r",
                                  "txl-text", "\u2028"])
def test_text_event_is_the_rendered_chunk(text):
    comp = Completion(CompletionRequest(model="m", prompt="x"), "m")
    assert comp.text_event(text) == _sse(comp.chunk(text).dump())
    assert comp.text_event(text + text) == _sse(comp.chunk(text + text).dump())  # the template is reused


def test_chunk_shapes():
    comp = Completion(CompletionRequest(model="m", prompt="x"), "m", system_fingerprint="f:m24:c0")
    chunk = json.loads(comp.text_event("hi")[6:])
    assert set(chunk) == {"id", "object", "created", "model", "system_fingerprint", "choices"}  # no usage, no
    assert chunk["system_fingerprint"] == "f:m24:c0"  # session mid-stream; OpenAI's backend configuration
    assert chunk["choices"] == [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]
