"""`txlserve serve --engine-process`: the engine, its scheduler and the hot sessions in a process of their own.

The end-to-end tests of completions, streams, cancels and portable sessions run here again, imported, against
such a server (this module's ``server`` and ``servers`` fixtures replace the shared ones): every path a session
takes (new, hot, read from Redis, rebuilt from its window, of another checkpoint) crosses the wire between the
two processes. Then what only this mode has: the engine process dying, and stopping with the server.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.engine_core import error_from, error_head, pack, unpack
from tests.live import MODEL, LiveServer
from tests.procs import pid_alive, wait_exit
from tests.server.test_completions import (  # noqa: F401  (collected here again, against this module's server)
    test_completion_shape,
    test_error_mid_stream_is_an_error_event_then_done,
    test_fork_independence,
    test_logprobs_zero_names_the_sampled_token_alone,
    test_memory_is_fixed_size,
    test_openai_sdk_plain_and_streaming,
    test_openais_four_prompt_forms,
    test_seed_determinism_and_logprobs,
    test_session_crud,
    test_split_invariance_through_http,
    test_sse_exact_shape,
    test_stop_and_echo,
    test_three_completions_equal_one,
)
from tests.server.test_portable import (  # noqa: F401
    portable_servers,
    test_a_cold_session_is_rebuilt_from_its_window_to_the_same_continuation,
    test_a_session_imported_at_the_largest_position_keeps_working,
    test_a_session_of_another_checkpoint_with_the_same_tokenizer_is_rebuilt,
    test_an_exported_session_continues_identically_on_a_server_with_its_own_store,
    test_bad_imports_are_refused_with_the_right_status,
)
from tests.server.test_resilience import (  # noqa: F401
    test_a_client_gone_before_its_run_starts_commits_nothing,
    test_client_disconnect_stops_generation_and_commits,
    test_non_streaming_client_that_gives_up_stops_generation,
    test_stream_left_during_prefill_commits_nothing,
    test_websocket_cancel_or_leave_while_the_prompt_is_read_stores_nothing,
    test_websocket_dropped_mid_stream_cancels,
)
from tests.server.test_ws import (  # noqa: F401
    test_ws_cancel_commits_what_was_generated,
    test_ws_cancel_hands_over_the_text_held_back,
    test_ws_streams_same_text_as_http_and_serves_many_in_turn,
)

CORE = ("--engine-process",)


@pytest.fixture(scope="module")
def server(checkpoint: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("core"), args=CORE).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def servers(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LiveServer]]:
    """test_portable's three servers, each with its engine in its own process."""
    yield from portable_servers(checkpoint, tmp_path_factory, CORE)


