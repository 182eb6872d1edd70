"""A fuzzer for the WebSocket surface, which /openapi.json (and so schemathesis) does not describe: hypothesis
generates messages (JSON of any shape, completion requests with every field of every type, raw text and binary
frames) sent over one real connection to a live server. Every answer must be a well-formed event, no error may
carry a 5xx status, nothing may reach the log as a traceback, and the connection must still serve a plain
request at the end.

The suite bounds it by a number of messages, not by time, so that a slow or busy machine sends the same number,
only slower; ``TXLSERVE_FUZZ_SECONDS`` turns it into a release run that goes on for that long."""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from tests.live import MODEL, LiveServer

SECONDS = float(os.environ.get("TXLSERVE_FUZZ_SECONDS", "0"))
MESSAGES = 500  # at least, and until one completion has run to its end
FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "logprobs", "echo", "n",
          "best_of", "stream_options", "user", "session_id", "frequency_penalty", "presence_penalty",
          "logit_bias", "suffix", "stream", "repetition_penalty", "min_p", "min_tokens", "ignore_eos",
          "stop_token_ids", "prompt_logprobs", "skip_special_tokens", "response_format", "allowed_token_ids",
          "truncate_prompt_tokens", "include_stop_str_in_output", "request_id", "priority", "cache_salt",
          "vllm_xargs", "length_penalty", "return_token_ids")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)


def field_values(session_id: str) -> st.SearchStrategy:
    """What a field may hold: anything JSON, or the values a real client sends (and their near misses)."""
    return st.one_of(
        json_values, st.integers(-3, 40), st.floats(-3, 3) | st.sampled_from([math.nan, math.inf, -math.inf]),
        st.text(max_size=30), st.lists(st.integers(-2, 300), max_size=6), st.lists(st.text(max_size=5), max_size=5),
        st.sampled_from([session_id, "no-such-session", "", "../x", "a" * 200]))


def plausible(session_id: str) -> st.SearchStrategy:
    """Completion requests a real client sends: mostly valid, so that generation, echo, logprobs, stop strings and
    the session run under the fuzzer too."""
    return st.fixed_dictionaries({"type": st.just("completion.create"), "model": st.just(MODEL)}, optional={
        "prompt": st.text(max_size=20) | st.lists(st.integers(0, 300), max_size=8)
        | st.lists(st.text(max_size=10), min_size=1, max_size=2),
        "max_tokens": st.integers(1, 40), "temperature": st.floats(0, 2.5), "top_p": st.floats(0, 1),
        "top_k": st.integers(-1, 300), "seed": st.integers(0, 2**31), "logprobs": st.integers(0, 6),
        "echo": st.booleans(), "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5),
        "session_id": st.just(session_id), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    })


def messages(session_id: str) -> st.SearchStrategy:
    completion = st.fixed_dictionaries(
        {"type": st.just("completion.create"), "model": st.sampled_from([MODEL, MODEL, "other-model", 7])},
        optional={name: field_values(session_id) for name in FIELDS} | {"unknown": json_values})
    other_type = st.dictionaries(st.just("type"), st.sampled_from(["cancel", "nothing", "", "COMPLETION.CREATE"])
                                 | json_values, min_size=1) | st.dictionaries(st.text(max_size=8), json_values)
    as_text = st.one_of(plausible(session_id), completion, other_type, json_values).map(lambda m: json.dumps(m))
    return st.one_of(as_text, as_text, st.text(max_size=40), st.binary(max_size=40))


def check_event(event: object) -> bool:
    """A well-formed event; True when it ends the request."""
    assert isinstance(event, dict) and event.get("type") in ("completion.delta", "completion.done", "error"), event
    if event["type"] == "error":
        assert set(event["error"]) == {"message", "type", "param", "code"} and event["error"]["message"], event
        assert "Traceback" not in event["error"]["message"], event
        assert 400 <= event["status"] < 500, event  # bad input is never the server's fault
        return True
    if event["type"] == "completion.done":
        assert event["finish_reason"] in ("stop", "length", "cancelled") and event["usage"], event
        return True
    assert isinstance(event["text"], str), event
    return False


@pytest.mark.timeout(int(SECONDS) + 240)  # the suite's 300 s would cut a longer release run
def test_no_websocket_message_gets_a_server_error(fuzz_server: LiveServer):
    url = fuzz_server.url
    session_id = httpx.post(url + "/v1/sessions", json={"text": "A session the fuzzer may continue."},
                            timeout=30).json()["id"]
    deadline, sent, outcomes = time.monotonic() + SECONDS, [0], Counter()

    def more() -> bool:
        waiting_for_done = not outcomes["completion.done"] and sent[0] < 10 * MESSAGES  # then the assert says so
        return sent[0] < MESSAGES or waiting_for_done or time.monotonic() < deadline

    with connect(url.replace("http://", "ws://") + "/v1/ws", open_timeout=30) as conn:

        @settings(max_examples=200, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(message=messages(session_id))
        def one(message: str | bytes) -> None:
            if not more():
                return  # the rest of this batch of examples is drawn and dropped
            conn.send(message)
            sent[0] += 1
            try:
                parsed = json.loads(message)
            except (ValueError, UnicodeDecodeError, RecursionError):
                parsed = None
            if isinstance(parsed, dict) and parsed.get("type") == "cancel":
                return  # nothing is running: a cancel is ignored without a reply
            while not check_event(event := json.loads(conn.recv(timeout=60))):
                pass
            outcomes[event["type"]] += 1

        while more():  # batches of 200 examples until enough has run
            one()
        print(f"{sent[0]} messages: {dict(outcomes)}")
        assert sent[0] >= MESSAGES and outcomes["error"] >= 10, (sent, outcomes)  # it really ran
        assert outcomes["completion.done"] >= 1, outcomes  # and some of it generated
        conn.send(json.dumps({"type": "completion.create", "model": MODEL, "prompt": "still here", "max_tokens": 3}))
        events = []
        while not check_event(event := json.loads(conn.recv(timeout=60))):
            events.append(event)
        assert event["type"] == "completion.done" and event["usage"]["completion_tokens"] == 3, event
    assert httpx.get(url + "/ready", timeout=30).status_code == 200
    assert "Traceback" not in fuzz_server.log.read_text()
