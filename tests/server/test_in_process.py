"""`txlserve serve --no-engine-process`: the engine on a thread of the server's process, as before the engine
had a process of its own (the default, which every other end-to-end test runs).

The end-to-end tests of completions, streams, cancels and portable sessions run here again, imported, against
such servers (this module's ``server`` and ``servers`` fixtures replace the shared ones): every path a session
takes (new, hot, read from Redis, rebuilt from its window, of another checkpoint) goes through the in-process
lifecycle (server/service.py's Run._main).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live import LiveServer
from tests.server.test_completions import (  # noqa: F401  (collected here again, against this module's server)
    test_a_batch_of_prompts_and_n_samples_are_choices_in_openais_order,
    test_a_prompts_n_choices_read_it_once,
    test_a_requests_lifecycle_phases_are_counted_once_each_and_fit_in_its_latency,
    test_a_stop_token_ends_the_text_before_it_and_the_session_holds_it,
    test_completion_shape,
    test_error_mid_stream_is_an_error_event_then_done,
    test_fork_independence,
    test_logprobs_zero_names_the_sampled_token_alone,
    test_memory_is_fixed_size,
    test_openai_sdk_plain_and_streaming,
    test_openais_four_prompt_forms,
    test_prompt_logprobs_are_vllms_and_the_reference_forwards,
    test_return_token_ids_gives_the_prompts_and_the_generated_ids_on_every_surface,
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
    test_a_stream_of_n_choices_left_while_their_prompt_is_read_ends_them_all,
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

IN_PROCESS = ("--no-engine-process",)


@pytest.fixture(scope="module")
def server(checkpoint: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    srv = LiveServer(checkpoint, redis_url=redis_url, data_dir=tmp_path_factory.mktemp("in-process"),
                     args=IN_PROCESS).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def servers(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LiveServer]]:
    """test_portable's three servers, each with its engine on a thread."""
    yield from portable_servers(checkpoint, tmp_path_factory, IN_PROCESS)