def _engine_pid(srv: LiveServer) -> int:
    """The engine process: the server's child running server.engine_core (from /proc: no psutil)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == srv.proc.pid and "server.engine_core" in cmdline:
                return int(entry.name)
    raise AssertionError("the server has no engine process")


def _complete(srv: LiveServer, **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=60)


def test_a_session_continued_hot_read_back_from_redis_and_forked_equals_one_request(server):
    """Create (the engine's new state, exported), append (hot: the engine's own state), fork (a copy only Redis
    holds: the engine asks for it), continue: the text one request over the whole document gives."""
    a, b, c = "It was the best of times, ", "it was the worst of times, ", "it was the age of wisdom"
    truth = _complete(server, prompt=a + b + c, max_tokens=24, logprobs=1).json()["choices"][0]
    sid = httpx.post(server.url + "/v1/sessions", json={"text": a}, timeout=60).json()["id"]
    appended = httpx.post(f"{server.url}/v1/sessions/{sid}/append", json={"text": b}, timeout=60).json()
    assert appended["tier"] == "hot" and appended["tokens_seen"] == len(a + b)
    fork = httpx.post(f"{server.url}/v1/sessions/{sid}/fork", timeout=60).json()["id"]
    assert httpx.get(f"{server.url}/v1/sessions/{fork}", timeout=10).json()["tier"] == "redis"
    for session in (sid, fork):
        out = _complete(server, prompt=c, max_tokens=24, logprobs=1, session_id=session).json()
        choice = out["choices"][0]
        assert choice["text"] == truth["text"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(truth["logprobs"]["token_logprobs"], abs=1e-4)
        assert out["session"]["tokens_seen"] == len(a + b + c) + 24
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'txlserve_session_restores_total{source="hot"}' in metrics
    assert 'txlserve_session_restores_total{source="redis"}' in metrics


def test_an_append_scores_its_text_and_its_tokens_as_one_request_does(server):
    text = "To be, or not to be, that is the question"
    sid = httpx.post(server.url + "/v1/sessions", json={"text": ""}, timeout=60).json()["id"]
    out = httpx.post(f"{server.url}/v1/sessions/{sid}/append", json={"text": text, "logprobs": 2}, timeout=60).json()
    echo = _complete(server, prompt=text, max_tokens=1, echo=True, logprobs=2).json()["choices"][0]["logprobs"]
    assert out["logprobs"]["token_logprobs"] == pytest.approx(echo["token_logprobs"][:len(text)], abs=1e-4)
    assert out["logprob"] == pytest.approx(sum(echo["token_logprobs"][1:len(text)]), abs=1e-3)


def test_what_the_engine_refuses_is_the_same_error(server):
    r = _complete(server, prompt="", max_tokens=3)  # nothing to continue from: refused in the engine process
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "nothing to continue from" in r.json()["error"]["message"]
    assert _complete(server, prompt="ok", max_tokens=2).status_code == 200  # and it goes on


def test_a_delete_stops_the_request_running_on_the_session(server):
    sid = httpx.post(server.url + "/v1/sessions", json={"text": "Story: "}, timeout=60).json()["id"]
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "go", "max_tokens": 4000, "stream": True, "session_id": sid}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    assert httpx.delete(f"{server.url}/v1/sessions/{sid}", timeout=30).status_code == 200
    assert events[-1]["error"]["code"] == "session_not_found" and len(events) < 4000, events[-1]
    assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=10).status_code == 404


def test_the_wire_carries_errors_as_the_one_tree(server):
    from txlserve.errors import SessionIncompatible
    err = error_from(error_head(SessionIncompatible("another model", param="session_id")))
    assert type(err) is SessionIncompatible and err.param == "session_id" and err.status == 422
    bug = error_from(error_head(KeyError("x")))
    assert type(bug) is RuntimeError and "KeyError" in str(bug)  # a bug stays a 500, not a user's error
    assert unpack(pack({"op": "state", "n": [1, None]}, b"\x00\xff")) == ({"op": "state", "n": [1, None]}, b"\x00\xff")


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on pidfds")
def test_an_engine_process_that_dies_fails_requests_and_health_and_the_server_still_stops(checkpoint, redis_url,
                                                                                          tmp_path):
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path, args=CORE).start()
    try:
        pid = _engine_pid(srv)
        sid = httpx.post(srv.url + "/v1/sessions", json={"text": "Kept "}, timeout=60).json()["id"]
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "go", "max_tokens": 4000, "stream": True, "session_id": sid}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            os.kill(pid, signal.SIGKILL)
            rest = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert rest and rest[-1]["error"]["type"] == "service_unavailable_error", rest[-1:]
        assert "engine process exited" in rest[-1]["error"]["message"]
        deadline = time.monotonic() + 30
        while (health := httpx.get(srv.url + "/health", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "/health stayed 200"
            time.sleep(0.05)  # poll, bounded by the deadline
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert httpx.get(srv.url + "/ready", timeout=10).json()["error"]["code"] == "engine_dead"
        r = _complete(srv, prompt="again", max_tokens=2)
        assert r.status_code == 503 and "engine process exited" in r.json()["error"]["message"], r.text
        assert httpx.get(f"{srv.url}/v1/sessions/{sid}", timeout=10).json()["tokens_seen"] == len("Kept ")
        assert srv.terminate(timeout=30) in (0, -signal.SIGTERM)
    finally:
        srv.stop()


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on pidfds")
def test_the_engine_process_stops_with_the_server_even_when_it_is_killed(checkpoint, redis_url, tmp_path):
    for stop in ("terminate", "kill"):
        srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path / stop, args=CORE).start()
        try:
            pid = _engine_pid(srv)
            assert _complete(srv, prompt="hi", max_tokens=2).status_code == 200
            getattr(srv, stop)()
            assert wait_exit([pid], timeout=30) and not pid_alive(pid), f"the engine process outlived a {stop}"
        finally:
            srv.stop()
